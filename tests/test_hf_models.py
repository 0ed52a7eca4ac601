"""Hugging Face models as users run them (random init, tiny configs): the verdict leads with
what is wrong, never with an infinity the program absorbs (issue 30).

Every standard decoder adds an attention mask of fp32's ``finfo.min``; rounded into bf16 or
fp16 it becomes ``-inf``, which the softmax turns into 0: nothing non-finite reaches the
output, so it is a note (``DigitMap.absorbed_nonfinite``), not a NaN/inf origin. A real fp16
overflow in the same model still leads.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxstab

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _gpt2(attn: str):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=128,
                                   vocab_size=VOCAB, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=VOCAB,
                                  max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.BertModel(cfg, add_pooling_layer=False)


MODELS = {"gpt2-eager": lambda: _gpt2("eager"), "gpt2-sdpa": lambda: _gpt2("sdpa"),
          "llama": _llama, "bert": _bert}


def _inputs(name: str) -> dict:
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    if name == "bert":  # padded: its padding mask is the additive finfo.min one
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 10:] = 0
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids}


def _analyse(model, inputs: dict, granularity: str, fmt: str):
    torch._dynamo.reset()
    be = fxstab.backend(granularity=granularity, format=fmt)
    f = torch.compile(model.eval(), backend=be)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with be.capture_samples() as cap:
            out = f(**inputs)
    first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    samples = [s for g in cap.graphs for s in g if isinstance(s, torch.Tensor)]
    return be.digit_map(), first, samples


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("granularity", ["op", "aten"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clean_models_lead_with_no_nonfinite_origin(name, granularity, fmt):
    torch.manual_seed(0)
    dm, out, samples = _analyse(MODELS[name](), _inputs(name), granularity, fmt)
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(s).all() for s in samples if s.is_floating_point())
    assert dm.nonfinite_sources() == []
    found = dm.findings()
    assert not any(f.startswith("NaN/inf first appear") for f in found), found
    assert not dm.localize()[0].nonfinite_origin
    # names start at the model's own submodules (no "0." from a decorator's wrapper frame)
    assert not any(n.startswith("0.") for n in dm.operators), list(dm.operators)[:3]
    # an absorbed mask is a note, after the findings (GPT-2's eager attention adds its mask
    # in the model: at both levels that add rounds finfo.min to -inf)
    absorbed = dm.absorbed_nonfinite()
    notes = [f for f in found if f.startswith("note:")]
    assert found[len(found) - len(notes):] == notes  # the notes come last
    assert len([f for f in notes if "NaN/inf appear" in f]) == len(absorbed)
    # what else is a note: computational zeros their readers recover from (the mean of a
    # centred residual in a LayerNorm), never a finding of a clean model (issue 42)
    assert all("NaN/inf appear" in f or "computational zero" in f for f in notes), notes
    if name == "gpt2-eager":
        assert absorbed


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["op", "aten"])
def test_a_real_fp16_overflow_still_leads(granularity):
    """The first MLP's weights scaled up: its product overflows fp16 and NaN reaches the
    logits; the origin is that product, named first, with the overflow hint."""
    torch.manual_seed(0)
    model = _gpt2("sdpa")
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(1e6)
    dm, out, samples = _analyse(model, _inputs("gpt2-sdpa"), granularity, "fp16")
    assert not all(torch.isfinite(s).all() for s in samples)  # the samples overflow
    sources = dm.nonfinite_sources()
    assert sources and sources[0].startswith("transformer.h.0.mlp"), sources
    first = dm.findings()[0]
    assert first.startswith(f"NaN/inf first appear at {sources[0]}") and "overflow" in first
