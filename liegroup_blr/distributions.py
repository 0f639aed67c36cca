"""Base distributions q0 that a Lie group pushes forward, and fast in-place samplers.

A base distribution is any scalar :class:`torch.distributions.Distribution`; its draws are
used elementwise (i.i.d. per coordinate). This module adds the two the method needs beyond
``torch.distributions`` (:class:`Rayleigh`, :class:`Dirac`), the one registry of what the
library knows of a family (:class:`BaseFamily`, :func:`register_base`: its in-place sampler,
Fisher informations, centre, KL, the parameters a file stores and the name
:func:`from_name` builds it by), and :func:`sample_into`, which fills a tensor in place from
an explicit generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    "BaseFamily",
    "Dirac",
    "Rayleigh",
    "base_family",
    "check_base",
    "describe",
    "fisher_information",
    "from_name",
    "has_density",
    "positive_support",
    "register_base",
    "registered",
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
    family = next((f for f in _FAMILIES.values() if f.name == key), None)
    if family is None or family.build is None:
        raise ValueError(f"name: unknown base distribution {name!r}; valid names: {NAMES}")
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    return family.build(scale, **options)


def _lower_bound(support: constraints.Constraint | None) -> float | None:
    """Lower end of a support constraint (``greater_than``, ``interval``, ...), if any."""
    low = getattr(support, "lower_bound", None)
    return None if low is None else float(torch.as_tensor(low).min())


def positive_support(base: Distribution) -> bool:
    """Whether ``base`` draws only from (0, ∞) (what a group acting by scaling needs)."""
    low = _lower_bound(base.support)
    atom_at_zero = not has_density(base) or bool(getattr(base.support, "is_discrete", 0))
    return low is not None and low >= 0 and not (low == 0 and atom_at_zero)


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
    if positive and not positive_support(base):
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
    ``base``, one tensor after another from ``generator``, by its family's ``fill``
    (:func:`base_family`).

    The built-in families use torch's in-place samplers with ``generator``, one kernel and no
    allocation (Rayleigh by its inverse CDF σ√(−2 log(1 − U)), far cheaper than
    ``exponential_``); Student-t with an integer ν ≤ 32 as a normal over the root of a χ²
    built from normals and uniforms (``_student_t_into``); other families with an
    ``icdf`` transform uniforms from ``generator``; a family with neither is drawn by its own
    ``sample`` under a global RNG seeded from ``generator`` and then restored, so every draw
    is reproducible from ``generator``'s state.
    """
    kind = type(base)
    family = _NEAREST[kind] if kind in _NEAREST else base_family(base)  # a step's one lookup
    fill = _fill_other if family is None or family.fill is None else family.fill
    fill(base, outs, generator)
    return outs


def _fill_normal(base: Normal, outs: list[Tensor], generator: torch.Generator | None) -> None:
    loc, scale = float(base.loc), float(base.scale)
    for out in outs:
        out.normal_(loc, scale, generator=generator)


def _fill_rayleigh(base: Rayleigh, outs: list[Tensor], generator: torch.Generator | None) -> None:
    """σ√(−2 log(1 − U)), −U ~ U(eps − 1, −tiny): never 0, never inf."""
    factor = -2 * float(base.scale) ** 2
    for out in outs:
        info = torch.finfo(out.dtype)
        out.uniform_(info.eps - 1, -info.tiny, generator=generator).log1p_()
        out.mul_(factor).sqrt_()


def _fill_dirac(base: Dirac, outs: list[Tensor], generator: torch.Generator | None) -> None:
    for out in outs:
        out.fill_(float(base.value))


def _fill_uniform(base: Uniform, outs: list[Tensor], generator: torch.Generator | None) -> None:
    low, high = float(base.low), float(base.high)
    for out in outs:
        out.uniform_(low, high, generator=generator)


def _fill_exponential(
    base: Exponential, outs: list[Tensor], generator: torch.Generator | None
) -> None:
    for out in outs:
        out.exponential_(float(base.rate), generator=generator)


def _fill_loc_scale(
    sampler: str,
) -> Callable[[Cauchy | LogNormal, list[Tensor], torch.Generator | None], None]:
    """The in-place sampler of a ``(loc, scale)`` family by the ``Tensor`` method ``sampler``
    (``"cauchy_"``, ``"log_normal_"``)."""

    def fill(
        base: Cauchy | LogNormal, outs: list[Tensor], generator: torch.Generator | None
    ) -> None:
        loc, scale = float(base.loc), float(base.scale)
        for out in outs:
            getattr(out, sampler)(loc, scale, generator=generator)

    return fill


def _fill_student_t(base: StudentT, outs: list[Tensor], generator: torch.Generator | None) -> None:
    fill = _student_t_into if _small_integer(base.df) else _sample_other
    for out in outs:
        fill(out, base, generator)


def _fill_laplace(base: Laplace, outs: list[Tensor], generator: torch.Generator | None) -> None:
    """loc − scale·sign(u)·log(1 − |u|), u ~ U(eps − 1, 1)."""
    loc, scale = float(base.loc), float(base.scale)
    for out in outs:
        u = out.uniform_(torch.finfo(out.dtype).eps - 1, 1, generator=generator)
        sign = u.sign()
        u.abs_().neg_().log1p_().mul_(sign)
        u.mul_(-scale).add_(loc)


def _fill_other(base: Distribution, outs: list[Tensor], generator: torch.Generator | None) -> None:
    for out in outs:
        _sample_other(out, base, generator)


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


def _sample_other(out: Tensor, base: Distribution, generator: torch.Generator | None) -> None:
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


# ----------------------------------------------------------------------- families
FillFn = Callable[[Distribution, list[Tensor], "torch.Generator | None"], None]
"""``fill(base, outs, generator)``: each tensor of ``outs`` filled in place with draws."""
KLFn = Callable[[Distribution, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""``kl(base, d, log_ratio, scale, scale_h)`` → (KL, ∂KL/∂ log-scale, ∂KL/∂ location)."""


@dataclass(frozen=True)
class BaseFamily:
    r"""What the library knows of a family of scalar base distributions, registered once per
    class with :func:`register_base`. Every field but ``params`` is optional; without it the
    generic path runs (Monte Carlo, ``icdf``, a base passed at load).

    Attributes:
        params: the constructor's arguments, each an attribute holding a tensor: a posterior
            file stores them and rebuilds the base by its class name.
        fill: ``fill(base, outs, generator)`` fills each tensor of ``outs`` in place with
            i.i.d. draws from ``generator`` (default: the ``icdf`` of uniforms, else the
            family's own ``sample``).
        location_fisher: :math:`E[(\partial_\xi \log p(\xi))^2]`, the Fisher information of
            its location family, or None where it has no closed form for this base.
        scale_fisher: :math:`E[(\xi\,\partial_\xi \log p(\xi) + 1)^2]`, that of its scale
            family at scale 1, or None.
        centre: the centre c of a symmetric base (2c − ξ has its law), for antithetic draws.
        location_scale_kl: per coordinate, the KL between the family at location difference
            ``d`` and scales ``scale``, ``scale_h`` (``log_ratio`` their log ratio), with its
            derivatives in the log-scale (entropy included) and in the location.
        scale_kl: ``scale_kl(log_ratio)`` → (KL, its derivative) between the family at two
            scales: a scale family whose KL does not depend on its scale.
        density: False for a base without a density (a point mass): no Fisher metric, no KL.
        name: the name :func:`from_name` builds it by, with ``build(scale, **options)``.
    """

    params: tuple[str, ...]
    fill: FillFn | None = None
    location_fisher: Callable[[Distribution], float | None] | None = None
    scale_fisher: Callable[[Distribution], float | None] | None = None
    centre: Callable[[Distribution], float] | None = None
    location_scale_kl: KLFn | None = None
    scale_kl: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
    density: bool = True
    name: str | None = None
    build: Callable[..., Distribution] | None = None


_FAMILIES: dict[type[Distribution], BaseFamily] = {}
_NEAREST: dict[type[Distribution], BaseFamily | None] = {}
"""Each class's nearest registered family, found once (cleared by :func:`register_base`)."""


def register_base(cls: type[Distribution], params: tuple[str, ...], **facts: Any) -> BaseFamily:
    """Register what the library knows of the base distributions of class ``cls``: the
    fields of :class:`BaseFamily` (``params`` and any of the others as keywords). A posterior
    file then stores a ``cls`` base by its parameters and loads it by the class name, and
    sampling, the Fisher metric and the KL use the facts given. Registering a class again
    replaces its entry.

    Raises:
        ValueError: ``cls`` is not a Distribution subclass, ``params`` names no attribute,
            or another registered class has the same name (a file names bases by class name).
    """
    if not (isinstance(cls, type) and issubclass(cls, Distribution)):
        raise ValueError(f"cls: expected a torch.distributions.Distribution subclass, got {cls!r}")
    params = tuple(params)
    if not params or not all(isinstance(p, str) and p for p in params):
        raise ValueError(f"params: the constructor arguments by name, got {params!r}")
    clash = next((c for c in _FAMILIES if c.__name__ == cls.__name__ and c is not cls), None)
    if clash is not None:
        raise ValueError(
            f"cls: {clash.__module__}.{clash.__qualname__} is registered under the name "
            f"{cls.__name__!r} already; a posterior file names bases by class name, so rename one"
        )
    if facts.get("name"):
        facts["name"] = str(facts["name"]).lower()  # from_name matches lowercase names
    family = BaseFamily(params, **facts)
    _FAMILIES[cls] = family
    _NEAREST.clear()
    return family


def base_family(base: Distribution, exact: bool = False) -> BaseFamily | None:
    """The registered :class:`BaseFamily` of ``base``: its class's or, unless ``exact``, its
    nearest registered ancestor's (a subclass keeps its parent's sampler and Fisher
    information; a file and a closed-form KL need the class itself, which may change the
    density)."""
    kind = type(base)
    if exact:
        return _FAMILIES.get(kind)
    if kind not in _NEAREST:
        _NEAREST[kind] = next((_FAMILIES[c] for c in kind.__mro__ if c in _FAMILIES), None)
    return _NEAREST[kind]


def registered(name: str) -> type[Distribution] | None:
    """The registered base class named ``name``, if any."""
    return next((cls for cls in _FAMILIES if cls.__name__ == name), None)


def fisher_information(base: Distribution) -> tuple[float | None, float | None]:
    """The Fisher informations of ``base``'s location family and of its scale family at
    scale 1 (:class:`BaseFamily`), each None where its family gives no closed form."""
    family = base_family(base)
    if family is None:
        return None, None
    location = None if family.location_fisher is None else family.location_fisher(base)
    scale = None if family.scale_fisher is None else family.scale_fisher(base)
    return location, scale


def has_density(base: Distribution) -> bool:
    """Whether ``base`` has a density (False for a point mass such as :class:`Dirac`)."""
    family = base_family(base)
    return family is None or family.density


def _centred(base: Distribution, value: float) -> float | None:
    return value if float(base.loc) == 0 else None  # type: ignore[attr-defined]


def _student_t_location(base: StudentT) -> float | None:
    df, s = float(base.df), float(base.scale)
    return _centred(base, (df + 1) / ((df + 3) * s**2))


def _student_t_scale(base: StudentT) -> float | None:
    df = float(base.df)
    return _centred(base, 2 * df / (df + 3))


def _normal_kl(
    base: Normal, loc: Tensor, log_ratio: Tensor, scale: Tensor, scale_h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r""":math:`(r^2 - 1)/2 - \log r + d^2/2\sigma_h^2`, ``r = exp(log_ratio)``."""
    sigma_h = scale_h * float(base.scale)
    kl = torch.expm1(2 * log_ratio) / 2 - log_ratio + loc**2 / (2 * sigma_h**2)
    return kl, torch.expm1(2 * log_ratio), loc / sigma_h**2


def _laplace_kl(
    base: Laplace, loc: Tensor, log_ratio: Tensor, scale: Tensor, scale_h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r""":math:`|d|/s_h + r e^{-a} - 1 - \log r`, :math:`a = |d|/s`."""
    s, s_h = scale * float(base.scale), scale_h * float(base.scale)
    a = loc.abs() / s
    kl = loc.abs() / s_h + torch.expm1(log_ratio - a) - log_ratio
    d_log_scale = torch.expm1(log_ratio - a + torch.log1p(a))
    return kl, d_log_scale, loc.sign() * -torch.expm1(-a) / s_h


def _rayleigh_kl(log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """:math:`r^2 - 1 - 2\\log r` and its derivative :math:`2(r^2 - 1)` in log r."""
    return torch.expm1(2 * log_ratio) - 2 * log_ratio, 2 * torch.expm1(2 * log_ratio)


def _loc(base: Distribution) -> float:
    return float(base.loc)  # type: ignore[attr-defined]


def _student_t(scale: float, df: float = 3.0) -> StudentT:
    return StudentT(df, 0.0, scale)


def _register_location_scale(
    cls: type[Normal] | type[Laplace], fill: Any, scale_fisher: float, kl: Any, name: str
) -> None:
    """Register a location-scale family of the library (``cls(loc, scale)``): the location's
    Fisher information 1/scale², the log-scale's ``scale_fisher`` where centred, its closed
    form KL ``kl``; built from a name as ``cls(0, scale)``."""
    register_base(
        cls,
        ("loc", "scale"),
        fill=fill,
        location_fisher=lambda b: 1 / float(b.scale) ** 2,
        scale_fisher=lambda b: _centred(b, scale_fisher),
        centre=_loc,
        location_scale_kl=kl,
        name=name,
        build=lambda scale: cls(0.0, scale),
    )


_register_location_scale(Normal, _fill_normal, 2.0, _normal_kl, "gaussian")
_register_location_scale(Laplace, _fill_laplace, 1.0, _laplace_kl, "laplace")
register_base(
    Uniform,
    ("low", "high"),
    fill=_fill_uniform,
    centre=lambda b: float(b.low + b.high) / 2,
    name="uniform",
    build=lambda scale: Uniform(-scale, scale),
)
register_base(
    StudentT,
    ("df", "loc", "scale"),
    fill=_fill_student_t,
    location_fisher=_student_t_location,
    scale_fisher=_student_t_scale,
    centre=_loc,
    name="student-t",
    build=_student_t,
)
register_base(
    Rayleigh,
    ("scale",),
    fill=_fill_rayleigh,
    scale_fisher=lambda b: 4.0,
    scale_kl=_rayleigh_kl,
    name="rayleigh",
    build=Rayleigh,
)
register_base(
    Dirac,
    ("value",),
    fill=_fill_dirac,
    centre=lambda b: float(b.value),
    density=False,
    name="dirac",
)
register_base(Cauchy, ("loc", "scale"), fill=_fill_loc_scale("cauchy_"), centre=_loc)
register_base(Exponential, ("rate",), fill=_fill_exponential)
register_base(LogNormal, ("loc", "scale"), fill=_fill_loc_scale("log_normal_"))
NAMES: tuple[str, ...] = tuple(f.name for f in _FAMILIES.values() if f.name)
"""Names accepted by :func:`from_name` (those of the built-in families)."""
