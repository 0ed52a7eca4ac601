"""torchao float8 training models analysed as the program runs them (issue 45, item 2).

A model converted with ``torchao.float8.convert_to_float8_training`` (on the CPU: torchao's fp32
emulation of the scaled matmul, ``emulate=True``, or ``torch._scaled_mm``, which torch 2.13 runs
there) compiled with ``fxstab.backend(format="auto")``: each Float8Linear's GEMM is recognised
as the matmul it is, its operands in the recipe its config gives (fxstab.capture.torchao), the
rest of the program in its own dtypes; in lowered graphs (the backward graph, the arithmetic
level) each cast into float8 is a rounding into its format. Outputs and gradients are compared
bit for bit with the program, the digits with the real run against fp64.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed "
                                     "(the test extra installs it)")

import fxstab  # noqa: E402
from fxstab.capture.torchao import Float8Recipe, float8_matmul  # noqa: E402
from fxstab.numerics.digits import cestac_digits, true_digits  # noqa: E402

RECIPES = ("tensorwise", "rowwise")


def _mlp() -> torch.nn.Module:
    """Two linears of widths multiple of 16 (torchao converts only those) around a GELU."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 32))


def _converted(recipe: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               emulate: bool = True) -> tuple:
    """(the fp32 reference MLP, the same weights in ``dtype`` converted with torchao's
    ``recipe``, in its fp32 emulation or, ``emulate=False``, with ``torch._scaled_mm`` (which
    torch 2.13 runs on the CPU too), an input in ``dtype``)."""
    torch.manual_seed(seed)
    ref = _mlp()
    model = _mlp()
    model.load_state_dict(ref.state_dict())
    model = model.to(dtype)
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
                                 emulate=emulate)
    torchao_float8.convert_to_float8_training(model, config=config)
    return ref, model, torch.randn(32, 64).to(dtype)


def _analysed(model: torch.nn.Module, x: torch.Tensor, **options) -> tuple:
    """(the backend, the compiled model's output, its output samples) of one analysed call
    (``format="auto"`` at the operator level unless ``options`` say otherwise)."""
    torch._dynamo.reset()
    options = {"format": "auto", **options}
    if options.get("granularity") == "aten" and options["format"] == "auto":
        options["format"] = "bf16"  # (the arithmetic level rounds into one format)
    be = fxstab.backend(n_samples=3, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        f = torch.compile(model, backend=be)
        with torch.no_grad(), be.capture_samples() as cap:
            y = f(x)
    return be, y, cap.output


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_map_names_the_float8_gemms_with_their_recipe(recipe, emulate, fresh_dynamo):
    """The output is the program's, bit for bit; the map names both GEMMs with torchao's recipe
    (e4m3 operands, per-tensor or per-row scales), they ran with their operands in it, and keep
    fewer digits than the same model's bf16 linears (e4m3 has 4 significant bits, bf16 8). The
    emulated matmul and torch._scaled_mm are one node to the analysis (torchao's function)."""
    _, model, x = _converted(recipe, emulate=emulate)
    with torch.no_grad():
        try:
            want = model(x)
        except RuntimeError as exc:  # an older torch without _scaled_mm on the CPU
            pytest.skip(f"torch._scaled_mm does not run here: {exc}")
    be, y, _ = _analysed(model, x)
    assert torch.equal(y, want)
    dm = be.digit_map()
    scaling = {"tensorwise": "tensor", "rowwise": "row"}[recipe]
    label = f"torchao float8 {recipe}: fp8_e4m3 operands, {scaling} scaling"
    assert dm.metadata["gemm_recipes"] == {"0/matmul#0": label, "2/matmul#0": label}
    reasons = {e.operator: e.reason for e in be.coverage().entries if e.kind == "matmul"}
    assert reasons == dict.fromkeys(("0/matmul#0", "2/matmul#0"),
                                    f"operands fp8_e4m3 ({scaling} scaling), exact sum on the "
                                    f"samples")
    for name in ("0/matmul#0", "2/matmul#0"):
        op = dm.operators[name]
        assert op.format == "bf16"  # its output, in the program's dtype
        assert op.operand_elements > 0
        assert 0.5 < op.operand_digits < 2  # e4m3 operands keep ~1.2 digits of the product

    # the same weights unconverted, in bf16: its linears keep ~1.8 digits
    torch.manual_seed(0)
    plain = _mlp().to(torch.bfloat16)
    base = _analysed(plain, x)[0].digit_map()
    for fp8, bf16 in (("0/matmul#0", "0/linear#0"), ("2/matmul#0", "2/linear#0")):
        assert dm.operators[fp8].avg_digits < base.operators[bf16].avg_digits - 1


@pytest.mark.parametrize("recipe", RECIPES)
def test_reported_digits_against_the_real_run(recipe, fresh_dynamo):
    """The truth: torchao's own output (its emulation, bf16 model) against the fp64 product of
    the unconverted model's weights. Measured on this MLP (seeds 0-2, both recipes): estimate
    0.38-0.41 digits on average, truth 1.28-1.33. The estimate is conservative by ~0.9 digit,
    as CESTAC is for any format: N = 3 samples with Student's t (4.30/sqrt(3): 0.4 digit) and
    random rounding of the operands, whose error is twice round-to-nearest's (0.3 digit);
    fxstab's estimate for the same model unconverted in bf16 is 0.74 digit under its truth.
    Checked: no more than 5% of the outputs over their truth by a digit or more (the
    project's validity criterion, tests/test_accumulation.py), and the average estimate at most
    the average truth and within 1.2 digits of it."""
    ref, model, x = _converted(recipe)
    be, y, samples = _analysed(model, x)
    exact = ref.double()(x.double())
    est = cestac_digits(samples.double(), "bf16")
    true = true_digits(y.double(), exact, 7.22)
    assert float((est - true >= 1).double().mean()) <= 0.05
    assert est.mean() <= true.mean() <= est.mean() + 1.2
    # the real run keeps e4m3's digits, not bf16's (~2.4): what the map must show
    assert true.mean() < 1.5 and est.mean() < 1


def test_recognised_node_and_config():
    """float8_matmul reads the recipe from the config dynamo builds in the graph: e4m3 forward
    operands; the gradient in e5m2 (tensorwise) or e4m3 (rowwise, with power-of-two scales);
    any other node is not a float8 GEMM."""
    seen = {}
    for recipe in RECIPES:
        _, model, x = _converted(recipe, dtype=torch.float32)
        torch._dynamo.reset()

        def capture(gm, _inputs, recipe=recipe):
            seen[recipe] = [float8_matmul(n) for n in gm.graph.nodes]
            return gm

        with torch.no_grad():
            torch.compile(model, backend=capture)(x)
    torch._dynamo.reset()
    tw = [r for r in seen["tensorwise"] if r is not None]
    rw = [r for r in seen["rowwise"] if r is not None]
    assert tw == [Float8Recipe("fp8_e4m3", "tensor", False, "fp8_e5m2", True)] * 2
    assert rw == [Float8Recipe("fp8_e4m3", "row", True, "fp8_e4m3", True)] * 2
    assert len(seen["tensorwise"]) > 10  # the config constructors, the adds, the GELU: None


def test_a_fixed_format_keeps_the_programs_float8_recipe(fresh_dynamo):
    """The recipe is the program's own quantisation: with a fixed format (the rest of the
    program simulated in bf16) the GEMMs still take their operands in e4m3, their outputs
    rounding into the format; the same digits as under format="auto" for this bf16 model."""
    _, model, x = _converted("tensorwise")
    auto = _analysed(model, x)[0].digit_map()
    be, y, _ = _analysed(model, x, format="bf16")
    dm = be.digit_map()
    with torch.no_grad():
        assert torch.equal(y, model(x))
    assert sorted(dm.metadata["gemm_recipes"]) == ["0/matmul#0", "2/matmul#0"]
    for name in ("0/matmul#0", "2/matmul#0"):
        assert dm.operators[name].avg_digits == pytest.approx(auto.operators[name].avg_digits,
                                                              abs=0.05)


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_arithmetic_level_rounds_the_casts_into_float8(recipe, emulate, fresh_dynamo):
    """granularity="aten" (a fixed format: bf16): the lowered forward shows the recipe as
    primitives; each cast into float8 (aten._to_copy) is recorded as a rounding into its
    format (e4m3: at most its cap, 1.2 digits) and the GEMM (aten.mm of the upcast operands,
    or aten._scaled_mm) reads the samples' spread. Output bit-identical; against the real run
    (the truth of test_reported_digits_against_the_real_run, 1.28-1.32 digits) the estimate
    measured 0.53-0.56 digits, checked as there. Before, the casts passed the samples through
    (the GEMMs kept bf16's ~2 digits) and _scaled_mm of them failed (no float8 operand)."""
    ref, model, x = _converted(recipe, emulate=emulate)
    with torch.no_grad():
        try:
            want = model(x)
        except RuntimeError as exc:  # an older torch without _scaled_mm on the CPU
            pytest.skip(f"torch._scaled_mm does not run here: {exc}")
    be, y, samples = _analysed(model, x, granularity="aten")
    assert torch.equal(y, want)
    assert not [e for e in be.coverage().entries if "failed" in e.reason]
    dm = be.digit_map()
    casts = [op for op in dm.operators.values() if op.kind == "_to_copy" and op.avg_digits < 1.3]
    assert len(casts) == 4  # two operands of two GEMMs (the upcasts keep the cap)
    gemm = "mm" if emulate else "_scaled_mm"
    products = [op for op in dm.operators.values() if op.kind == gemm]
    assert len(products) == 2 and all(op.avg_digits < 1 for op in products)
    est = cestac_digits(samples.double(), "bf16")
    true = true_digits(y.double(), ref.double()(x.double()), 7.22)
    assert float((est - true >= 1).double().mean()) <= 0.05
    assert est.mean() <= true.mean() <= est.mean() + 1.2


def _backward(model: torch.nn.Module, x: torch.Tensor) -> tuple:
    """(the backend, the parameters' gradients) of one analysed training step (backward=True)
    of the loss sum(y^2)."""
    torch._dynamo.reset()
    be = fxstab.backend(format="auto", n_samples=3, seed=0, backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.compile(model, backend=be)(x).square().sum().backward()
        be.digit_map()  # (its coverage warning, once)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return be, grads


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_casts_are_roundings_into_their_float8_formats(recipe, emulate, fresh_dynamo):
    """backward=True: the backward graph AOTAutograd lowers shows torchao's casts as
    aten._to_copy into float8, each analysed as a rounding into its format (the incoming
    gradient in e5m2 in the tensorwise recipe, e4m3 in the rowwise one; the weight in e4m3).
    The gradients are the program's, bit for bit; the weights' gradients keep fewer digits
    than the unconverted bf16 model's (~1.6-1.9). The truth: the second linear's weight
    gradient as torchao computes it against the fp64 product of the same (exact) incoming
    gradient and activation, the backward analysis's own inputs. Measured: estimate 0.64
    (tensorwise) / 0.83 (rowwise) digits, truth 1.41 / 1.64; the same conservative margin as
    the forward's (test_reported_digits_against_the_real_run), checked the same way.
    Without the emulation the backward graph calls ``aten._scaled_mm`` on the float8 operands:
    on the samples it is their scaled product (the same digits within 0.05)."""
    _, model, x = _converted(recipe, emulate=emulate)
    try:
        y = model(x)
    except RuntimeError as exc:  # an older torch without _scaled_mm on the CPU
        pytest.skip(f"torch._scaled_mm does not run here: {exc}")
    y.square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    h, g = model[1](model[0](x)).detach(), (2 * y).detach()
    model.zero_grad(set_to_none=True)
    be, grads = _backward(model, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))
    dm = be.digit_map()
    gemm = "mm" if emulate else "scaled_mm"
    assert {op.kind for op in dm.operators.values() if "/grad/" in op.name and
            "mm" in op.kind} == {gemm}
    assert not [e for e in be.coverage().entries if "failed" in e.reason]
    casts = {n: op.format for n, op in dm.operators.items() if op.kind == "to_copy"}
    grad_format = {"tensorwise": "fp8_e5m2", "rowwise": "fp8_e4m3"}[recipe]
    # per linear: the incoming gradient twice (dgrad, wgrad: the second only where there is an
    # earlier layer to feed) and the weight, or the input, in e4m3
    assert sorted(casts.values()).count(grad_format) >= 3
    assert set(casts.values()) == {grad_format, "fp8_e4m3"}
    for name, fmt in casts.items():
        cap = {"fp8_e5m2": 0.91, "fp8_e4m3": 1.21}[fmt]
        assert dm.operators[name].avg_digits <= cap
    torch.manual_seed(0)
    base = _backward(_mlp().to(torch.bfloat16), x)[0].digit_map()
    for w in ("0.weight/grad", "2.weight/grad"):
        assert dm.operators[w].avg_digits < base.operators[w].avg_digits - 0.7

    exact = g.double().T @ h.double()
    true = true_digits(grads[2].double(), exact, 7.22).mean()
    est = dm.operators["2.weight/grad"].avg_digits
    assert est <= true <= est + 1.2


class _Block(torch.nn.Module):
    """A pre-norm transformer block (causal attention, GELU MLP) of width 64, 4 heads."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (s.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for s in self.qkv(self.ln1(x)).split(d, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_transformer_block_trains_as_the_program_runs(recipe, fresh_dynamo):
    """A bf16 transformer block converted with torchao's own recipe (no emulation flag: the
    path users train with), batched 3-D activations: one analysed training step leaves the
    output and every gradient the program's, bit for bit; its four linears are named with
    the recipe, every operator's stochastic path ran, and the linears' outputs and weight
    gradients keep under one digit (measured: 0.38-0.52 and 0.35-0.75; e4m3 operands,
    e5m2 or e4m3 gradients)."""
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16)
    torchao_float8.convert_to_float8_training(
        model, config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    try:
        y = model(x)
    except RuntimeError as exc:  # an older torch without _scaled_mm on the CPU
        pytest.skip(f"torch._scaled_mm does not run here: {exc}")
    y.float().square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    be = fxstab.backend(format="auto", backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = torch.compile(model, backend=be)(x)
        got.float().square().sum().backward()
        dm = be.digit_map()
    assert torch.equal(got, y)
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert sorted(dm.metadata["gemm_recipes"]) == ["down/matmul#0", "o/matmul#0",
                                                   "qkv/matmul#0", "up/matmul#0"]
    assert not [e for e in be.coverage().entries if "failed" in e.reason]
    for name in ("qkv", "o", "up", "down"):
        assert dm.operators[f"{name}/matmul#0"].avg_digits < 1
        assert dm.operators[f"{name}.weight/grad"].avg_digits < 1
