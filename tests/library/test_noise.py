"""Noise sources: the pre-drawn table and antithetic pairs."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn
from torch.distributions import Laplace, Normal

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac, Rayleigh
from liegroup_blr.noise import NoiseSource, NoiseTable, symmetric_centre
from tests.library.test_optim import recording_closure
from tests.shared import closure_for, make_problem, snapshot


def test_table_holds_base_draws_with_the_base_moments():
    table = NoiseTable(Rayleigh(2.0), size=400_000, seed=0, dtype=torch.float64).table
    base = Rayleigh(2.0)
    n = table.numel()
    se_mean = math.sqrt(float(base.variance) / n)
    assert abs(float(table.mean()) - float(base.mean)) < 5 * se_mean
    # SE of the sample variance: sqrt((μ₄ − σ⁴)/n), μ₄ estimated from the table
    mu4 = float(((table - table.mean()) ** 4).mean())
    se_var = math.sqrt((mu4 - float(base.variance) ** 2) / n)
    assert abs(float(table.var()) - float(base.variance)) < 5 * se_var
    assert bool((table > 0).all())


def test_table_windows_are_views_deterministic_and_bounded():
    a = NoiseTable(Normal(0.0, 1.0), size=1000, seed=3)
    b = NoiseTable(Normal(0.0, 1.0), size=1000, seed=3)
    assert torch.equal(a.table, b.table)
    w = a.window(10, 995)  # offsets wrap into {0, …, T − n}
    assert w.data_ptr() == a.table[995 % 991].data_ptr()
    out = torch.empty(2, 5)
    a.fill_(out, 7)
    assert torch.equal(out.flatten(), a.table[7:17])
    with pytest.raises(ValueError, match="numel"):
        a.window(1001, 0)
    with pytest.raises(ValueError, match="size"):
        NoiseTable(Normal(0.0, 1.0), size=0, seed=0)


def _draws(opt, p, count):
    out = []
    for _ in range(count):
        with opt.sampled_params():
            out.append(p.detach().clone())
    return torch.stack(out)


def test_table_noise_has_base_moments_and_successive_draws_are_uncorrelated():
    """Stated bound: the correlation of a coordinate across successive draws is
    1/(T − n + 1) (equal offsets) — below 5/√(n·K) + 1/(T − n + 1) empirically."""
    n, steps, size = 2_000, 300, 50_000
    p = nn.Parameter(torch.zeros(n, dtype=torch.float64))
    opt = lgb.AdditiveBLR([p], lr=0.1, base=Laplace(0.0, 0.5), noise="table", table_size=size)
    xi = _draws(opt, p, steps)
    base = Laplace(0.0, 0.5)
    se = math.sqrt(float(base.variance) / size)  # the draws reuse T = size base values
    assert abs(float(xi.mean())) < 5 * se
    assert abs(float(xi.var()) / float(base.variance) - 1) < 0.05
    centred = xi - xi.mean()
    corr = float((centred[1:] * centred[:-1]).mean() / xi.var())
    bound = 5 / math.sqrt(n * (steps - 1)) + 1 / (size - n + 1)
    assert abs(corr) < bound


def test_table_draws_are_cheap_views_not_fresh_random_numbers():
    """Each draw copies a window: two draws at the same offset agree exactly."""
    p = nn.Parameter(torch.zeros(100))
    opt = lgb.AdditiveBLR([p], lr=0.1, base=Normal(0.0, 1.0), noise="table", table_size=150)
    table = opt.noise_source.table(opt.param_groups[0]["base"], 0, p, 2 * p.numel()).table
    xi = _draws(opt, p, 20)
    for row in xi:  # every draw is a window of the table
        starts = [o for o in range(51) if torch.equal(table[o : o + 100], row)]
        assert len(starts) == 1


@pytest.mark.parametrize("centre", [0.0, 1.5])
def test_antithetic_pairs_are_exact_reflections(centre):
    theta = nn.Parameter(torch.zeros(50, dtype=torch.float64))
    opt = lgb.AdditiveBLR([theta], lr=0.1, base=Normal(centre, 0.3), mc_samples=4, antithetic=True)
    m = opt.group_element(theta)["m"]
    seen: list[torch.Tensor] = []
    opt.step(recording_closure(opt, theta, seen))
    for first, second in ((0, 1), (2, 3)):
        torch.testing.assert_close(seen[second] - m, 2 * centre - (seen[first] - m))
    assert not torch.allclose(seen[0], seen[2])  # pairs are independent of each other


H = torch.tensor([1.0, 3.0], dtype=torch.float64)
C = torch.tensor([0.5, -1.0], dtype=torch.float64)


def _one_step_momentum(make, chains: int = 20_000) -> torch.Tensor:
    """The 2-sample algebra-gradient estimate X̂ on ℓ = ½ Σ h(θ − c)² at θ = 0, for ``chains``
    independent coordinates: with momentum 0 the momentum after one step is X̂."""
    theta = nn.Parameter(torch.zeros(chains, 2, dtype=torch.float64))
    opt = make([theta])

    def closure():
        opt.zero_grad()
        loss = 0.5 * (H * (theta - C) ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return opt.state[theta]["momentum"]


def test_antithetic_pairs_lower_the_variance_of_location_gradients():
    """Pairs (ξ, −ξ) cancel the odd part of the integrand. On a quadratic the additive
    gradient h(m + ξ − c) and the affine shift gradient V̂ = hA(Aξ + b − c) are odd in ξ
    around their mean, so the paired estimate is exact, while two independent draws have
    variance h²σ²/2 (additive, σ = 0.3) and h²A²σ²/2 (affine v, A = σ = 1). The affine scale
    gradient Û = hA²ξ² + h(b − c)Aξ keeps its even part (Var 2h² paired vs
    h² + h²(b − c)²/2 independent): antithetic pairs help it only far from the optimum."""

    def additive(antithetic):
        return lambda ps: lgb.AdditiveBLR(
            ps, lr=0.1, momentum=0.0, base=Normal(0.0, 0.3), mc_samples=2, antithetic=antithetic
        )

    def affine(antithetic):
        return lambda ps: lgb.AffineBLR(
            ps,
            lr=0.1,
            scale_lr=0.1,
            momentum=0.0,
            scale_momentum=0.0,
            base=Normal(0.0, 1.0),
            data_size=None,
            temperature=0.0,
            mc_samples=2,
            antithetic=antithetic,
        )

    ind, paired = _one_step_momentum(additive(False)), _one_step_momentum(additive(True))
    torch.testing.assert_close(paired, (-H * C).expand_as(paired))  # h(m − c), exactly
    assert torch.allclose(ind.var(0), H**2 * 0.09 / 2, rtol=0.1)  # 0.1 ≈ 7 relative SE

    ind, paired = _one_step_momentum(affine(False)), _one_step_momentum(affine(True))
    torch.testing.assert_close(paired[1], (-H * C).expand_as(paired[1]))  # V̂ = hA(b − c)
    assert torch.allclose(ind[1].var(0), H**2 / 2, rtol=0.1)
    for est in (ind[0], paired[0]):  # Û unbiased either way: E = h E[ξ²] = h
        assert bool(((est.mean(0) - H).abs() < 5 * est.std(0) / math.sqrt(len(est))).all())
    # relative SE of these sample variances ≈ √((κ − 1)/n) ≤ 2.7%: 15% is > 5 SE
    assert torch.allclose(ind[0].var(0), H**2 + H**2 * C**2 / 2, rtol=0.15)
    assert torch.allclose(paired[0].var(0), 2 * H**2, rtol=0.15)


@pytest.mark.parametrize(
    ("noise", "antithetic"), [("table", False), ("fresh", True), ("table", True)]
)
def test_generic_and_specialised_agree_with_every_noise_source(noise, antithetic):
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    kwargs = dict(noise=noise, antithetic=antithetic, table_size=5_000, mc_samples=2)
    spec = lgb.AffineBLR(
        model.parameters(),
        lr=0.2,
        scale_lr=0.2,
        momentum=0.7,
        scale_momentum=0.7,
        base=Normal(0.0, 0.1),
        data_size=32,
        **kwargs,
    )
    gen = lgb.LieGroupBLR(
        twin.parameters(),
        lgb.groups.DiagonalAffineGroup(),
        Normal(0.0, 0.1),
        lr=0.2,
        momentum=0.7,
        data_size=32,
        seed=spec.seed,
        **kwargs,
    )
    for _ in range(5):
        spec.step(closure_for(spec, model, x, y))
        gen.step(closure_for(gen, twin, x, y))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-11, atol=1e-14)


def test_state_dict_resumes_table_and_antithetic_noise_bit_identically():
    model, x, y = make_problem(dtype=torch.float32)

    def make(m):
        return lgb.AdditiveBLR(
            m.parameters(),
            lr=0.1,
            base=Normal(0.0, 0.05),
            mc_samples=2,
            noise="table",
            antithetic=True,
            table_size=10_000,
        )

    opt = make(model)
    for _ in range(3):
        opt.step(closure_for(opt, model, x, y))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for _ in range(3):
        opt.step(closure_for(opt, model, x, y))
    expected = snapshot(opt, model)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, _, _ = make_problem(seed=4, dtype=torch.float32)
    model2.load_state_dict(ckpt["model"])
    opt2 = make(model2)
    opt2.step(closure_for(opt2, model2, x, y))  # builds its own tables, from its own seed
    opt2.load_state_dict(ckpt["opt"])
    for _ in range(3):
        opt2.step(closure_for(opt2, model2, x, y))
    got = snapshot(opt2, model2)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0], strict=True))


def test_invalid_noise_options_raise_value_errors_naming_them():
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"^noise"):
        lgb.AdditiveBLR(p, lr=0.1, noise="quasi")
    with pytest.raises(ValueError, match=r"^table_size"):
        lgb.AdditiveBLR(p, lr=0.1, noise="table", table_size=0)
    with pytest.raises(ValueError, match=r"^antithetic"):
        lgb.MultiplicativeBLR(p, lr=0.1, data_size=1, antithetic=True, init="auto")
    assert symmetric_centre(Rayleigh(1.0)) is None
    assert symmetric_centre(Normal(2.0, 1.0)) == 2.0


class CentreNoise(NoiseSource):
    """A user-defined source: every ξ at the base's mean, the draws counted."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def draw(self, outs, base, keys, index, *, predict):
        self.draws += 1
        return [out.fill_(float(base.mean)) for out in outs]


def test_a_user_defined_noise_source_passed_as_noise_is_what_the_optimizer_draws():
    """``noise=`` takes a :class:`NoiseSource`: the additive rule drawing ξ = E[ξ] = 0 from it
    takes the steps of the same rule with a Dirac base at 0 (SGD with momentum), once per
    sample; the source is bound to the optimizer's seed and saved in its state dict."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    source = CentreNoise()
    opt = lgb.AdditiveBLR(
        model.parameters(), lr=0.05, base=Normal(0.0, 0.1), noise=source, mc_samples=2, seed=4
    )
    dirac = lgb.AdditiveBLR(twin.parameters(), lr=0.05, base=Dirac(0.0), mc_samples=2, seed=4)
    for _ in range(3):
        opt.step(closure_for(opt, model, x, y))
        dirac.step(closure_for(dirac, twin, x, y))
    assert opt.noise_source is source and source.seed == 4
    assert source.draws == 3 * 2  # steps × samples, one param group
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.state_dict()["seed"] == 4 and set(opt.state_dict()["predict_rng"]) == {"cpu"}
