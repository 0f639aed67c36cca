"""Base distributions: Rayleigh and Dirac, the registry of names, ``check_base``, ``sample_into``.

Oracles: ``scipy.stats`` (moments, densities, quantiles, entropy) and hand formulas.
Monte-Carlo checks draw N = 200 000 float64 values from fixed seeds and accept an estimate
within 5 standard errors, where the standard error is computed from the same draws:
mean sd/√N, variance √((m₄ − m₂²)/N), p-quantile √(p(1−p)/N)/f(q_p).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import scipy.stats
import torch
from torch import Tensor
from torch.distributions import (
    Cauchy,
    Distribution,
    Exponential,
    Gamma,
    HalfNormal,
    Laplace,
    LogNormal,
    MultivariateNormal,
    Normal,
    StudentT,
    Uniform,
    constraints,
)

import liegroup_blr as lgb
from liegroup_blr.distributions import (
    NAMES,
    Dirac,
    Rayleigh,
    check_base,
    describe,
    from_name,
    sample_into,
    shortest,
)

F64 = torch.float64
N = 100_000
Z = 5.0  # accept |estimate − truth| < Z · SE


@pytest.fixture
def float64_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# ------------------------------------------------------------------ MC helpers
def check_mean(x: Tensor, truth: float) -> None:
    se = float(x.std()) / math.sqrt(x.numel())
    assert abs(float(x.mean()) - truth) < Z * se, (float(x.mean()), truth, se)


def check_variance(x: Tensor, truth: float) -> None:
    c = x - x.mean()
    m2, m4 = float((c**2).mean()), float((c**4).mean())
    se = math.sqrt((m4 - m2**2) / x.numel())
    assert abs(m2 - truth) < Z * se, (m2, truth, se)


def check_quantiles(x: Tensor, ref: scipy.stats.rv_continuous, ps: tuple[float, ...]) -> None:
    for p in ps:
        q = float(ref.ppf(p))
        se = math.sqrt(p * (1 - p) / x.numel()) / float(ref.pdf(q))
        estimate = float(torch.quantile(x, p))
        assert abs(estimate - q) < Z * se, (p, estimate, q, se)


# ------------------------------------------------------------------ Rayleigh
SCALES = [0.5, 1.0, 2.5]


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("sigma", SCALES)
def test_rayleigh_matches_scipy(sigma: float) -> None:
    d, ref = Rayleigh(sigma), scipy.stats.rayleigh(scale=sigma)
    assert d.scale.dtype == F64
    assert float(d.mean) == pytest.approx(ref.mean(), rel=1e-13)
    assert float(d.variance) == pytest.approx(ref.var(), rel=1e-13)
    assert float(d.stddev) == pytest.approx(ref.std(), rel=1e-13)
    assert float(d.entropy()) == pytest.approx(ref.entropy(), rel=1e-12)
    assert float(d.mode) == sigma  # argmax of x e^{−x²/2σ²}
    x = np.array([1e-3, 0.1, 0.5, 1.0, 2.0, 4.0, 9.0]) * sigma
    xt = torch.as_tensor(x)
    np.testing.assert_allclose(d.log_prob(xt).numpy(), ref.logpdf(x), rtol=1e-12)
    np.testing.assert_allclose(d.cdf(xt).numpy(), ref.cdf(x), rtol=1e-12)
    p = np.array([1e-12, 1e-6, 0.1, 0.5, 0.9, 1 - 1e-9])
    np.testing.assert_allclose(d.icdf(torch.as_tensor(p)).numpy(), ref.ppf(p), rtol=1e-9)


def test_rayleigh_in_default_float32() -> None:
    d, ref = Rayleigh(2.5), scipy.stats.rayleigh(scale=2.5)
    assert d.scale.dtype == torch.get_default_dtype() == torch.float32
    x = torch.tensor([0.1, 1.0, 3.0, 7.0])
    lp = d.log_prob(x)
    assert lp.dtype == torch.float32
    # float32: a few ulp (1.2e-7) of each term
    np.testing.assert_allclose(lp.numpy(), ref.logpdf(x.numpy()), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d.cdf(x).numpy(), ref.cdf(x.numpy()), rtol=1e-5)
    assert float(d.entropy()) == pytest.approx(ref.entropy(), rel=1e-6)


@pytest.mark.parametrize("sigma", SCALES)
def test_rayleigh_rsample_moments_and_law(sigma: float) -> None:
    torch.manual_seed(0)
    x = Rayleigh(torch.tensor(sigma)).rsample((N,)).to(F64)
    ref = scipy.stats.rayleigh(scale=sigma)
    assert x.shape == (N,) and bool((x > 0).all())
    check_mean(x, ref.mean())
    check_variance(x, ref.var())
    check_quantiles(x, ref, (0.1, 0.5, 0.9))
    # Kolmogorov–Smirnov against scipy's cdf: false-alarm probability 1e-4 per fixed seed.
    assert scipy.stats.kstest(x.numpy(), ref.cdf).pvalue > 1e-4


def test_rayleigh_rsample_is_reparameterised() -> None:
    scale = torch.tensor(1.5, dtype=F64, requires_grad=True)
    d = Rayleigh(scale)
    x = d.rsample((64,))
    x.sum().backward()
    # x = σ·√(2E): ∂x/∂σ = x/σ
    assert scale.grad is not None
    assert float(scale.grad) == pytest.approx(float((x.detach() / 1.5).sum()), rel=1e-12)


def test_rayleigh_shapes_and_validation() -> None:
    assert Rayleigh(1.0).sample((2, 3)).shape == (2, 3)
    batch = Rayleigh(torch.tensor([1.0, 2.0]))
    assert batch.batch_shape == (2,) and batch.sample((5,)).shape == (5, 2)
    assert Rayleigh(1.0).support is constraints.positive
    assert Rayleigh.has_rsample
    with pytest.raises(ValueError):
        Rayleigh(-1.0, validate_args=True)
    with pytest.raises(ValueError):
        Rayleigh(0.0, validate_args=True)
    with pytest.raises(ValueError):
        Rayleigh(1.0, validate_args=True).log_prob(torch.tensor(-1.0))


@pytest.mark.parametrize("x", [-1.0, -1e-3])
def test_rayleigh_cdf_outside_support(x: float) -> None:
    """P(X ≤ x) = 0 for x < 0 (scipy agrees); raising under validation is also acceptable."""
    assert scipy.stats.rayleigh.cdf(x) == 0.0
    d = Rayleigh(1.0, validate_args=True)
    try:
        value = float(d.cdf(torch.tensor(x)))
    except ValueError:
        return
    assert value == 0.0


# ------------------------------------------------------------------ Dirac
@pytest.mark.parametrize("value", [0.0, 1.5, -2.25])
def test_dirac(value: float) -> None:
    d = Dirac(value)
    for draw in (d.sample((3, 4)), d.rsample((3, 4)), d.sample()):
        assert bool((draw == value).all())
    assert d.sample((3, 4)).shape == (3, 4) and d.sample().shape == ()
    assert float(d.mean) == value and float(d.mode) == value and float(d.variance) == 0
    lp = d.log_prob(torch.tensor([value, value + 0.5, value - 1e-3]))
    assert lp[0] == 0 and lp[1] == -math.inf and lp[2] == -math.inf
    assert bool(d.support.check(torch.tensor(value)))
    assert not bool(d.support.check(torch.tensor(value + 0.5)))


def test_dirac_rsample_is_a_fresh_tensor() -> None:
    d = Dirac(2.0)
    x = d.rsample((3,))
    x.add_(1.0)  # must not write into the distribution's value
    assert float(d.value) == 2.0 and bool((d.rsample((3,)) == 2.0).all())


def test_dirac_float64_value_has_log_prob_zero_at_itself() -> None:
    """A float64 Dirac at 0.1 is a point mass at the float64 number 0.1."""
    value = torch.tensor(0.1, dtype=F64)
    d = Dirac(value)
    assert float(d.log_prob(value)) == 0.0
    assert bool((d.sample((4,)) == value).all())


@pytest.mark.parametrize("family", [Dirac, Rayleigh])
def test_tensor_parameters_keep_their_dtype(family: Callable[[Tensor], Distribution]) -> None:
    """Like torch.distributions (Normal(loc, scale) keeps float64 tensors), not the default."""
    param = torch.tensor(0.1, dtype=F64)
    assert Normal(param, param).scale.dtype == F64  # the reference behaviour
    d = family(param)
    assert d.mean.dtype == F64
    factor = math.sqrt(math.pi / 2) if family is Rayleigh else 1.0
    # float32 storage of 0.1 would be off by 1.5e-9 relative
    assert float(d.mean) == pytest.approx(0.1 * factor, rel=1e-14)


# ------------------------------------------------------------------ registry
def _var(d: Distribution) -> float:
    return float(d.variance)


FROM_NAME_CHECKS: dict[str, Callable[[Distribution, float], None]] = {}


def _check(name: str) -> Callable[[Callable[[Distribution, float], None]], None]:
    def register(fn: Callable[[Distribution, float], None]) -> None:
        FROM_NAME_CHECKS[name] = fn

    return register


@_check("gaussian")
def _gaussian(d: Distribution, s: float) -> None:
    assert isinstance(d, Normal) and float(d.loc) == 0
    assert _var(d) == pytest.approx(scipy.stats.norm(0, s).var(), rel=1e-6)


@_check("laplace")
def _laplace(d: Distribution, s: float) -> None:
    assert isinstance(d, Laplace) and float(d.loc) == 0
    assert _var(d) == pytest.approx(scipy.stats.laplace(0, s).var(), rel=1e-6)


@_check("uniform")
def _uniform(d: Distribution, s: float) -> None:
    assert isinstance(d, Uniform)
    assert float(d.low) == pytest.approx(-s) and float(d.high) == pytest.approx(s)
    assert _var(d) == pytest.approx(scipy.stats.uniform(-s, 2 * s).var(), rel=1e-6)


@_check("student-t")
def _student_t(d: Distribution, s: float) -> None:
    assert isinstance(d, StudentT) and float(d.loc) == 0 and float(d.df) == 3
    assert float(d.scale) == pytest.approx(s)
    assert _var(d) == pytest.approx(scipy.stats.t(3, 0, s).var(), rel=1e-6)


@_check("rayleigh")
def _rayleigh(d: Distribution, s: float) -> None:
    assert isinstance(d, Rayleigh)
    assert float(d.mean) == pytest.approx(scipy.stats.rayleigh(scale=s).mean(), rel=1e-6)
    assert _var(d) == pytest.approx(scipy.stats.rayleigh(scale=s).var(), rel=1e-6)


def test_registry_checks_cover_all_names() -> None:
    assert set(NAMES) == {*FROM_NAME_CHECKS, "dirac"}


@pytest.mark.parametrize("name", [n for n in NAMES if n != "dirac"])
@pytest.mark.parametrize("scale", [None, 0.25, 3.0])
def test_from_name_builds_family_with_scale(name: str, scale: float | None) -> None:
    d = from_name(name, scale)
    FROM_NAME_CHECKS[name](d, 1.0 if scale is None else scale)
    assert d.batch_shape == () and d.event_shape == ()
    # names are case-insensitive
    FROM_NAME_CHECKS[name](from_name(name.upper(), scale), 1.0 if scale is None else scale)


def test_from_name_options() -> None:
    t = from_name("student-t", 2.0, df=5.0)
    assert isinstance(t, StudentT) and float(t.df) == 5
    assert float(t.variance) == pytest.approx(scipy.stats.t(5, 0, 2.0).var(), rel=1e-6)
    d = from_name("dirac")
    assert isinstance(d, Dirac) and float(d.value) == 0
    d = from_name("dirac", value=1.5)
    assert isinstance(d, Dirac) and bool((d.sample((3,)) == 1.5).all())


def test_from_name_rejects_unknown_names() -> None:
    with pytest.raises(ValueError) as err:
        from_name("gausian", 1.0)
    message = str(err.value)
    assert "gausian" in message
    for name in NAMES:
        assert name in message


def test_from_name_dirac_takes_no_scale() -> None:
    with pytest.raises(ValueError, match="scale"):
        from_name("dirac", 1.0)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "dirac"])
@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, -math.inf])
def test_from_name_rejects_non_positive_scale(name: str, scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        from_name(name, scale)


# ------------------------------------------------------------------ printing
@pytest.mark.parametrize("value", [0.005, 1 / 3, 0.1, 1e-30, 3e20, 2.0**-149, 0.0, -7.25])
def test_shortest_is_the_shortest_decimal_that_reads_back(value: float) -> None:
    """Oracle: numpy's shortest round-trip decimals of float32 and float64; bfloat16 reads
    back."""
    assert float(shortest(torch.tensor(value))) == float(str(np.float32(value)))
    assert shortest(torch.tensor(value, dtype=F64)) == repr(value)
    half = torch.tensor(value, dtype=torch.bfloat16)
    assert torch.tensor(float(shortest(half)), dtype=torch.bfloat16) == half


def test_a_float32_base_prints_its_shortest_decimals_and_keeps_its_values() -> None:
    """Issue 50, item 9: torch prints float32's 0.005 as 0.004999999888241291."""
    base = Normal(0.0, 0.005)
    assert describe(base) == "Normal(loc: 0.0, scale: 0.005)"
    assert base.scale.item() == torch.tensor(0.005).item()  # the value is float32's, unchanged
    assert describe(Normal(0.0, 1 / 3)) == "Normal(loc: 0.0, scale: 0.33333334)"
    assert float(shortest(torch.tensor(1 / 3))) != 1 / 3  # float32's 1/3, not float64's
    assert describe(Normal(torch.zeros(3), 1.0)) == repr(Normal(torch.zeros(3), 1.0))
    p = torch.nn.Parameter(torch.zeros(2))
    opt = lgb.AffineBLR([p], lr=1e-3, scale_lr=1e-5, data_size=60_000)  # the reference's base
    assert "    base: Normal(loc: 0.0, scale: 0.005)\n" in repr(opt)
    torch_repr = torch.optim.Optimizer.__repr__(opt)
    assert torch_repr.replace(f"scale: {torch.tensor(0.005).item()}", "scale: 0.005") == repr(opt)


# ------------------------------------------------------------------ check_base
REJECTED_FOR_POSITIVE = {
    "normal": lambda: Normal(0.0, 1.0),
    "laplace": lambda: Laplace(0.0, 1.0),
    "uniform(-1,1)": lambda: Uniform(-1.0, 1.0),
    "dirac(0)": lambda: Dirac(0.0),
    "dirac(-1)": lambda: Dirac(-1.0),
    "student-t": lambda: StudentT(3.0),
    "cauchy": lambda: Cauchy(0.0, 1.0),
}
ACCEPTED_FOR_POSITIVE = {
    "rayleigh": lambda: Rayleigh(1.0),
    "dirac(1)": lambda: Dirac(1.0),
    "uniform(0.5,2)": lambda: Uniform(0.5, 2.0),
    "lognormal": lambda: LogNormal(0.0, 1.0),
    "exponential": lambda: Exponential(1.0),
    "gamma": lambda: Gamma(2.0, 1.0),
    "halfnormal": lambda: HalfNormal(1.0),
}


@pytest.mark.parametrize("key", list(REJECTED_FOR_POSITIVE))
@pytest.mark.parametrize("arg", ["base", "prior_noise"])
def test_check_base_rejects_non_positive_support(key: str, arg: str) -> None:
    base = REJECTED_FOR_POSITIVE[key]()
    with pytest.raises(ValueError, match=arg):
        check_base(base, positive=True, name=arg)
    assert check_base(base, positive=False) is base


@pytest.mark.parametrize("key", list(ACCEPTED_FOR_POSITIVE))
def test_check_base_accepts_positive_support(key: str) -> None:
    base = ACCEPTED_FOR_POSITIVE[key]()
    assert check_base(base, positive=True) is base
    assert check_base(base, positive=False) is base


@pytest.mark.parametrize(
    "base",
    [
        Normal(torch.zeros(3), 1.0),
        Rayleigh(torch.ones(2)),
        MultivariateNormal(torch.zeros(2), torch.eye(2)),
        "gaussian",
        1.0,
    ],
    ids=["batched-normal", "batched-rayleigh", "mvn", "string", "float"],
)
@pytest.mark.parametrize("positive", [False, True])
def test_check_base_rejects_non_scalar_distributions(base: object, positive: bool) -> None:
    with pytest.raises(ValueError, match="base"):
        check_base(base, positive=positive)  # type: ignore[arg-type]


# ------------------------------------------------------------------ sample_into
# (family, scipy oracle, whether mean and variance are finite and checked)
FAMILIES: dict[str, tuple[Callable[[], Distribution], scipy.stats.rv_continuous, bool]] = {
    "normal": (lambda: Normal(0.5, 2.0), scipy.stats.norm(0.5, 2.0), True),
    "rayleigh": (lambda: Rayleigh(1.5), scipy.stats.rayleigh(scale=1.5), True),
    "uniform": (lambda: Uniform(-0.5, 2.0), scipy.stats.uniform(-0.5, 2.5), True),
    "laplace": (lambda: Laplace(0.25, 1.5), scipy.stats.laplace(0.25, 1.5), True),
    "exponential": (lambda: Exponential(2.0), scipy.stats.expon(scale=0.5), True),
    "cauchy": (lambda: Cauchy(0.5, 2.0), scipy.stats.cauchy(0.5, 2.0), False),
    "lognormal": (
        lambda: LogNormal(0.25, 0.5),
        scipy.stats.lognorm(s=0.5, scale=math.exp(0.25)),
        True,
    ),
    # an integer ν: a normal over the root of a χ² made of normals and uniforms
    "student-t": (lambda: StudentT(5.0, 0.5, 2.0), scipy.stats.t(5.0, 0.5, 2.0), True),
    # a fractional ν, no icdf: falls back to base.sample under a seeded global RNG
    "student-t-2.5": (lambda: StudentT(2.5, 0.5, 2.0), scipy.stats.t(2.5, 0.5, 2.0), False),
    "gamma": (lambda: Gamma(2.0, 4.0), scipy.stats.gamma(2.0, scale=0.25), True),
    # has an icdf but no in-place torch sampler: the inverse-CDF path
    "halfnormal": (lambda: HalfNormal(1.5), scipy.stats.halfnorm(scale=1.5), True),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("key", list(FAMILIES))
def test_sample_into_law(key: str) -> None:
    make, ref, moments = FAMILIES[key]
    out = torch.empty(N, dtype=F64)
    x = sample_into(make(), out, _gen(1234))
    assert bool(torch.isfinite(x).all())
    if moments:
        check_mean(x, float(ref.mean()))
        check_variance(x, float(ref.var()))
    check_quantiles(x, ref, (0.1, 0.25, 0.5, 0.75, 0.9))
    # Kolmogorov–Smirnov: false-alarm probability 1e-4 for this fixed seed.
    assert scipy.stats.kstest(x.numpy(), ref.cdf).pvalue > 1e-4


@pytest.mark.parametrize("key", list(FAMILIES))
def test_sample_into_support(key: str) -> None:
    make, ref, _ = FAMILIES[key]
    x = sample_into(make(), torch.empty(N, dtype=F64), _gen(5))
    low, high = ref.support()
    assert float(x.min()) >= low and float(x.max()) <= high


def test_sample_into_lognormal_log_moments() -> None:
    x = sample_into(LogNormal(0.25, 0.5), torch.empty(N, dtype=F64), _gen(99))
    check_mean(x.log(), 0.25)
    check_variance(x.log(), 0.25)


ALL_FAMILIES = {**{k: v[0] for k, v in FAMILIES.items()}, "dirac": lambda: Dirac(1.25)}


@pytest.mark.parametrize("key", list(ALL_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sample_into_in_place_reproducible_and_private(key: str, dtype: torch.dtype) -> None:
    base = ALL_FAMILIES[key]()
    torch.manual_seed(2024)
    global_state = torch.get_rng_state()

    out = torch.empty(40, 25, dtype=dtype)
    ptr = out.data_ptr()
    gen = _gen(7)
    result = sample_into(base, out, gen)
    assert result.data_ptr() == ptr and result.shape == (40, 25) and result.dtype == dtype
    assert torch.equal(result, out)
    first = out.clone()
    # the same seed reproduces the draw ...
    again = sample_into(base, torch.empty(40, 25, dtype=dtype), _gen(7))
    assert torch.equal(again, first)
    # ... and so does restoring the generator's state
    state = gen.get_state()
    second = sample_into(base, torch.empty(40, 25, dtype=dtype), gen).clone()
    gen.set_state(state)
    assert torch.equal(sample_into(base, torch.empty(40, 25, dtype=dtype), gen), second)
    if key == "dirac":
        assert bool((first == 1.25).all())
    else:
        assert not torch.equal(first, second)  # the generator advanced
    # torch's global RNG was neither used nor reseeded
    assert torch.equal(torch.get_rng_state(), global_state)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 32])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_student_t_integer_df_law_on_a_million_draws(df: int, dtype: torch.dtype) -> None:
    """Goodness of fit of the χ² construction (every parity of ν, Cauchy's ν = 1, the
    largest ν it serves) on 10⁶ draws: Kolmogorov–Smirnov and the tails' frequencies."""
    x = sample_into(StudentT(float(df), 0.25, 0.5), torch.empty(10**6, dtype=dtype), _gen(df))
    assert x.dtype == dtype and bool(torch.isfinite(x).all())
    ref = scipy.stats.t(df, 0.25, 0.5)
    assert scipy.stats.kstest(x.double().numpy(), ref.cdf).pvalue > 1e-4
    for q in (1e-3, 1e-2, 0.99, 0.999):  # binomial standard errors: sqrt(q(1 - q) / 10⁶)
        frequency = float((x.double() <= ref.ppf(q)).double().mean())
        assert abs(frequency - q) < 5 * math.sqrt(q * (1 - q) / 10**6)


def test_student_t_draws_into_half_and_channels_last_tensors() -> None:
    """A half-precision or NHWC ``out`` gets the same law (drawn in float32, no rounding of
    the uniforms to half precision: a log(0) would put a zero or an inf among the draws)."""
    half = sample_into(StudentT(3.0), torch.empty(2**18, dtype=torch.float16), _gen(3))
    assert bool(torch.isfinite(half).all()) and bool((half != 0).all())
    assert scipy.stats.kstest(half.double().numpy(), scipy.stats.t(3).cdf).pvalue > 1e-4
    nhwc = torch.empty(64, 32, 8, 8).contiguous(memory_format=torch.channels_last)
    sample_into(StudentT(3.0), nhwc, _gen(4))
    assert nhwc.is_contiguous(memory_format=torch.channels_last)
    assert scipy.stats.kstest(nhwc.double().flatten().numpy(), scipy.stats.t(3).cdf).pvalue > 1e-4


@pytest.mark.parametrize("key", ["student-t", "student-t-2.5", "gamma", "normal", "halfnormal"])
def test_sample_into_without_generator_uses_global_rng(key: str) -> None:
    base = ALL_FAMILIES[key]()
    torch.manual_seed(31)
    a = sample_into(base, torch.empty(100, dtype=F64)).clone()
    b = sample_into(base, torch.empty(100, dtype=F64)).clone()
    torch.manual_seed(31)
    assert torch.equal(sample_into(base, torch.empty(100, dtype=F64)), a)
    assert not torch.equal(a, b)


def test_sample_into_icdf_path_keeps_float64_resolution() -> None:
    """Float64 draws through the inverse CDF must not be quantised to float32.

    If the uniforms are rounded to float32 before the icdf, every draw is float32-representable,
    and a uniform in [1 − 2⁻²⁵, 1) rounds to 1.0, where an unbounded icdf returns inf
    (probability 3e-8 per draw: most steps of a model with 10⁸ parameters).
    """
    x = sample_into(HalfNormal(1.0), torch.empty(10_000, dtype=F64), _gen(0))
    representable = x == x.to(torch.float32).to(F64)
    assert float(representable.to(F64).mean()) < 0.01
