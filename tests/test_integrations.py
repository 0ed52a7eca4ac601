"""The trainer callbacks (fxstab/integrations/) with the real trainers, on the CPU: a tiny
GPT-2 trained 20 steps by ``transformers.Trainer`` and by Lightning, one step in 10 analysed.
Each run writes the maps and pages, logs the headline figures to TensorBoard through the
trainer's own logger, and trains exactly as it does without the callback (the same weights,
bit for bit)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import fxstab
from fxstab.digitmap import DigitMap

transformers = pytest.importorskip("transformers", reason="the test extra installs it")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
pytest.importorskip("tensorboard", reason="the test extra installs it")

pytestmark = pytest.mark.slow

STEPS, EVERY = 20, 10
TAGS = {"fxstab/worst_forward_digits", "fxstab/worst_grad_digits", "fxstab/nan_origins",
        "fxstab/findings", "fxstab/worst_forward_run_digits", "fxstab/worst_grad_run_digits"}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def batches(n: int = 32) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def scalars(folder: Path) -> dict:
    """TensorBoard's scalars under ``folder``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def _check_maps(folder: Path) -> None:
    maps = sorted(folder.glob("step-*.json"))
    assert [m.name for m in maps] == ["step-000010.json", "step-000020.json"], maps
    dm = DigitMap.load(maps[-1])
    assert any(op.kind == "param_grad" for op in dm.operators.values())  # gradients too
    assert any(op.direction == "forward" for op in dm.operators.values())
    assert {s for _, s in dm.step_keys()} == {20}
    for page in ("step-000020.html", "steps.html"):
        text = (folder / page).read_text()
        assert text.startswith("<!DOCTYPE html>") and "fxstab-data" in text, page


def _check_tensorboard(folder: Path) -> None:
    # transformers writes its logs under train/ (train/loss, train/fxstab/...)
    tb = {k.removeprefix("train/"): v for k, v in scalars(folder).items()}
    assert TAGS <= set(tb), sorted(tb)
    assert sorted(s for s, _ in tb["fxstab/worst_forward_digits"]) == [10, 20]
    assert all(0.0 <= v <= 2.5 for _, v in tb["fxstab/worst_forward_digits"])  # bf16's cap 2.41


# --------------------------------------------------------------------------- transformers
def _hf_train(out: Path, callback: bool) -> tuple:
    from transformers import Trainer, TrainingArguments

    from fxstab.integrations.transformers import FxstabCallback

    args = TrainingArguments(str(out), max_steps=STEPS, per_device_train_batch_size=4,
                             logging_steps=5, report_to=["tensorboard"], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, seed=0,
                             learning_rate=1e-3, dataloader_num_workers=0)
    model = tiny_gpt2()
    # the idiom every Hugging Face user writes (FxstabCallback.attach: the monitor's test)
    cb = FxstabCallback(every=EVERY, format="bf16") if callback else None
    trainer = Trainer(model=model, args=args, train_dataset=batches(),
                      callbacks=[cb] if cb else None)
    trainer.train()
    torch._dynamo.reset()
    return model, cb, trainer


def test_transformers_trainer_with_the_callback(tmp_path, capsys):
    plain, _, _ = _hf_train(tmp_path / "plain", callback=False)
    capsys.readouterr()
    model, cb, trainer = _hf_train(tmp_path / "run", callback=True)
    _check_maps(tmp_path / "run" / "fxstab")
    # callbacks=[cb] appended it after TensorBoard's: it went first, its figures reached it
    assert trainer.callback_handler.callbacks[0] is cb
    _check_tensorboard(tmp_path / "run")
    assert [r["step"] for r in cb.logged] == [10, 20]
    said = capsys.readouterr().out
    assert f"fxstab: 2 digit map(s) in {tmp_path / 'run' / 'fxstab'}; open " in said, said
    assert "steps.html" in said
    # training is unchanged, bit for bit
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


def test_callback_options_are_checked_when_it_is_made():
    from fxstab.integrations.transformers import FxstabCallback

    with pytest.raises(ValueError, match="fp99"):
        FxstabCallback(format="fp99")
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        FxstabCallback(every=0)


# --------------------------------------------------------------------------- lightning
def _pl_train(out: Path, callback: bool) -> tuple:
    pl = pytest.importorskip("pytorch_lightning", reason="the test extra installs it")
    from pytorch_lightning.loggers import TensorBoardLogger

    from fxstab.integrations.lightning import FxstabCallback

    class LitGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = LitGPT()
    loader = torch.utils.data.DataLoader(batches(), batch_size=4, shuffle=False)
    cb = FxstabCallback(every=EVERY, format="bf16") if callback else None
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=TensorBoardLogger(str(out)),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb] if cb else [],
                         log_every_n_steps=5)
    trainer.fit(module, loader)
    torch._dynamo.reset()
    return module, cb, trainer


def test_lightning_trainer_with_the_callback(tmp_path):
    plain, _, _ = _pl_train(tmp_path / "plain", callback=False)
    module, cb, trainer = _pl_train(tmp_path / "run", callback=True)
    folder = Path(trainer.log_dir) / "fxstab"
    _check_maps(folder)
    _check_tensorboard(tmp_path / "run")
    assert [r["step"] for r in cb.logged] == [10, 20]
    assert "train_loss" in scalars(tmp_path / "run")  # the module's own logging still works
    for (n, p), q in zip(module.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


# --------------------------------------------------------------------------- monitor mode
def test_both_callbacks_step_a_stability_monitor_and_log_it(tmp_path):
    pl = pytest.importorskip("pytorch_lightning", reason="the test extra installs it")
    from pytorch_lightning.loggers import TensorBoardLogger
    from transformers import Trainer, TrainingArguments

    from fxstab.integrations.lightning import FxstabCallback as LitCallback
    from fxstab.integrations.transformers import FxstabCallback as HFCallback

    # transformers: the model wrapped by the monitor, the callback steps and logs it
    mon = fxstab.StabilityMonitor(format="bf16", period=1)
    model = mon.wrap(tiny_gpt2())
    args = TrainingArguments(str(tmp_path / "hf"), max_steps=10, per_device_train_batch_size=4,
                             logging_steps=5, report_to=["tensorboard"], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, seed=0,
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=batches())
    cb = HFCallback.attach(trainer, every=5, monitor=mon)
    trainer.train()
    assert mon.checks_run > 0 and [r["step"] for r in cb.logged] == [5, 10]
    tb = {k.removeprefix("train/"): v for k, v in scalars(tmp_path / "hf").items()}
    assert sorted(s for s, _ in tb["fxstab/monitor_max_score"]) == [5, 10]
    assert (tmp_path / "hf" / "fxstab" / "monitor.html").is_file()

    # Lightning: the network inside the module wrapped
    mon = fxstab.StabilityMonitor(format="bf16", period=1)

    class LitGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = mon.wrap(tiny_gpt2())

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(batches(), batch_size=4)
    lit = LitCallback(every=5, monitor=mon)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu",
                         logger=TensorBoardLogger(str(tmp_path / "pl")),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[lit])
    trainer.fit(LitGPT(), loader)
    assert mon.checks_run > 0 and [r["step"] for r in lit.logged] == [5, 10]
    tb = scalars(tmp_path / "pl")
    assert sorted(s for s, _ in tb["fxstab/monitor_max_score"]) == [5, 10]
    assert math.isfinite(tb["fxstab/monitor_max_score"][-1][1])
    assert (Path(trainer.log_dir) / "fxstab" / "monitor.html").is_file()
