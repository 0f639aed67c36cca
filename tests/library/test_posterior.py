"""The Posterior object: taken from each optimizer, it gives the optimizer's point estimate and
samples bit for bit, survives state dicts and files (in a fresh process too), and refuses
what it cannot do in one line.

"The same noise": a posterior draws its base noise with ``sample_into`` entry by entry in the
optimizer's order, so a generator put in the state of the optimizer's generator of prediction
draws (``optimizer.state_dict()["predict_rng"]["cpu"]``, a documented entry) reproduces the
optimizer's next ``sampled_params()`` sample (fresh noise, eager steps).
"""

from __future__ import annotations

import copy
import io
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.distributions import Rayleigh
from liegroup_blr.groups import (
    DiagonalAffineGroup,
    FullAffineGroup,
    MultiplicativeGroup,
    RotationScalingGroup,
)
from liegroup_blr.optim import BLROptimizer
from liegroup_blr.posterior import Posterior
from liegroup_blr.posterior_io import FORMAT
from liegroup_blr.predictive import predictive_log_probs

Z = 5.0
CPU = "cpu"


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _generic(model: nn.Sequential, point_estimate: str) -> BLROptimizer:
    """LieGroupBLR with three groups: rotation-scalings, the diagonal affine group (the
    default) and a full affine group on one bias."""
    first, last = model[0], model[2]
    groups = [
        {
            "params": list(first.parameters()),
            "group": RotationScalingGroup(),
            "base": Normal(1.0, 0.2),
        },
        {"params": [last.weight]},
        {"params": [last.bias], "group": FullAffineGroup()},
    ]
    return lgb.LieGroupBLR(
        groups,
        DiagonalAffineGroup(),
        Normal(0.3, 0.1),
        lr=0.1,
        data_size=100,
        point_at=point_estimate,
        seed=1,
    )


RULES: dict[str, Callable[[nn.Sequential, str], BLROptimizer]] = {
    "additive": lambda m, pe: lgb.AdditiveBLR(
        m.parameters(), lr=0.1, base=Normal(0.2, 0.1), point_at=pe, seed=1
    ),
    "affine": lambda m, pe: lgb.AffineBLR(
        m.parameters(),
        lr=0.1,
        scale_lr=0.1,
        base=Normal(0.3, 0.1),
        data_size=100,
        point_at=pe,
        seed=1,
    ),
    "multiplicative": lambda m, pe: lgb.MultiplicativeBLR(
        m.parameters(),
        lr=0.5,
        data_size=100,
        temperature=0.1,
        point_at=pe,
        seed=1,
        init="auto",
    ),
    "generic": _generic,
}
INPUTS = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
LABELS = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(1))


def trained(
    rule: str,
    point_estimate: str = "g",
    model: nn.Sequential | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Sequential, BLROptimizer]:
    """A model and its optimizer after three steps (inputs in ``dtype``)."""
    model = make_model() if model is None else model
    opt = RULES[rule](model, point_estimate)
    inputs = INPUTS.to(dtype)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs).float(), LABELS)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return model, opt


def values(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def optimizer_generator(opt: BLROptimizer) -> torch.Generator:
    """A generator in the state of the optimizer's CPU generator of prediction draws."""
    gen = torch.Generator()
    gen.set_state(opt.state_dict()["predict_rng"][CPU])
    return gen


def blank(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter set to 0."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    return other


# ----------------------------------------------------------- the optimizer's values
@pytest.mark.parametrize("point_estimate", ["g", "mean"])
@pytest.mark.parametrize("rule", list(RULES))
def test_point_estimate_is_what_the_optimizer_writes(rule: str, point_estimate: str) -> None:
    model, opt = trained(rule, point_estimate)
    post = Posterior.from_optimizer(opt, model)
    assert post.point_at == point_estimate
    other = blank(model)
    with post.at_point_estimate(other):
        assert same(values(other), values(model))
    assert all(bool((p == 0).all()) for p in other.parameters())  # restored
    post.load_point_estimate(other)
    assert same(values(other), values(model))


@pytest.mark.parametrize("rule", list(RULES))
def test_a_sample_is_the_optimizers_bit_for_bit_given_its_noise(rule: str) -> None:
    model, opt = trained(rule)
    post = Posterior.from_optimizer(opt, model)
    other = blank(model)
    gen = optimizer_generator(opt)
    for _ in range(2):
        with opt.sampled_params():
            expected = values(model)
        with post.sampled(other, generator=gen):
            assert same(values(other), expected)
    assert all(bool((p == 0).all()) for p in other.parameters())


@pytest.mark.parametrize(
    ("rule", "point_estimate"), [(r, pe) for r in RULES for pe in ("g", "mean")]
)
def test_half_precision_parameters(rule: str, point_estimate: str) -> None:
    """bfloat16 parameters, float32 state: θ and the point estimate rounded to bfloat16 as
    the optimizer rounds them."""
    model, opt = trained(rule, point_estimate, make_model().to(torch.bfloat16), torch.bfloat16)
    post = Posterior.from_optimizer(opt, model)
    assert post["0.weight"].element.dtype == torch.float32
    other = blank(model)
    gen = optimizer_generator(opt)
    with opt.sampled_params():
        expected = values(model)
    with post.sampled(other, generator=gen):
        assert same(values(other), expected)
    post.load_point_estimate(other)
    assert same(values(other), values(model))


@pytest.mark.parametrize("rule", ["affine", "generic"])
def test_model_average_from_the_posterior_equals_the_optimizers(rule: str) -> None:
    """predictive_log_probs with the posterior (global generator) and with the optimizer (its
    own generator), both generators in one state: the same average, bit for bit."""
    model, opt = trained(rule)
    post = Posterior.from_optimizer(opt, model)
    state = opt.state_dict()["predict_rng"][CPU]
    batches = [INPUTS[:20], INPUTS[20:]]
    expected = predictive_log_probs(model, batches, opt, samples=5)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.set_state(state)
        got = predictive_log_probs(model, batches, post, samples=5)
    assert torch.equal(got, expected)
    assert not torch.equal(got, predictive_log_probs(model, batches, None))


def _moments(draw: Callable[[], list[Tensor]], n: int) -> tuple[Tensor, ...]:
    flat = torch.stack([torch.cat([t.flatten() for t in draw()]) for _ in range(n)]).double()
    return flat.mean(0), flat.var(0), ((flat - flat.mean(0)) ** 4).mean(0)


@pytest.mark.slow
@pytest.mark.parametrize("rule", list(RULES))
def test_samples_agree_in_law_with_the_optimizers(rule: str) -> None:
    """Per coordinate, mean and variance of 3,000 samples of each, independent noise:
    |Δmean| ≤ Z·√(v₁/n + v₂/n), |Δvar| ≤ Z·√((m4₁ − v₁²)/n + (m4₂ − v₂²)/n)."""
    model, opt = trained(rule)
    post = Posterior.from_optimizer(opt, model)
    n, gen = 3000, torch.Generator().manual_seed(99)

    def from_optimizer() -> list[Tensor]:
        with opt.sampled_params():
            return values(model)

    def from_posterior() -> list[Tensor]:
        return list(post.sample(gen).values())

    m1, v1, q1 = _moments(from_optimizer, n)
    m2, v2, q2 = _moments(from_posterior, n)
    assert bool(((m1 - m2).abs() <= Z * ((v1 + v2) / n).sqrt() + 1e-12).all())
    se_var = ((q1 - v1**2 + q2 - v2**2) / n).sqrt()
    assert bool(((v1 - v2).abs() <= Z * se_var + 1e-12).all())
    assert bool((v2 > 0).all())


def test_sample_moments_follow_the_group_and_base() -> None:
    """Affine with N(μ, σ²): E[θ] = b + Aμ, Var θ = A²σ²; multiplicative with Rayleigh(1):
    E[θ] = √(π/2)(g⁺ − g⁻), Var θ = (2 − π/2)(g⁺² + g⁻²); each within Z standard errors of
    4,000 samples (of a variance: √((m₄ − s⁴)/n) from the draws)."""
    n, gen = 4000, torch.Generator().manual_seed(5)
    for rule in ("affine", "multiplicative"):
        model, opt = trained(rule)
        post = Posterior.from_optimizer(opt, model)
        key = "0.weight"
        g = post[key].element.double()
        if rule == "affine":
            mean, var = g[1] + 0.3 * g[0], (g[0] * float(Normal(0.3, 0.1).scale)) ** 2
        else:
            mean = math.sqrt(math.pi / 2) * (g[0] - g[1])
            var = (2 - math.pi / 2) * (g[0] ** 2 + g[1] ** 2)
        draws = torch.stack([post.sample(gen)[key] for _ in range(n)]).double()
        assert bool(((draws.mean(0) - mean).abs() <= Z * (var / n).sqrt()).all())
        fourth = ((draws - draws.mean(0)) ** 4).mean(0)
        se_var = ((fourth - draws.var(0) ** 2) / n).sqrt()  # sd of a sample variance
        assert bool(((draws.var(0) - var).abs() <= Z * se_var).all())


# ------------------------------------------------------------------------ keys
def test_by_position_and_by_name_give_the_same_samples() -> None:
    model, opt = trained("affine")
    by_name = Posterior.from_optimizer(opt, model)
    by_position = Posterior.from_optimizer(opt)
    assert list(by_name) == [n for n, _ in model.named_parameters()]
    assert list(by_position) == [0, 1, 2, 3] and by_position.size == 4
    a, b = blank(model), blank(model)
    with by_name.sampled(a, torch.Generator().manual_seed(3)):
        with by_position.sampled(b, torch.Generator().manual_seed(3)):
            assert same(values(a), values(b))
            assert not same(values(a), values(model))


def test_a_frozen_parameter_is_left_out_and_named() -> None:
    model = make_model()
    model[0].bias.requires_grad_(False)
    frozen = model[0].bias.detach().clone()
    _, opt = trained("affine", model=model)
    with pytest.warns(UserWarning, match=r"left out: \['0.bias'\]"):
        post = Posterior.from_optimizer(opt, model)
    assert post.missing == ["0.bias"] and "0.bias" not in post and len(post) == 3
    with pytest.warns(UserWarning, match=r"left out: \[1\]"):
        assert Posterior.from_optimizer(opt).missing == [1]
    other = copy.deepcopy(model)
    gen = optimizer_generator(opt)
    with opt.sampled_params():
        expected = values(model)
    with post.sampled(other, generator=gen):
        assert same(values(other), expected)  # the optimizer skips it too: same noise order
        assert torch.equal(other[0].bias, frozen)
    assert Posterior.from_state_dict(post.state_dict()).missing == ["0.bias"]


def test_a_parameter_missing_from_the_model_is_refused() -> None:
    _, opt = trained("additive")
    with pytest.raises(ValueError, match=r"^model: the optimizer's parameter 0 \(shape \(6, 4"):
        Posterior.from_optimizer(opt, make_model())


# ----------------------------------------------------------------- mismatched models
def test_mismatched_models_are_refused_in_one_line_and_left_unchanged() -> None:
    model, opt = trained("affine")
    by_name, by_position = Posterior.from_optimizer(opt, model), Posterior.from_optimizer(opt)
    wider = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))
    renamed = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))  # names 0.*, 1.*
    deeper = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Linear(3, 3))
    cases = [
        (by_name, wider, r"^model: parameter '0.weight' has shape \(7, 4\), the posterior's"),
        (by_name, renamed, r"^model: has no parameter '2.weight'"),
        (by_position, wider, r"^model: parameter 0 has shape \(7, 4\)"),
        (by_position, deeper, r"^model: has 6 parameters, the posterior was taken by position"),
    ]
    for post, other, message in cases:
        before = values(other)
        for use in (post.sampled, post.at_point_estimate):
            with pytest.raises(ValueError, match=message + "[^\n]*$"), use(other):
                pass
        with pytest.raises(ValueError, match=message):
            post.load_point_estimate(other)
        assert same(values(other), before)


def test_sampled_restores_the_model_on_error() -> None:
    model, opt = trained("multiplicative")
    post = Posterior.from_optimizer(opt, model)
    other = copy.deepcopy(model)
    before = values(other)
    with pytest.raises(RuntimeError, match="inside"), post.sampled(other):
        assert not same(values(other), before)
        raise RuntimeError("inside the block")
    assert same(values(other), before)


# -------------------------------------------------------------- state dicts and files
def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in (*_leaves(k), *_leaves(v))]
    if isinstance(obj, list):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def assert_same_posterior(a: Posterior, b: Posterior) -> None:
    assert list(a) == list(b)
    assert (a.point_at, a.missing, a.size) == (b.point_at, b.missing, b.size)
    assert (a.temperature, a.data_size) == (b.temperature, b.data_size)
    for key in a:
        x, y = a[key], b[key]
        assert torch.equal(x.element, y.element) and x.element.dtype == y.element.dtype
        assert type(x.group) is type(y.group) and x.group.extra_repr() == y.group.extra_repr()
        assert type(x.base) is type(y.base) and x.shape == y.shape
        assert repr(x.base) == repr(y.base)
    for seed in (0, 1):
        sa, sb = (p.sample(torch.Generator().manual_seed(seed)) for p in (a, b))
        assert same(list(sa.values()), list(sb.values()))


@pytest.mark.parametrize("rule", list(RULES))
def test_state_dict_round_trip_through_weights_only_load(rule: str) -> None:
    model, opt = trained(rule, "mean")
    post = Posterior.from_optimizer(opt, model)
    buffer = io.BytesIO()
    torch.save(post.state_dict(), buffer)
    buffer.seek(0)
    sd = torch.load(buffer, weights_only=True)
    allowed = (Tensor, str, int, float, bool, type(None))
    assert all(isinstance(leaf, allowed) for leaf in _leaves(sd))
    assert sd["format"] == FORMAT and sd["version"] == 2
    assert_same_posterior(post, Posterior.from_state_dict(sd))


FRESH = textwrap.dedent(
    """
    import sys
    import torch
    import liegroup_blr as lgb

    post = lgb.Posterior.load(sys.argv[1])
    gen = torch.Generator().manual_seed(123)
    samples = [post.sample(gen) for _ in range(3)]
    torch.save(
        {"state_dict": post.state_dict(), "samples": samples, "points": post.point_estimates()},
        sys.argv[2],
    )
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["multiplicative", "generic"])
def test_a_file_round_trip_in_a_fresh_process(rule: str, tmp_path: Path) -> None:
    model, opt = trained(rule, "mean")
    post = Posterior.from_optimizer(opt, model)
    path, out = tmp_path / "posterior.pt", tmp_path / "fresh.pt"
    post.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["posterior.pt"]  # no temporary left
    checkout = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run(
        [sys.executable, "-c", FRESH, str(path), str(out)],
        check=True,
        cwd=tmp_path,
        env=checkout,  # this checkout's package, wherever the test runs
        timeout=300,
    )
    fresh = torch.load(out, weights_only=True)
    assert_same_posterior(post, Posterior.from_state_dict(fresh["state_dict"]))
    gen = torch.Generator().manual_seed(123)
    for theirs in fresh["samples"]:
        assert same(list(post.sample(gen).values()), list(theirs.values()))
    assert same(list(post.point_estimates().values()), list(fresh["points"].values()))
    # and the optimizer's own next sample, drawn in the fresh process's way
    gen = optimizer_generator(opt)
    with opt.sampled_params():
        expected = values(model)
    assert same(list(Posterior.load(path).sample(gen).values()), expected)


def _write(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


class _Foreign:
    """An arbitrary pickled object: not loadable with weights_only=True."""


def test_foreign_and_corrupt_files_are_refused_in_one_line(tmp_path: Path) -> None:
    model, opt = trained("affine")
    post = Posterior.from_optimizer(opt, model)
    good = tmp_path / "good.pt"
    post.save(good)
    data = good.read_bytes()
    sd = post.state_dict()
    truncated, garbage = tmp_path / "truncated.pt", tmp_path / "garbage.pt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage.write_bytes(b"not a torch file at all")
    cases = {
        _write(tmp_path / "model.pt", model.state_dict()): "not a liegroup_blr Posterior",
        _write(tmp_path / "version.pt", {**sd, "version": 3}): "format version 3",
        _write(tmp_path / "malformed.pt", {**sd, "entries": [{"key": "x"}]}): "malformed",
        _write(tmp_path / "pickle.pt", {"x": _Foreign()}): "not a readable Posterior file",
        truncated: "not a readable Posterior file",
        garbage: "not a readable Posterior file",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=f"^path: '{path}'[^\n]*{message}[^\n]*$"):
            Posterior.load(path)
    with pytest.raises(ValueError, match=r"^state_dict: not a liegroup_blr Posterior"):
        Posterior.from_state_dict(model.state_dict())
    with pytest.raises(FileNotFoundError):
        Posterior.load(tmp_path / "absent.pt")


# ------------------------------------------------------------ custom groups and bases
class CustomAffine(DiagonalAffineGroup):
    """A user's group: a file cannot hold it."""


class CustomNormal(Normal):
    """A user's base: a file cannot hold it."""


def test_custom_groups_and_bases_must_be_passed_at_load() -> None:
    model = make_model()
    opt = lgb.LieGroupBLR(
        model.parameters(), CustomAffine(), CustomNormal(0.0, 0.1), lr=0.1, data_size=100
    )
    post = Posterior.from_optimizer(opt, model)
    sd = post.state_dict()
    with pytest.raises(ValueError, match=r"^groups: entry '0.weight' .*custom 'CustomAffine'.*"):
        Posterior.from_state_dict(sd)
    with pytest.raises(ValueError, match=r"^bases: entry '0.weight' .*custom 'CustomNormal'"):
        Posterior.from_state_dict(sd, groups={"CustomAffine": CustomAffine()})
    base = CustomNormal(0.0, 0.1)
    with pytest.raises(ValueError, match=r"^groups: entry '0.bias'"):  # only one entry passed
        Posterior.from_state_dict(sd, groups={"0.weight": CustomAffine()}, bases=base)
    with pytest.raises(ValueError, match=r"saved with a 'CustomAffine', got a 'DiagonalAff"):
        Posterior.from_state_dict(sd, groups={"CustomAffine": DiagonalAffineGroup()}, bases=base)
    for groups in (CustomAffine(), {"CustomAffine": CustomAffine()}):
        loaded = Posterior.from_state_dict(sd, groups=groups, bases={"CustomNormal": base})
        assert_same_posterior(post, loaded)


def test_built_in_bases_keep_their_parameters_exactly() -> None:
    """A float64 base scale survives the file as float64 (a float would round it)."""
    model = make_model()
    scale = torch.tensor(0.1234567890123, dtype=torch.float64)
    opt = lgb.MultiplicativeBLR(
        model.parameters(), lr=0.5, base=Rayleigh(scale), data_size=10, init="auto"
    )
    post = Posterior.from_state_dict(Posterior.from_optimizer(opt, model).state_dict())
    assert torch.equal(post["0.weight"].base.scale, scale)
    assert isinstance(post["0.weight"].group, MultiplicativeGroup)


# ----------------------------------------------------------------------- the object
def test_repr_len_iteration_and_to() -> None:
    model, opt = trained("affine", "mean")
    post = Posterior.from_optimizer(opt, model)
    text = repr(post)
    assert text.splitlines()[0] == (
        "Posterior(4 entries by name, point_at='mean', temperature=1.0, data_size=100.0)"
    )
    assert "  0.weight: (6, 4) DiagonalAffineGroup() Normal(loc=0.3, scale=0.1)" in text
    assert len(post) == 4 and list(post) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    wide = post.to(dtype=torch.float64)
    assert wide["0.bias"].element.dtype == torch.float64
    assert post["0.bias"].element.dtype == torch.float32  # a copy, as Tensor.to
    assert post.to(CPU)["0.bias"].element.device.type == CPU
    assert torch.equal(wide["0.bias"].element, post["0.bias"].element.double())


def test_invalid_construction_is_refused() -> None:
    model, opt = trained("affine")
    post = Posterior.from_optimizer(opt, model)
    entry = post["0.bias"]
    with pytest.raises(ValueError, match=r"^point_at"):
        Posterior(dict(post), point_at="median")
    with pytest.raises(ValueError, match=r"^element: entry 'b' has shape \(2, 6\)"):
        Posterior({"b": type(entry)(entry.element, entry.group, entry.base, torch.Size([5]))})
    with pytest.raises(ValueError, match="all parameter names or all positions"):
        Posterior({"b": entry, 0: entry})


# ------------------------------------------------------------------ deprecated names
def test_point_estimate_is_the_deprecated_name_of_point_at(tmp_path) -> None:
    """``point_estimate=``, ``.point_estimate`` and ``with_point_estimate`` still work, with a
    DeprecationWarning each; nothing warns where the new names are used; a file keeps its
    ``"point_estimate"`` key and loads into ``point_at``."""
    model, opt = trained("affine", "mean")
    post = Posterior.from_optimizer(opt, model)
    assert post.point_at == "mean"
    with pytest.warns(DeprecationWarning, match="point_at="):
        old = Posterior(dict(post), point_estimate="mean")
    assert old.point_at == "mean"
    assert same([*old.point_estimates().values()], [*post.point_estimates().values()])
    with pytest.warns(DeprecationWarning, match="read point_at"):
        assert post.point_estimate == "mean"
    with pytest.warns(DeprecationWarning, match="with_point_at"):
        at_g = post.with_point_estimate("g")
    expected = post.with_point_at("g").point_estimates()
    assert at_g.point_at == "g"
    assert same([*at_g.point_estimates().values()], [*expected.values()])
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"^point_at"):
        Posterior(dict(post), point_estimate="median")
    state = post.state_dict()
    assert state["point_estimate"] == "mean" and "point_at" not in state
    post.save(tmp_path / "post.pt")
    assert Posterior.load(tmp_path / "post.pt").point_at == "mean"


def test_unwrap_is_the_one_name_and_holder_and_wrapped_its_deprecated_ones() -> None:
    """``posterior.unwrap`` finds the optimizer behind wrappers of wrappers; ``holder`` is
    its deprecated name (it warns), ``wrapped`` walks the same chain."""
    model, opt = trained("additive")

    class Wrapper:
        def __init__(self, inner: Any, attribute: str) -> None:
            setattr(self, attribute, inner)

    outer = Wrapper(Wrapper(opt, "_optimizer"), "optimizer")
    assert lgb.posterior.unwrap(outer) is opt
    assert lgb.posterior.unwrap(opt) is opt
    assert lgb.posterior.unwrap(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    assert lgb.posterior.unwrap(None) is None
    cycle = Wrapper(None, "optimizer")
    cycle.optimizer = cycle
    assert lgb.posterior.unwrap(cycle) is None
    with pytest.warns(DeprecationWarning, match="posterior.unwrap"):
        assert lgb.posterior.holder(outer) is opt
    with pytest.warns(DeprecationWarning, match="posterior.unwrap"):
        assert list(lgb.posterior.wrapped(outer)) == [outer, outer.optimizer, opt]
    assert lgb.optim.unwrap is lgb.posterior.unwrap  # one function, two homes

    class HoldsAPosterior:  # e.g. mean-field VI: a posterior, but not a Lie-group optimizer
        def __init__(self, inner: Any) -> None:
            self.optimizer = inner

        def posterior(self) -> None:
            return None

    vi = HoldsAPosterior(opt)
    assert lgb.posterior.unwrap(vi) is vi
    assert lgb.posterior.unwrap(vi, lgb.optim.BLROptimizer) is opt
    assert lgb.posterior.unwrap(HoldsAPosterior(None), lgb.optim.BLROptimizer) is None
