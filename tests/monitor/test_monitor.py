"""Stability monitor behaviour (issue 7): scores, promotion without recompiling, recheck,
schedule coverage, projection estimate, and an unchanged training computation."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from fxstab.monitor import inject
from fxstab.monitor import Mode, StabilityMonitor
from fxstab.monitor.core import OpState

FC1 = "fc1/inject_fp16acc_linear#0"


def _run(model, x, monitor, steps, sweep=False):
    for _ in range(steps):
        if sweep:
            monitor.sweep()
        out = model(x)
        monitor.step()
    return out


def test_score_rises_on_injected_operator_and_stays_low_on_clean(tiny, batch):
    h = inject.fp16_accumulation(tiny, "fc1", offset=512.0)
    mon = StabilityMonitor(promote=False)
    _run(mon.wrap(tiny), batch, mon, 3, sweep=True)
    scores = mon.scores
    assert len(scores) == 9
    clean = {n: s for n, s in scores.items() if not h.matches(n)}
    # Clean bf16 operators disperse like the input perturbation itself, S ~ u = 2^-8.
    assert max(clean.values()) < 4 * 2.0 ** -8, clean
    # fp16 accumulation of partial sums ~512 * rowsum errs by ~512 * 2^-11 >> |y|.
    assert scores[FC1] > 20 * max(clean.values()), scores[FC1]
    assert mon.promotions == [] and set(mon.modes.values()) == {"NORMAL"}


def test_promotion_switches_implementation_without_recompiling(tiny, batch):
    h = inject.fp16_accumulation(tiny, "fc1", offset=0.0)
    mon = StabilityMonitor(tau_warn=0.05, tau_safe=10.0)
    backend = mon.backend()
    counters.clear()
    model = torch.compile(tiny, backend=backend)
    _run(model, batch, mon, 9)  # a full rotation: nothing to promote yet
    assert mon.promoted == [] and backend.compiles == 1
    assert sorted(backend.graphs[0].instrumented) == sorted(mon.operators)

    h.strength = 4096.0  # buffer update: no guard fails
    with torch.no_grad():
        ref_normal = tiny(batch)  # eager, no monitor active: the injected NORMAL kernel
    for _ in range(12):
        out = model(batch)
        mon.step()
        if mon.promoted:
            break
    assert mon.promoted == [FC1]
    p = mon.promotions[0]
    assert (p.op, p.old, p.new) == (FC1, "NORMAL", "FP32_ACCUMULATION") and p.score > 0.05
    out = model(batch)
    with torch.no_grad():
        h.module.forward = lambda x: inject._fp16acc_linear_fp32(
            x, h.module.weight, h.module.bias, h.module.strength)
        ref_fp32 = tiny(batch)
        del h.module.forward
    assert torch.equal(out, ref_fp32)  # the promoted kernel is the one running
    assert not torch.equal(out, ref_normal)
    assert backend.compiles == 1 and counters["stats"]["unique_graphs"] == 1


def test_recheck_demotes_a_repaired_operator(tiny, batch):
    h = inject.fp16_accumulation(tiny, "fc1", offset=4096.0)
    mon = StabilityMonitor(tau_warn=0.05, tau_safe=10.0, recheck=3)
    model = mon.wrap(tiny)
    mon.sweep()
    _run(model, batch, mon, 1)
    assert mon.modes[FC1] == "FP32_ACCUMULATION"
    _run(model, batch, mon, 3)  # recheck of the NORMAL kernel: still broken, stays promoted
    assert mon.modes[FC1] == "FP32_ACCUMULATION"
    rechecks = [e for e in mon.history[FC1] if e[3] == "NORMAL" and e[0] > 0]
    assert rechecks and rechecks[0][1] > 0.05
    h.strength = 0.0  # repaired
    _run(model, batch, mon, 3)
    assert mon.modes[FC1] == "NORMAL"
    last = mon.promotions[-1]
    assert (last.old, last.new) == ("FP32_ACCUMULATION", "NORMAL")
    assert last.reason.startswith("recheck") and last.score < 0.5 * 0.05
    assert mon.ever_promoted == [FC1] and mon.fraction_promoted == 0.0


def test_schedule_covers_all_candidates(tiny, batch):
    mon = StabilityMonitor(period=2, tau_warn=1.0, tau_safe=2.0)
    model = mon.wrap(tiny)
    _run(model, batch, mon, 2 * 9)
    checked = [e[0] for hist in mon.history.values() for e in hist]
    assert all(len(h) == 1 for h in mon.history.values()), mon.history
    # one operator per check step, check steps are the even ones
    assert sorted(checked) == list(range(0, 18, 2))
    # a high-score operator is checked on every check step on top of the rotation
    mon2 = StabilityMonitor(tau_warn=0.05, tau_safe=1.0, promote=False)
    inject.fp16_accumulation(tiny, "fc1", offset=4096.0)
    model2 = mon2.wrap(tiny)
    mon2.sweep()
    _run(model2, batch, mon2, 5)
    assert [e[0] for e in mon2.history[FC1]] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("offset", [0.0, 256.0])
def test_projection_estimate_tracks_full_norm(offset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512).to(torch.bfloat16))
    h = inject.fp16_accumulation(model, "0", offset=offset)
    x = torch.randn(64, 32).to(torch.bfloat16)  # 32768 output elements
    ratios, blocks = [], []
    for seed in range(8):
        est = {}
        for estimator in ("full", "projection", "block"):
            mon = StabilityMonitor(estimator=estimator, projection_dim=1024, promote=False,
                                   seed=seed)
            mon.wrap(model)(x)
            est[estimator] = mon.history[h.op_name][0][1]
        ratios.append(est["projection"] / est["full"])
        blocks.append(est["block"] / est["full"])
    # Each projected squared norm has relative std ~ sqrt(2/d_eff) (~5% for d = 1024 equal-energy
    # coordinates, more when energy concentrates in few output columns); the ratio of two such
    # norms measured ~10% std here. Bounds: 3 std for one seed, 2 std of the 8-seed mean.
    assert all(abs(r - 1) < 0.3 for r in ratios), ratios
    assert abs(sum(ratios) / len(ratios) - 1) < 0.08, ratios
    assert all(abs(b - 1) < 0.5 for b in blocks), blocks
    assert len(set(ratios)) > 1  # the projection did reduce (and depends on R)


def test_sign_projection_preserves_norm_on_average():
    mon = StabilityMonitor(projection_dim=64)
    y = torch.randn(64 * 200 + 17)
    z = mon.reduce(y)
    assert z.shape == (64,)
    ratio = float(z.norm() ** 2 / y.norm() ** 2)
    assert 0.6 < ratio < 1.5  # chi^2_64 / 64: 5-sigma band is about [0.4, 1.9]
    assert torch.equal(mon.reduce(y), z)  # fixed R


def _train(model, x, steps, monitor=None, lr=1e-2):
    torch.manual_seed(123)  # dropout masks
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    outs, grads = [], []
    for _ in range(steps):
        out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        outs.append(out.detach().clone())
        opt.step()
        opt.zero_grad()
        if monitor is not None:
            monitor.step()
    return outs, grads


@pytest.mark.parametrize("front", ["wrap", "compile"])
def test_outputs_and_gradients_unchanged_without_promotion(batch, front, tiny_cls):
    torch.manual_seed(0)
    base = tiny_cls(dropout=0.25).to(torch.bfloat16)
    ref_outs, ref_grads = _train(copy.deepcopy(base), batch, 4)
    mon = StabilityMonitor(tau_warn=1.0, tau_safe=2.0)
    model = copy.deepcopy(base)
    wrapped = mon.wrap(model) if front == "wrap" else torch.compile(model, backend=mon.backend())
    mon.sweep()  # replicas of every operator on step 0
    outs, grads = _train(wrapped, batch, 4, mon)
    assert mon.checks_run >= 9 + 3 and mon.promoted == []
    for a, b in zip(ref_outs, outs):
        assert torch.equal(a, b)
    for ga, gb in zip(ref_grads, grads):
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_compile_and_wrap_name_operators_alike(tiny, batch):
    m1, m2 = StabilityMonitor(), StabilityMonitor()
    m1.wrap(tiny)(batch)
    torch.compile(tiny, backend=m2.backend())(batch)
    assert m1.operators == m2.operators
    assert m1.operators[:3] == ["ln1/layer_norm#0", "attn.qkv/linear#0", "attn/matmul#0"]


def test_overflow_is_caught_by_a_sweep_and_repaired_in_the_same_call(tiny, batch):
    h = inject.overflow_activation(tiny, "ln2", scale=2.0 ** 100)
    with torch.no_grad():
        assert torch.isnan(tiny(batch)).any()  # the one-pass kernel overflows: inf - inf
    mon = StabilityMonitor()
    model = mon.wrap(tiny)
    mon.sweep()
    out = model(batch)
    assert torch.isfinite(out).all()
    assert mon.promoted == [h.op_name] and mon.modes[h.op_name] == "STABLE_KERNEL"
    assert "non-finite" in mon.promotions[0].reason and math.isinf(mon.scores[h.op_name])


def test_forced_modes_and_report(tiny, batch):
    mon = StabilityMonitor()
    mon.force("STABLE_KERNEL")
    mon.wrap(tiny)(batch)
    mon.step()
    assert mon.fraction_promoted == 1.0 and mon.checks_run == 0
    s = mon.summary()
    assert s["operators"] == 9 and s["config"]["format"] == "bf16"
    assert "attn.softmax/softmax#0" in mon.table()
    with pytest.raises(ValueError, match="unknown operator 'nope'"):
        mon.force(Mode.NORMAL, ["nope"])


def test_registered_custom_op_routes_modes():
    calls = []

    def fn(x):
        calls.append("normal")
        return x * 2

    def f32(x):
        calls.append("fp32")
        return x * 2

    op = StabilityMonitor().register("double_it", fn, fp32_fn=f32)

    class M(nn.Module):
        def forward(self, x):
            return op(x) + 1

    x = torch.ones(3)
    assert torch.equal(op(x), x * 2) and calls == ["normal"]
    mon = StabilityMonitor(promote=False)
    w = mon.wrap(M())
    w(x)
    assert mon.operators == ["double_it#0"]
    mon.force("FP32_ACCUMULATION")
    calls.clear()
    w(x)
    assert calls == ["fp32"]
    mon.force("STABLE_KERNEL")
    assert torch.equal(w(x), x * 2 + 1)  # default stable kernel: fp32 one upcast to fp64
    with pytest.raises(ValueError, match="identifier"):
        StabilityMonitor().register("bad name", fn)


def test_stable_kernels_survive_what_the_normal_ones_do_not():
    from fxstab.monitor.modes import implementations
    x = (torch.randn(4, 16) * 2.0 ** 70).to(torch.bfloat16)
    w, b = torch.ones(16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
    _, f32, stable = implementations("layer_norm", torch.nn.functional.layer_norm,
                                     torch.float64)
    args = (x, (16,), w, b, 1e-5)
    ref = torch.nn.functional.layer_norm(x.double() / 2.0 ** 70, (16,), w.double(), b.double())
    # outputs are bf16 values of magnitude <= 4: one ulp there is 2**-6 = 0.016, so 2e-2
    # accepts the final rounding to bf16 and nothing more
    assert torch.allclose(stable(args, {}).double(), ref, atol=2e-2)
    assert not torch.allclose(f32(args, {}).double(), ref, atol=2e-2)  # x^2 overflows fp32
    logits = torch.tensor([[100.0, 99.0, -5.0]], dtype=torch.bfloat16)
    _, sm32, smst = implementations("softmax", torch.softmax, torch.float64)
    for impl in (sm32, smst):
        y = impl((logits, -1), {})
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
        assert float(y.float().sum()) == pytest.approx(1.0, abs=1e-2)


def test_watch_every_spaces_out_checks_of_watched_operators(tiny, batch):
    inject.fp16_accumulation(tiny, "fc1", offset=4096.0)
    mon = StabilityMonitor(tau_warn=0.05, tau_safe=1.0, promote=False, watch_every=2)
    model = mon.wrap(tiny)
    mon.sweep()
    _run(model, batch, mon, 8)
    # fc1 is operator 7 of 9: the sweep on step 0, then every other step (staggered by its
    # index: (step + 7) % 2 == 0), and the rotation's own turn on step 7.
    assert [e[0] for e in mon.history[FC1]] == [0, 1, 3, 5, 7]
    # the others: the sweep, and their rotation turn within steps 0-7 (none for operator 8)
    assert {n: [e[0] for e in h] for n, h in mon.history.items() if n != FC1} == {
        n: sorted({0, i} & set(range(8))) for i, n in enumerate(mon.operators) if n != FC1}


def test_stable_operators_are_only_rechecked(tiny, batch):
    h = inject.overflow_activation(tiny, "ln2", scale=2.0 ** 100)
    mon = StabilityMonitor(recheck=4)
    model = mon.wrap(tiny)
    for _ in range(9):
        mon.sweep()  # asks for every operator on every step
        model(batch)
        mon.step()
    assert mon.modes[h.op_name] == "STABLE_KERNEL"
    # step 0 detects the overflow; a STABLE_KERNEL check could not change anything, so later
    # steps only run the NORMAL kernel's recheck (every 4 steps; still overflowing).
    assert [(e[0], e[3]) for e in mon.history[h.op_name]] == [
        (0, "NORMAL"), (4, "NORMAL"), (8, "NORMAL")]
    assert all(math.isinf(e[1]) for e in mon.history[h.op_name])
    assert all(len(v) == 9 for n, v in mon.history.items() if n != h.op_name)


def test_score_of_a_rarely_checked_operator_follows_the_new_measurement(tiny, batch):
    h = inject.fp16_accumulation(tiny, "fc1", offset=0.0)
    mon = StabilityMonitor(promote=False, beta=0.8)
    model = mon.wrap(tiny)
    _run(model, batch, mon, 9)  # fc1 (operator 7) measured once, by the rotation, on step 7
    h.strength = 4096.0
    _run(model, batch, mon, 9)  # and again on step 16, 9 steps later
    (s0, _), (s1, score) = [(e[1], e[2]) for e in mon.history[FC1][:2]]
    assert [e[0] for e in mon.history[FC1][:2]] == [7, 16]
    assert s1 > 20 * s0
    # the old value keeps weight beta^9 = 0.13 (a per-check EMA would have kept 0.8)
    assert score == pytest.approx(0.8 ** 9 * s0 + (1 - 0.8 ** 9) * s1)


def test_non_finite_inputs_are_not_blamed_on_the_operator(tiny, batch):
    h = inject.overflow_activation(tiny, "ln2", scale=2.0 ** 100)
    mon = StabilityMonitor(promote=False)  # ln2 stays broken: fc1 receives NaN
    mon.sweep()
    _run(mon.wrap(tiny), batch, mon, 1)
    assert math.isinf(mon.scores[h.op_name])
    ops = {n: mon._ops[n] for n in mon.operators}
    # fc1 and everything after ln2 see NaN; their stable kernels cannot fix that
    assert ops["fc1/linear#0"].inherited_nonfinite == 1 and mon.history["fc1/linear#0"] == []
    assert ops[h.op_name].inherited_nonfinite == 0
    assert all(math.isfinite(s) for n, s in mon.scores.items() if n != h.op_name)


def test_targeted_sweep_checks_only_the_culprit(tiny, batch):
    h = inject.overflow_activation(tiny, "ln2", scale=2.0 ** 100)
    mon = StabilityMonitor(tau_warn=1.0, tau_safe=2.0)
    model = mon.wrap(tiny)
    assert torch.isnan(model(batch)).any()  # step 0: the rotation checked ln1 only
    assert mon.checks_run == 1
    mon.sweep(targeted=True)  # the retry of the same step
    out = model(batch)
    assert torch.isfinite(out).all()
    assert mon.modes[h.op_name] == "STABLE_KERNEL" and mon.promoted == [h.op_name]
    # replicas ran for ln2 alone: the operators before it were finite, the ones after it saw
    # the repaired output (a full sweep checks all 9, and 8 of them for nothing)
    assert mon.checks_run == 2
    assert {n for n, hist in mon.history.items() if hist} == {"ln1/layer_norm#0", h.op_name}
    assert all(op.inherited_nonfinite == 0 for op in mon._ops.values())


def test_targeted_sweep_skips_operators_fed_a_nan_and_escalates_when_it_finds_none(tiny, batch):
    h = inject.overflow_activation(tiny, "ln2", scale=2.0 ** 100)
    mon = StabilityMonitor(tau_warn=1.0, tau_safe=2.0)
    model = mon.wrap(tiny)
    with mon.paused():
        model(batch)  # discovers the operators
    # ln2 pinned (never checked): the NaN now starts at an operator nobody may repair
    mon.force("NORMAL", [h.op_name])
    mon.step()
    mon.sweep(targeted=True)
    assert torch.isnan(model(batch)).any()
    # fc1, fc2 get NaN inputs: inherited, no replicas; only the rotation's operator 1 ran
    assert mon.checks_run == 1 and mon.history["attn.qkv/linear#0"]
    mon.step()
    mon.sweep(targeted=True)  # the last targeted sweep found nothing: this one is full
    model(batch)
    assert all(hist for n, hist in mon.history.items() if n in (
        "ln1/layer_norm#0", "attn/matmul#0", "attn.softmax/softmax#0"))


def _counted_op(name):
    calls = []

    def fn(x):
        calls.append(1)
        return (x.float() * 3.0).to(x.dtype)

    return StabilityMonitor().register(name, fn), calls


@pytest.mark.parametrize("tau_warn, promote, replicas", [
    (1.0, True, 2),      # S ~ u far below watch * tau_warn: the 2 screening replicas suffice
    (1e-6, True, 4),     # S above watch * tau_warn: all K run (and it is promoted)
    (1.0, False, 4),     # observe-only (calibration input): always K
])
def test_screening_runs_all_replicas_only_when_the_measurement_matters(
        tau_warn, promote, replicas):
    op, calls = _counted_op(f"triple_{replicas}_{int(promote)}_{tau_warn:g}".replace("-", "m")
                            .replace(".", "_"))
    mon = StabilityMonitor(k=4, screen_k=2, tau_warn=tau_warn, tau_safe=10.0, promote=promote)

    class M(nn.Module):
        def forward(self, x):
            return op(x)

    mon.wrap(M())(torch.randn(64).to(torch.bfloat16))
    assert mon.replicas_run == replicas
    assert len(calls) == 1 + replicas + len(mon.promotions)  # a promotion recomputes the call
    assert len(mon.promotions) == (tau_warn < 1)
    assert len(mon.history[mon.operators[0]]) == 1


def test_screened_and_full_measurements_share_replicas(tiny, batch):
    inject.fp16_accumulation(tiny, "fc1", offset=4096.0)
    full = StabilityMonitor(screen_k=4, tau_warn=1e3, tau_safe=2e3)
    screened = StabilityMonitor(screen_k=2, tau_warn=1e3, tau_safe=2e3)
    for mon in (full, screened):
        mon.sweep()
        mon.wrap(tiny)(batch)
    assert full.replicas_run == 4 * 9 and screened.replicas_run == 2 * 9
    # the injected operator disperses ~100x more than u either way; clean ones stay near u
    s_full, s_scr = full.history[FC1][0][1], screened.history[FC1][0][1]
    assert 0.5 < s_scr / s_full < 2.0
    assert max(h[0][1] for n, h in screened.history.items() if n != FC1) < 4 * 2.0 ** -8


def test_settled_operators_are_checked_on_one_turn_in_settle_every(tiny, batch):
    """Clean operators far below their threshold settle after ``settle_after`` checks and are
    then checked on one rotation turn in ``settle_every``; an operator whose score stays near
    its threshold keeps every turn (issue 30: the monitor's cost on small models)."""
    inject.fp16_accumulation(tiny, "fc1", offset=4096.0)  # S ~ 0.86: neither settled nor watched
    mon = StabilityMonitor(tau_warn=2.0, tau_safe=4.0, settle_after=2, settle_every=3)
    model = mon.wrap(tiny)
    _run(model, batch, mon, 9 * 8)
    for i, name in enumerate(mon.operators):
        steps = [e[0] for e in mon.history[name]]
        if name == FC1:
            assert 0.25 * 2.0 <= mon.scores[name] < 0.5 * 2.0  # above settle, below watch
            assert steps == [i + 9 * t for t in range(8)]  # every turn
        else:
            assert steps == [i, i + 9, i + 27, i + 54]  # turns 0, 1, then 3 and 6
    assert FC1 not in mon.settled and len(mon.settled) == 8
    every = StabilityMonitor(tau_warn=2.0, tau_safe=4.0, settle=0.0)
    model = every.wrap(tiny)
    _run(model, batch, every, 9 * 8)
    assert all(len(h) == 8 for h in every.history.values()) and every.settled == []


@pytest.mark.parametrize("kw, match", [
    ({"settle": 0.5, "watch": 0.5}, "settle must be below watch"),
    ({"settle": -0.1}, "settle must be in"),
    ({"settle_every": 0}, "settle_every must be an integer >= 1"),
    ({"settle_after": 0}, "settle_after must be an integer >= 1"),
])
def test_settle_settings_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        StabilityMonitor(**kw)


def test_replicas_perturb_every_element_independently_within_u():
    from fxstab.monitor.core import _perturbed

    u = 2.0 ** -8
    x = torch.linspace(1.0, 2.0, 4099)  # odd size: the last 64-bit draw is partly used
    g = torch.Generator().manual_seed(3)
    reps = _perturbed(x, 5, u, g)
    assert reps.shape == (5, 4099) and reps.dtype == torch.float32
    r = reps / x - 1  # the relative perturbations
    assert float(r.abs().max()) <= u and float(r.min()) < -0.99 * u and float(r.max()) > 0.99 * u
    assert abs(float(r.mean())) < 0.02 * u  # uniform, centred: sd u/sqrt(3)/sqrt(20495)
    assert float((r[0] - r[1]).abs().min()) >= 0 and not torch.equal(r[0], r[1])
    corr = torch.corrcoef(r[:2])[0, 1]
    assert abs(float(corr)) < 0.05  # replicas independent
    again = _perturbed(x, 5, u, torch.Generator().manual_seed(3))
    assert torch.equal(again, reps)  # a seed's replicas are the same
    # an attention mask's -inf stays -inf in every replica (x + u r x would make NaN of it)
    masked = _perturbed(torch.tensor([1.0, -math.inf, 0.0, math.inf]), 64, u, g)
    assert torch.equal(masked[:, 1:], torch.tensor([-math.inf, 0.0, math.inf]).expand(64, 3))


class _Fp32LayerNorm(nn.Module):
    """A LayerNorm hand-written in fp32 (upcast operands, cast back): the documented
    FP32_ACCUMULATION kernel of a layer norm."""

    def __init__(self, ln: nn.LayerNorm) -> None:
        super().__init__()
        self.ln = ln

    def forward(self, x):
        ln = self.ln
        return torch.nn.functional.layer_norm(x.float(), ln.normalized_shape, ln.weight.float(),
                                              ln.bias.float(), ln.eps).to(x.dtype)


@pytest.mark.parametrize("tau_safe, watched", [(0.5, False), (0.2, True)])
def test_a_promoted_operator_is_watched_against_tau_safe(tiny, batch, tau_safe, watched):
    """Issue 52: a LayerNorm of x + 64 (condition ~64/std(x): S ~ 0.13 in bf16, its fp32
    kernel too) is promoted to FP32_ACCUMULATION, where its score stays above the tau_warn it
    crossed. Only a score above tau_safe could change its mode, so it is watched (checked on
    every step) only once its score reaches watch * tau_safe; below that, its rotation turns
    (screen_k replicas) and the rechecks of its NORMAL kernel. Watched against tau_warn, it was
    checked with all K replicas on every step for good: +12% per step on bench_monitor's model,
    against +3.5% for the same model with the LayerNorm hand-written in fp32."""
    mon = StabilityMonitor(tau_warn=0.05, tau_safe=tau_safe, recheck=20)  # watch = 0.5
    backend = mon.backend()
    counters.clear()
    model = torch.compile(tiny, backend=backend)
    x = batch + 64  # ln1 and ln2 (the residual keeps the offset) are ill-conditioned
    replicas = []
    for _ in range(30):
        r0 = mon.replicas_run
        out = model(x)
        mon.step()
        replicas.append(mon.replicas_run - r0)
    ln1, ln2 = "ln1/layer_norm#0", "ln2/layer_norm#0"
    assert [(p.op, p.old, p.new, p.step) for p in mon.promotions] == [
        (ln1, "NORMAL", "FP32_ACCUMULATION", 0), (ln2, "NORMAL", "FP32_ACCUMULATION", 6)]
    assert all(0.1 < mon.scores[n] < 0.5 * 0.5 for n in (ln1, ln2))  # 0.13-0.15
    checks = {n: [(e[0], e[3]) for e in mon.history[n]] for n in (ln1, ln2)}
    if watched:  # 0.13 >= watch * tau_safe = 0.1: checked on every step
        assert [s for s, _ in checks[ln1]] == list(range(30))
        assert [s for s, _ in checks[ln2]] == list(range(6, 30))
    else:  # rotation turns (ln1 is operator 0 of 9, ln2 operator 6) and rechecks at +20
        assert checks[ln1] == [(0, "NORMAL"), (9, "FP32_ACCUMULATION"),
                               (18, "FP32_ACCUMULATION"), (20, "NORMAL"),
                               (27, "FP32_ACCUMULATION")]
        assert checks[ln2] == [(6, "NORMAL"), (15, "FP32_ACCUMULATION"),
                               (24, "FP32_ACCUMULATION"), (26, "NORMAL")]
        # steps 9 and 18 check ln1 alone (its rotation turn): S < watch * tau_safe = 0.25,
        # so the screening replicas are the measurement
        assert replicas[9] == replicas[18] == 2
    assert mon.modes == {n: "FP32_ACCUMULATION" if n in (ln1, ln2) else "NORMAL"
                         for n in mon.operators}
    # the promotions recompiled nothing
    assert backend.compiles == 1 and counters["stats"]["unique_graphs"] == 1
    # the promoted LayerNorms compute as the documented fp32 kernel, written by hand
    ref = copy.deepcopy(tiny)
    ref.ln1, ref.ln2 = _Fp32LayerNorm(ref.ln1), _Fp32LayerNorm(ref.ln2)
    with mon.paused():
        out = model(x)
    out.float().pow(2).mean().backward()
    ref(x).float().pow(2).mean().backward()
    assert torch.equal(out, ref(x).detach())
    grads = dict(ref.named_parameters())
    for name, p in tiny.named_parameters():
        key = name.replace("ln1.", "ln1.ln.").replace("ln2.", "ln2.ln.")
        assert torch.equal(p.grad, grads[key].grad), name


def test_upcast_casts_what_tree_map_casts():
    """The modes' cast walks plain tuples, lists and dicts itself (issue 52: ``tree_map`` was
    most of a promoted LayerNorm's extra time); any other container goes through tree_map."""
    from collections import namedtuple
    from torch.utils._pytree import tree_map

    from fxstab.monitor.modes import _cast_floats

    Pair = namedtuple("Pair", "a b")
    x, i = torch.randn(3).to(torch.bfloat16), torch.arange(3)
    tree = (x, [i, (x, 2.5, None, "s", torch.float16)], {"w": x, "n": 3},
            Pair(x, i), torch.max(x.float().reshape(3, 1), dim=1), torch.device("cpu"))
    ours = _cast_floats(tree, torch.float32)
    ref = tree_map(lambda t: t.to(torch.float32)
                   if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
    ours_leaves, ours_spec = torch.utils._pytree.tree_flatten(ours)
    ref_leaves, ref_spec = torch.utils._pytree.tree_flatten(ref)
    assert ours_spec == ref_spec and type(ours[3]) is Pair and type(ours[4]) is type(tree[4])
    for a, b in zip(ours_leaves, ref_leaves):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a is b or a == b
