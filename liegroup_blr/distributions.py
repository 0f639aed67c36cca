"""Base distributions q0 that a Lie group pushes forward, and fast in-place samplers.

A base distribution is any scalar :class:`torch.distributions.Distribution`; its draws are
used elementwise (i.i.d. per coordinate). This module adds the two the method needs beyond
``torch.distributions`` (:class:`Rayleigh`, :class:`Dirac`), a registry of names, and
:func:`sample_into`, which fills a tensor in place from an explicit generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributions import (
    Cauchy,
    Distribution,
    Exponential,
    Laplace,
    LogNormal,
    Normal,
    StudentT,
    Uniform,
    constraints,
)
from torch.distributions.utils import broadcast_all

__all__ = [
    "NAMES",
    "Dirac",
    "Rayleigh",
    "check_base",
    "describe",
    "from_name",
    "sample_each",
    "sample_into",
    "shortest",
]

_SampleShape = torch.Size | list[int] | tuple[int, ...]
_SCALAR = torch.Size()


class Rayleigh(Distribution):
    r"""Rayleigh distribution on :math:`(0, \infty)`.

    .. math:: p(x) = \frac{x}{\sigma^2} e^{-x^2 / 2\sigma^2},
              \qquad x = \sigma\sqrt{2E},\ E \sim \mathrm{Exp}(1).

    Args:
        scale: :math:`\sigma > 0`.
    """

    arg_constraints = {"scale": constraints.positive}  # noqa: RUF012 (torch API)
    support = constraints.positive
    has_rsample = True

    def __init__(self, scale: float | Tensor = 1.0, validate_args: bool | None = None) -> None:
        (self.scale,) = broadcast_all(scale)
        super().__init__(self.scale.shape, validate_args=validate_args)

    @property
    def mean(self) -> Tensor:
        return self.scale * math.sqrt(math.pi / 2)

    @property
    def variance(self) -> Tensor:
        return self.scale**2 * (2 - math.pi / 2)

    @property
    def mode(self) -> Tensor:
        return self.scale

    def rsample(self, sample_shape: _SampleShape = _SCALAR) -> Tensor:
        shape = self._extended_shape(torch.Size(sample_shape))
        e = torch.empty(shape, dtype=self.scale.dtype, device=self.scale.device).exponential_()
        return self.scale * (2 * e).sqrt()

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        s2 = self.scale**2
        return value.log() - s2.log() - value**2 / (2 * s2)

    def cdf(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        value = value.clamp(min=0)
        return -torch.expm1(-(value**2) / (2 * self.scale**2))

    def icdf(self, value: Tensor) -> Tensor:
        return self.scale * (-2 * torch.log1p(-value)).sqrt()

    def entropy(self) -> Tensor:
        return 1 + torch.log(self.scale / math.sqrt(2)) + 0.5 * 0.5772156649015329


class Dirac(Distribution):
    """Point mass at ``value``: every draw equals ``value``.

    With the additive group it turns the learning rule into SGD with momentum. Its
    support is the single point ``[value, value]``; its log-density is 0 there and −∞
    elsewhere, so it has no Fisher information.
    """

    arg_constraints = {"value": constraints.real}  # noqa: RUF012 (torch API)
    has_rsample = True

    def __init__(self, value: float | Tensor = 0.0, validate_args: bool | None = None) -> None:
        (self.value,) = broadcast_all(value)
        super().__init__(self.value.shape, validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False, event_dim=0)
    def support(self) -> constraints.Constraint:
        return constraints.interval(self.value, self.value)

    @property
    def mean(self) -> Tensor:
        return self.value

    @property
    def mode(self) -> Tensor:
        return self.value

    @property
    def variance(self) -> Tensor:
        return torch.zeros_like(self.value)

    def rsample(self, sample_shape: _SampleShape = _SCALAR) -> Tensor:
        return self.value.expand(self._extended_shape(torch.Size(sample_shape))).clone()

    def log_prob(self, value: Tensor) -> Tensor:
        return torch.where(value == self.value, 0.0, -math.inf).to(value.dtype)


def _student_t(scale: float, df: float = 3.0) -> StudentT:
    return StudentT(df, 0.0, scale)


_REGISTRY: dict[str, Callable[..., Distribution]] = {
    "gaussian": lambda scale: Normal(0.0, scale),
    "laplace": lambda scale: Laplace(0.0, scale),
    "uniform": lambda scale: Uniform(-scale, scale),
    "student-t": _student_t,
    "rayleigh": Rayleigh,
}
NAMES: tuple[str, ...] = (*_REGISTRY, "dirac")
"""Names accepted by :func:`from_name`."""


def from_name(name: str, scale: float | None = None, **options: float) -> Distribution:
    """Build a base distribution by name.

    ``gaussian`` N(0, scale²), ``laplace`` Laplace(0, scale), ``uniform`` U(−scale, scale),
    ``student-t`` t_df(0, scale) (option ``df``, default 3), ``rayleigh`` Rayleigh(scale),
    ``dirac`` point mass at option ``value`` (default 0; takes no scale).

    Raises:
        ValueError: unknown name, non-positive scale, or a scale given to ``dirac``.
    """
    key = name.lower()
    if key == "dirac":
        if scale is not None:
            raise ValueError("scale: 'dirac' has no scale; pass value=... for its location")
        return Dirac(options.pop("value", 0.0), **options)  # type: ignore[arg-type]
    if key not in _REGISTRY:
        raise ValueError(f"name: unknown base distribution {name!r}; valid names: {NAMES}")
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    return _REGISTRY[key](scale, **options)


def _lower_bound(support: constraints.Constraint | None) -> float | None:
    """Lower end of a support constraint (``greater_than``, ``interval``, ...), if any."""
    low = getattr(support, "lower_bound", None)
    return None if low is None else float(torch.as_tensor(low).min())


def check_base(base: Distribution, positive: bool, name: str = "base") -> Distribution:
    """Validate a base distribution for a group.

    Args:
        base: a scalar distribution (``batch_shape == event_shape == ()``).
        positive: whether the group needs draws in (0, ∞) (multiplicative groups).

    Raises:
        ValueError: naming ``name`` if ``base`` is not a scalar Distribution or its
            support does not lie in (0, ∞) when ``positive``.
    """
    if not isinstance(base, Distribution):
        raise ValueError(f"{name}: expected a torch.distributions.Distribution, got {base!r}")
    if base.batch_shape != torch.Size() or base.event_shape != torch.Size():
        raise ValueError(
            f"{name}: must be a scalar distribution (drawn i.i.d. per coordinate), got "
            f"batch_shape={tuple(base.batch_shape)}, event_shape={tuple(base.event_shape)}"
        )
    if positive:
        low = _lower_bound(base.support)
        atom_at_zero = isinstance(base, Dirac) or bool(getattr(base.support, "is_discrete", 0))
        if low is None or low < 0 or (low == 0 and atom_at_zero):
            raise ValueError(
                f"{name}: the group acts by scaling and needs a base supported on (0, inf); "
                f"{type(base).__name__} has support {base.support}"
            )
    return base


def shortest(value: Tensor) -> str:
    """A one-element tensor as the shortest decimal that reads back to it in its dtype:
    ``0.005`` for float32's 0.004999999888…, ``0.33333334`` for its 1/3."""
    x = value.item()
    if not value.is_floating_point() or not math.isfinite(x):
        return repr(x)
    texts = (f"{x:.{digits}g}" for digits in range(1, 18))
    text = next(t for t in texts if torch.tensor(float(t), dtype=value.dtype).item() == x)
    return repr(float(text))


def describe(base: Distribution) -> str:
    """``repr(base)``, each one-element parameter in torch's repr as :func:`shortest`
    writes it: ``Normal(loc: 0.0, scale: 0.005)``."""
    if type(base).__repr__ is not Distribution.__repr__:
        return repr(base)
    values = vars(base)
    shown = (
        f"{k}: {shortest(v) if v.numel() == 1 else v.size()}"
        for k in base.arg_constraints
        if isinstance(v := values.get(k), Tensor)
    )
    return f"{type(base).__name__}({', '.join(shown)})"


def _work_dtype(out: Tensor) -> torch.dtype:
    return out.dtype if out.dtype in (torch.float32, torch.float64) else torch.float32


def sample_into(
    base: Distribution, out: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    """Fill ``out`` in place with i.i.d. draws of the scalar distribution ``base``
    (:func:`sample_each` of one tensor)."""
    sample_each(base, [out], generator)
    return out


def sample_each(
    base: Distribution, outs: list[Tensor], generator: torch.Generator | None = None
) -> list[Tensor]:
    """Fill each tensor of ``outs`` in place with i.i.d. draws of the scalar distribution
    ``base``, one tensor after another from ``generator``.

    Common families use torch's in-place samplers with ``generator``, one kernel and no
    allocation (Rayleigh by its inverse CDF σ√(−2 log(1 − U)), far cheaper than
    ``exponential_``); Student-t with an integer ν ≤ 32 as a normal over the root of a χ²
    built from normals and uniforms (``_student_t_into``); other families with an
    ``icdf`` transform uniforms from ``generator``; a family with neither is drawn by its own
    ``sample`` under a global RNG seeded from ``generator`` and then restored, so every draw
    is reproducible from ``generator``'s state.
    """
    if isinstance(base, Normal):
        loc, scale = float(base.loc), float(base.scale)
        for out in outs:
            out.normal_(loc, scale, generator=generator)
    elif isinstance(base, Rayleigh):  # σ√(−2 log(1 − U)), −U ~ U(eps − 1, −tiny): never 0, inf
        factor = -2 * float(base.scale) ** 2
        for out in outs:
            info = torch.finfo(out.dtype)
            out.uniform_(info.eps - 1, -info.tiny, generator=generator).log1p_()
            out.mul_(factor).sqrt_()
    elif isinstance(base, Dirac):
        for out in outs:
            out.fill_(float(base.value))
    elif isinstance(base, Uniform):
        low, high = float(base.low), float(base.high)
        for out in outs:
            out.uniform_(low, high, generator=generator)
    elif isinstance(base, Exponential):
        for out in outs:
            out.exponential_(float(base.rate), generator=generator)
    elif isinstance(base, Cauchy):
        loc, scale = float(base.loc), float(base.scale)
        for out in outs:
            out.cauchy_(loc, scale, generator=generator)
    elif isinstance(base, LogNormal):
        loc, scale = float(base.loc), float(base.scale)
        for out in outs:
            out.log_normal_(loc, scale, generator=generator)
    elif isinstance(base, StudentT) and _small_integer(base.df):
        for out in outs:
            _student_t_into(out, base, generator)
    elif isinstance(base, Laplace):  # loc − scale·sign(u)·log(1 − |u|), u ~ U(eps − 1, 1)
        loc, scale = float(base.loc), float(base.scale)
        for out in outs:
            u = out.uniform_(torch.finfo(out.dtype).eps - 1, 1, generator=generator)
            sign = u.sign()
            u.abs_().neg_().log1p_().mul_(sign)
            u.mul_(-scale).add_(loc)
    else:
        for out in outs:
            _sample_other(base, out, generator)
    return outs


# Integer degrees of freedom up to this are drawn through normals and uniforms (cost ~ ν/2
# uniform draws per element); larger or fractional ones through torch's gamma sampler.
_MAX_INTEGER_DF = 32


def _small_integer(df: Tensor) -> bool:
    value = float(df)
    return value == round(value) and 1 <= value <= _MAX_INTEGER_DF


def _student_t_into(out: Tensor, base: StudentT, generator: torch.Generator | None) -> None:
    r"""t_ν(loc, scale) for an integer ν by its definition: loc + scale·Z·√(ν / V),
    Z ~ N(0, 1) independent of V ~ χ²_ν; V = N² (odd ν) − 2 Σ_{k ≤ ν/2} log(1 − U_k)
    (χ²₂ = −2 log U), N ~ N(0, 1), U_k ~ U(0, 1 − eps); ν = 1 is Cauchy's in-place sampler.
    Z and N come from one ``normal_`` into one scratch tensor, the uniforms through ``out``
    (a scratch tensor for a half-precision ``out``).
    """
    df, loc, scale = int(base.df), float(base.loc), float(base.scale)
    if df == 1:
        out.cauchy_(loc, scale, generator=generator)
        return
    dtype = _work_dtype(out)
    normals = torch.empty((1 + df % 2, *out.shape), dtype=dtype, device=out.device)
    normals.normal_(generator=generator)
    z, chi2 = normals[0], normals[-1].square_() if df % 2 else torch.zeros_like(normals[0])
    info, uniforms = torch.finfo(dtype), out if out.dtype == dtype else torch.empty_like(z)
    for _ in range(df // 2):  # log(1 − U) in [log eps, −tiny]: never 0, never −inf
        chi2.sub_(
            uniforms.uniform_(info.eps - 1, -info.tiny, generator=generator).log1p_(), alpha=2
        )
    out.copy_(z.mul_(chi2.div_(df).rsqrt_()).mul_(scale).add_(loc))


def _sample_other(base: Distribution, out: Tensor, generator: torch.Generator | None) -> None:
    """A family without an in-place sampler: by its ``icdf``, else by its own ``sample``."""
    dtype = _work_dtype(out)
    try:
        u = torch.empty(out.shape, dtype=dtype, device=out.device)
        u.uniform_(torch.finfo(dtype).tiny, 1.0, generator=generator)
        out.copy_(base.icdf(u))
        return
    except NotImplementedError:
        pass
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=out.device).item())
    with torch.random.fork_rng(devices=[]):  # CPU state only: seed just the CPU generator
        torch.default_generator.manual_seed(seed)
        out.copy_(base.sample(out.shape))
