"""fxstab under DistributedDataParallel and FSDP2 (fully_shard): 2 processes on localhost (gloo),
spawned here."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(wrapper: str, rank: int, backend, steps: int = 2):
    from models import MLP

    torch.manual_seed(0)
    model = MLP()
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        run = fully_shard(model)
    f = torch.compile(run, backend=backend) if backend is not None else run
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        f(x).pow(2).mean().backward()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()]


def _worker(rank: int, world: int, port: int, out: str, wrapper: str) -> None:
    import os

    import fxstab

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        be = fxstab.backend()
        analysed = _train(wrapper, rank, be)
        plain = _train(wrapper, rank, None)
        gathered = be.digit_map(gather=True)
        result = {"same": all(torch.equal(a, b) for a, b in zip(analysed, plain)),
                  "gathered": gathered.to_json(), "local": be.digit_map().to_json()}
        with open(f"{out}/rank{rank}.json", "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_training_is_unchanged_and_the_gathered_map_merges_every_rank(tmp_path, wrapper):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), wrapper), nprocs=2, join=True)
    from fxstab.digitmap import DigitMap

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["same"] for r in results)  # training bit for bit as without fxstab
    maps = [DigitMap.from_json(r["gathered"]) for r in results]
    assert maps[0].as_dict()["operators"] == maps[1].as_dict()["operators"]  # one map
    local = [DigitMap.from_json(r["local"]) for r in results]
    m = maps[0]
    assert m.metadata["world_size"] == 2
    assert m.metadata["analysed_calls"] == sum(x.metadata["analysed_calls"] for x in local)
    for name, op in m.operators.items():
        # merged as calls are merged: the calls of both ranks, every rank named
        assert op.calls == sum(x.operators[name].calls for x in local), name
        assert set(m.metadata["provenance"][name]) == {"0", "1"}
        assert op.numel == sum(x.operators[name].numel for x in local)
    assert "fc1/linear#0" in m.operators


def test_gather_without_a_process_group_says_what_to_do():
    import fxstab

    be = fxstab.backend()
    with pytest.raises(ValueError, match="init_process_group"):
        be.digit_map(gather=True)


def _never_compiled(rank: int, world: int, port: int, out: str) -> None:
    import os
    import warnings

    import fxstab
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        be = fxstab.backend()
        run = torch.compile(DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())),
                            backend=be)
        run(torch.randn(2, 4)).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gathered = be.digit_map(gather=True)
        with open(f"{out}/rank{rank}.json", "w") as fh:
            json.dump({"graphs": len(be.graphs), "operators": len(gathered.operators),
                       "warnings": [str(w.message) for w in caught]}, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_backend_that_never_ran_says_so():
    """torch 2.13's dynamo compiles no frame of DDP(nn.Sequential(...)): the map is empty, and
    digit_map says why and what to do instead of merging empty maps without a word."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_never_compiled, args=(1, _free_port(), tmp), nprocs=1, join=True)
        result = json.loads(open(f"{tmp}/rank0.json").read())
    assert result["graphs"] == 0 and result["operators"] == 0
    assert any("never ran" in w and "ddp.module" in w for w in result["warnings"])


def test_a_backend_that_ran_does_not_warn():
    import warnings

    import fxstab
    from fxstab.backend import NOT_CALLED
    from models import MLP

    be = fxstab.backend()
    model = torch.compile(MLP(), backend=be)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(be.digit_map().operators) == 0
    # not called yet (issue 56, item 12): that, not DDP's advice
    messages = [str(w.message) for w in caught]
    assert NOT_CALLED in messages and not any("DDP" in m for m in messages), messages
    model(torch.randn(4, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(be.digit_map().operators) > 0
    assert not any("never ran" in str(w.message) for w in caught)
