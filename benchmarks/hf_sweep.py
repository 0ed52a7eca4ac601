"""Hugging Face ``transformers`` architectures through the backend (issue 41, item 5).

Every model is built from a tiny config with random weights (no download), put in eval mode and
run under ``torch.no_grad()``. For each model and level (``op``: the operator level, ``aten``:
the arithmetic level) the checks are those of ``tests/test_hf_sweep.py``:

* three calls of ``torch.compile(model, backend=fxstab.backend(format="bf16"))`` raise nothing;
* each call's output is bit for bit the output of the same model compiled with dynamo's
  ``"eager"`` backend (``torch._dynamo.reset()`` between the two, the same inputs);
* ``be.coverage().fraction >= 0.9`` with the default selection;
* when every floating output sample of the last call is finite, the digit map's first finding
  is no "NaN/inf first appear".

    python benchmarks/hf_sweep.py                      # every model at the op level, the
                                                       # ARITHMETIC subset at the aten level
    python benchmarks/hf_sweep.py --models mixtral,t5 --levels op,aten

Prints one row per model and level and writes ``results/hf_sweep.json`` (machine, versions,
commit, rows); ``--markdown`` prints the table of ``docs/coverage.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxstab  # noqa: E402

MIN_COVERAGE = 0.9
VOCAB = 128
BATCH, SEQ = 2, 16
CALLS = 3

# -- the models ------------------------------------------------------------------------------
# name -> (family, builder): the builder returns (model, inputs). Configs are as small as the
# architecture allows (2 layers, width 64, 4 heads) so each model compiles in seconds on a CPU.


def _T():
    import transformers

    return transformers


def _ids(lo: int = 1) -> torch.Tensor:
    return torch.randint(lo, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _padded(lo: int = 1) -> dict:
    """Token ids with a padded second row (an encoder's additive padding mask)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    return {"input_ids": _ids(lo), "attention_mask": mask}


def _pixels(size: int = 32) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, size, size,
                                        generator=torch.Generator().manual_seed(1))}


DEC = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
           use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _decoder(config: str, model: str, **over) -> Callable:
    def build():
        T = _T()
        kw = dict(DEC)
        kw.update(over)
        kw = {k: v for k, v in kw.items() if v is not None}
        return getattr(T, model)(getattr(T, config)(**kw)), {"input_ids": _ids()}
    return build


def _gpt2():
    T = _T()
    cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                       bos_token_id=0, eos_token_id=0, use_cache=False)
    return T.GPT2LMHeadModel(cfg), {"input_ids": _ids()}


def _gptj():
    T = _T()
    cfg = T.GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=VOCAB,
                       n_positions=64, bos_token_id=0, eos_token_id=0, use_cache=False)
    return T.GPTJForCausalLM(cfg), {"input_ids": _ids()}


def _bloom():
    T = _T()
    cfg = T.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    return T.BloomForCausalLM(cfg), {"input_ids": _ids()}


def _opt():
    T = _T()
    cfg = T.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                      num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    return T.OPTForCausalLM(cfg), {"input_ids": _ids()}


def _falcon():
    T = _T()
    cfg = T.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                         bos_token_id=0, eos_token_id=0, use_cache=False)
    return T.FalconForCausalLM(cfg), {"input_ids": _ids()}


def _gpt_neox():
    T = _T()
    cfg = T.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=128, rotary_pct=0.25,
                          max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                          use_cache=False)
    return T.GPTNeoXForCausalLM(cfg), {"input_ids": _ids()}


def _deepseek_v3():
    """DeepSeek-V3: multi-head latent attention, a dense first layer, then routed experts
    (grouped top-k on sigmoid scores) beside a shared expert."""
    T = _T()
    cfg = T.DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                             pad_token_id=0, use_cache=False)
    return T.DeepseekV3ForCausalLM(cfg), {"input_ids": _ids()}


def _mamba(scan: bool) -> Callable:
    def build():
        T = _T()
        cfg = T.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2,
                            expand=2, conv_kernel=4, use_associative_scan=scan,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
        return T.MambaForCausalLM(cfg), {"input_ids": _ids()}
    return build


def _mamba2():
    T = _T()
    cfg = T.Mamba2Config(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2,
                         expand=2, num_heads=8, head_dim=16, n_groups=1, conv_kernel=4,
                         chunk_size=8, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         use_cache=False)
    return T.Mamba2ForCausalLM(cfg), {"input_ids": _ids()}


ENC = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=128, max_position_embeddings=64)


def _bert():
    T = _T()
    return T.BertModel(T.BertConfig(pad_token_id=0, **ENC), add_pooling_layer=False), _padded()


def _roberta():
    T = _T()
    cfg = T.RobertaConfig(pad_token_id=1, bos_token_id=0, eos_token_id=2, **ENC)
    return T.RobertaModel(cfg, add_pooling_layer=False), _padded(lo=3)


def _distilbert():
    T = _T()
    cfg = T.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                             max_position_embeddings=64, pad_token_id=0)
    return T.DistilBertModel(cfg), _padded()


def _electra():
    T = _T()
    cfg = T.ElectraConfig(embedding_size=32, pad_token_id=0, **ENC)
    return T.ElectraModel(cfg), _padded()


def _albert():
    T = _T()
    cfg = T.AlbertConfig(embedding_size=32, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                         **ENC)
    return T.AlbertModel(cfg, add_pooling_layer=False), _padded()


def _deberta_v2():
    T = _T()
    cfg = T.DebertaV2Config(relative_attention=True, position_buckets=8,
                            max_relative_positions=16, pos_att_type=["p2c", "c2p"],
                            pad_token_id=0, **ENC)
    return T.DebertaV2Model(cfg), _padded()


def _mpnet():
    T = _T()
    cfg = T.MPNetConfig(relative_attention_num_buckets=32, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, **ENC)
    return T.MPNetModel(cfg, add_pooling_layer=False), _padded(lo=3)


def _t5():
    T = _T()
    cfg = T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                     num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                     pad_token_id=0, eos_token_id=1, use_cache=False)
    dec = torch.randint(1, VOCAB, (BATCH, 8), generator=torch.Generator().manual_seed(2))
    return T.T5ForConditionalGeneration(cfg), {**_padded(), "decoder_input_ids": dec}


def _bart():
    T = _T()
    cfg = T.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4,
                       encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       decoder_start_token_id=2, use_cache=False)
    dec = torch.randint(3, VOCAB, (BATCH, 8), generator=torch.Generator().manual_seed(2))
    return T.BartForConditionalGeneration(cfg), {**_padded(lo=3), "decoder_input_ids": dec}


VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
           num_attention_heads=4, intermediate_size=128)


def _vit():
    T = _T()
    return T.ViTModel(T.ViTConfig(**VIT), add_pooling_layer=False), _pixels()


def _deit():
    T = _T()
    return T.DeiTModel(T.DeiTConfig(**VIT), add_pooling_layer=False), _pixels()


def _clip_vision():
    T = _T()
    cfg = T.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
    return T.CLIPVisionModel(cfg), _pixels()


def _convnext():
    T = _T()
    cfg = T.ConvNextConfig(num_channels=3, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1],
                           num_stages=2, image_size=32)
    return T.ConvNextModel(cfg), _pixels()


def _swin():
    T = _T()
    cfg = T.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1],
                       num_heads=[2, 2], window_size=4, mlp_ratio=2.0)
    return T.SwinModel(cfg, add_pooling_layer=False), _pixels()


def _resnet():
    T = _T()
    cfg = T.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32],
                         depths=[1, 1], layer_type="basic")
    return T.ResNetModel(cfg), _pixels()


def _wave() -> dict:
    return {"input_values": torch.randn(BATCH, 1600, generator=torch.Generator().manual_seed(1))}


AUDIO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32)


def _wav2vec2():
    T = _T()
    return T.Wav2Vec2Model(T.Wav2Vec2Config(**AUDIO)), _wave()


def _hubert():
    T = _T()
    return T.HubertModel(T.HubertConfig(**AUDIO)), _wave()


def _whisper_encoder():
    T = _T()
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2,
                          encoder_attention_heads=4, encoder_ffn_dim=128, decoder_layers=2,
                          decoder_attention_heads=4, decoder_ffn_dim=128,
                          max_source_positions=32, max_target_positions=32, use_cache=False,
                          pad_token_id=0, bos_token_id=0, eos_token_id=0,
                          decoder_start_token_id=0)
    feats = torch.randn(BATCH, 16, 64, generator=torch.Generator().manual_seed(1))
    return WhisperEncoder(cfg), {"input_features": feats}


MODELS: dict[str, tuple[str, Callable]] = {
    # decoders
    "gpt2": ("decoder", _gpt2),
    "llama": ("decoder", _decoder("LlamaConfig", "LlamaForCausalLM")),
    "mistral": ("decoder", _decoder("MistralConfig", "MistralForCausalLM", sliding_window=8)),
    "qwen2": ("decoder", _decoder("Qwen2Config", "Qwen2ForCausalLM")),
    "qwen3": ("decoder", _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16)),
    "phi": ("decoder", _decoder("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5)),
    "phi3": ("decoder", _decoder("Phi3Config", "Phi3ForCausalLM")),
    "gemma": ("decoder", _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=16)),
    "gemma2": ("decoder", _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=16,
                                   sliding_window=8)),
    "gpt-neox": ("decoder", _gpt_neox),
    "opt": ("decoder", _opt),
    "falcon": ("decoder", _falcon),
    "gpt-j": ("decoder", _gptj),
    "bloom": ("decoder", _bloom),
    "stablelm": ("decoder", _decoder("StableLmConfig", "StableLmForCausalLM")),
    "olmo": ("decoder", _decoder("OlmoConfig", "OlmoForCausalLM")),
    # mixtures of experts
    "mixtral": ("moe", _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                num_experts_per_tok=2)),
    "qwen2-moe": ("moe", _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32)),
    "qwen3-moe": ("moe", _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                  head_dim=16)),
    "olmoe": ("moe", _decoder("OlmoeConfig", "OlmoeForCausalLM", num_experts=4,
                              num_experts_per_tok=2)),
    "deepseek-v3": ("moe", _deepseek_v3),
    # state-space models
    "mamba-scan": ("ssm", _mamba(True)),
    "mamba-loop": ("ssm", _mamba(False)),
    "mamba2": ("ssm", _mamba2),
    # encoders
    "bert": ("encoder", _bert),
    "roberta": ("encoder", _roberta),
    "distilbert": ("encoder", _distilbert),
    "electra": ("encoder", _electra),
    "albert": ("encoder", _albert),
    "deberta-v2": ("encoder", _deberta_v2),
    "mpnet": ("encoder", _mpnet),
    # encoder-decoders
    "t5": ("seq2seq", _t5),
    "bart": ("seq2seq", _bart),
    # vision
    "vit": ("vision", _vit),
    "deit": ("vision", _deit),
    "clip-vision": ("vision", _clip_vision),
    "convnext": ("vision", _convnext),
    "swin": ("vision", _swin),
    "resnet": ("vision", _resnet),
    # audio
    "wav2vec2": ("audio", _wav2vec2),
    "hubert": ("audio", _hubert),
    "whisper-encoder": ("audio", _whisper_encoder),
}

# the models also run at the arithmetic level (granularity="aten")
ARITHMETIC = ("gpt2", "llama", "mixtral", "qwen2-moe", "deepseek-v3", "mamba-scan", "mamba-loop",
              "mamba2", "t5", "mpnet", "bert", "vit", "whisper-encoder")


def build(name: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model, inputs = MODELS[name][1]()
    return model.eval(), inputs


# -- the checks ------------------------------------------------------------------------------
def leaves(out: Any) -> list:
    """The tensors of a model's output (a ModelOutput, tuple or tensor), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict
        return [t for v in out.values() for t in leaves(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in leaves(v)]
    return []  # caches and other objects


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def mismatch(ref: list, outs: list) -> Optional[str]:
    """Where the analysed calls' outputs differ from the eager backend's (None: bit for bit)."""
    for call, out in enumerate(outs):
        if len(out) != len(ref):
            return f"call {call}: {len(out)} output tensors, eager {len(ref)}"
        for i, (a, b) in enumerate(zip(out, ref)):
            if not same_bits(a, b):
                diff = ((a.double() - b.double()).abs().max().item()
                        if a.shape == b.shape else "shape")
                return f"call {call}: output {i} {tuple(a.shape)} differs (max |diff| {diff})"
    return None


def check(name: str, granularity: str = "op", calls: int = CALLS) -> dict:
    """Run ``name`` through both backends; every number the sweep's checks read. Raises what
    the analysed calls raise."""
    t0 = time.perf_counter()
    model, inputs = build(name)
    with torch.no_grad():
        torch._dynamo.reset()
        ref = leaves(torch.compile(model, backend="eager")(**inputs))
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", granularity=granularity)
        f = torch.compile(model, backend=be)
        outs = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i in range(calls):
                    if i < calls - 1:
                        outs.append(leaves(f(**inputs)))
                        continue
                    with be.capture_samples() as cap:
                        outs.append(leaves(f(**inputs)))
                cov = be.coverage()
                dm = be.digit_map()
                findings = dm.findings()
        finally:
            torch._dynamo.reset()
    samples = [s for g in cap.graphs for s in leaves(g)
               if isinstance(s, torch.Tensor) and s.is_floating_point()]
    reasons: dict = {}
    for e in cov.counted:
        if e.how != "analysed":
            key = f"{e.how}: {e.reason}"[:160]
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "model": name, "family": MODELS[name][0], "level": granularity,
        "coverage": cov.fraction, "counted": len(cov.counted),
        "not_analysed": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "mismatch": mismatch(ref, outs),
        "graphs": len(cap.graphs), "operators": len(dm.operators),
        "finite": bool(samples) and all(bool(torch.isfinite(s).all()) for s in samples),
        "first_finding": findings[0] if findings else None,
        "findings": findings, "seconds": round(time.perf_counter() - t0, 1),
    }


def failures(row: dict) -> list[str]:
    """The checks ``row`` fails (the empty list: it passes)."""
    out = []
    if row.get("error"):
        return [f"exception: {row['error']}"]
    if row["mismatch"]:
        out.append(f"output differs from the eager backend's: {row['mismatch']}")
    if row["coverage"] is None or row["coverage"] < MIN_COVERAGE:
        out.append(f"coverage {row['coverage']} < {MIN_COVERAGE}: {row['not_analysed']}")
    first = row["first_finding"] or ""
    if row["finite"] and first.startswith("NaN/inf first appear"):
        out.append(f"every output sample is finite, yet the first finding is: {first}")
    return out


def run(names: list, levels: list, progress: Optional[bool] = None) -> list:
    """A row per model and level, printed as it is made; a bar of the models done on a
    terminal (``progress``: :class:`fxstab.progress.Progress`'s ``enabled``)."""
    from fxstab.progress import Progress

    rows = []
    todo = [(level, name) for level in levels for name in names
            if not (level == "aten" and name not in ARITHMETIC and names == list(MODELS))]
    with Progress("HF sweep", total=len(todo), unit="model", enabled=progress) as bar:
        for level, name in todo:
            try:
                row = check(name, level)
            except Exception as exc:  # noqa: BLE001 - a row says what failed
                row = {"model": name, "family": MODELS[name][0], "level": level,
                       "coverage": None, "error": f"{type(exc).__name__}: "
                       f"{(str(exc).splitlines() or [''])[0][:300]}",
                       "traceback": traceback.format_exc()[-3000:]}
            row["failures"] = failures(row)
            row["passed"] = not row["failures"]
            rows.append(row)
            cov = "-" if row["coverage"] is None else f"{100 * row['coverage']:.0f}%"
            bar.write(f"{name:16} {level:4} {cov:>5} {'pass' if row['passed'] else 'FAIL':4} "
                      f"{row.get('seconds', '-')!s:>5}s  {'; '.join(row['failures'])[:200]}")
            bar.update(note=f"{name} {level}")
    return rows


def markdown(rows: list) -> str:
    lines = ["| model | family | level | coverage | checks | first finding |",
             "|---|---|---|---:|---|---|"]
    for r in rows:
        cov = "-" if r["coverage"] is None else f"{100 * r['coverage']:.1f}%"
        first = (r.get("first_finding") or "none").replace("|", "\\|")
        if len(first) > 140:
            first = first[:137] + "..."
        verdict = "pass" if r["passed"] else "FAIL: " + "; ".join(r["failures"])[:160]
        lines.append(f"| {r['model']} | {r['family']} | {r['level']} | {cov} | {verdict} | "
                     f"{first} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="", help="comma-separated names (default: all)")
    p.add_argument("--levels", default="op,aten",
                   help="op, aten or both (aten runs the ARITHMETIC subset unless --models)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"
                                        / "hf_sweep.json"))
    p.add_argument("--markdown", action="store_true", help="print the docs/coverage.md table")
    p.add_argument("--table", nargs="+", metavar="JSON", default=None,
                   help="print the table of the rows these result files hold (runs nothing)")
    a = p.parse_args(argv)
    if a.table:
        rows = [r for f in a.table for r in json.loads(Path(f).read_text())["rows"]]
        order = {n: i for i, n in enumerate(MODELS)}
        rows.sort(key=lambda r: (r["level"] != "op", order.get(r["model"], len(order))))
        print(markdown(rows))
        return 0
    names = a.models.split(",") if a.models else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    rows = run(names, a.levels.split(","))
    from benchmarks.common import environment

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1,
                              default=str))
    print(f"wrote {out}")
    if a.markdown:
        print(markdown(rows))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
