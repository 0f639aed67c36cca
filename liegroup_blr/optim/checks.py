"""Validation of hyperparameters: a ValueError that names the argument."""

from __future__ import annotations

import math
import numbers
from typing import Any

from torch import Tensor

from .._userline import warn
from ..distributions import check_base
from ..groups import LieGroup
from ..noise import symmetric_centre

__all__ = [
    "REQUIRED",
    "check_choice",
    "check_count",
    "check_hyperparameters",
    "check_momentum",
    "check_number",
    "former_positional",
    "required",
]


def check_number(hp: dict[str, Any], key: str, low: float, high: float = math.inf, *, closed=True):
    """Check low ≤ hp[key] < high (low < ... when not closed); ValueError naming ``key``."""
    value = hp[key]
    if isinstance(value, Tensor):
        raise ValueError(f"{key}: {key} as a Tensor is not supported, give a float")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    ok = (low <= value if closed else low < value) and value < high
    if not ok or math.isnan(value):
        lo = "[" if closed else "("
        raise ValueError(f"{key}: must lie in {lo}{low}, {high}), got {value}")


def check_count(key: str, value: Any) -> None:
    """Check that ``value`` is an integer ≥ 1; ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: must be an integer ≥ 1, got {value!r}")


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    """Check that ``value`` is one of ``choices``; ValueError naming ``key``."""
    if value not in choices:
        raise ValueError(f"{key}: must be one of {choices}, got {value!r}")


def check_hyperparameters(
    hp: dict[str, Any], group: LieGroup, *, antithetic: bool, point_at: str
) -> None:
    """The hyperparameters every rule has: lr, momentum, temperature, prior precision,
    data size (required where the objective divides by it) and the base distribution."""
    check_number(hp, "lr", 0.0, closed=False)
    check_number(hp, "momentum", 0.0, 1.0)
    check_number(hp, "temperature", 0.0)
    check_number(hp, "prior_precision", 0.0)
    if hp["data_size"] is not None:
        check_number(hp, "data_size", 0.0, closed=False)
    elif hp["prior_precision"] > 0 or (hp["temperature"] > 0 and not group.constant_entropy):
        raise ValueError(
            "data_size: the number of training examples N is required when "
            "prior_precision > 0 or temperature > 0 (the objective scales them by 1/N)"
        )
    check_base(hp["base"], group.positive_base)
    if antithetic and symmetric_centre(hp["base"]) is None:
        raise ValueError(
            "antithetic: needs a base symmetric about its centre (Normal, Laplace, "
            f"Uniform, StudentT, Cauchy, Dirac), got {type(hp['base']).__name__}"
        )
    if point_at == "mean" and not math.isfinite(float(hp["base"].mean)):
        raise ValueError("point_at: 'mean' needs a base with a finite mean")


FORMER_POSITIONAL = {"data_size": None, "temperature": 1.0, "prior_precision": 0.0, "mc_samples": 1}
"""The arguments AdditiveBLR and LieGroupBLR took by position after ``momentum`` (``base`` for
AdditiveBLR) in 0.1.0, in that order, with their defaults; keyword-only since."""


def former_positional(owner: str, values: tuple[Any, ...], *given: Any) -> tuple[Any, ...]:
    """The :data:`FORMER_POSITIONAL` arguments as received by keyword (``given``, in that
    order), with ``values`` passed by position in their place: one release of a FutureWarning
    that names the keyword fix. TypeError for more values than names, or one passed both ways.
    """
    if not values:
        return given
    names = list(FORMER_POSITIONAL)
    if len(values) > len(names):
        raise TypeError(
            f"{owner}: {len(values)} arguments by position after the optimizer's positional "
            f"ones; pass them by keyword ({', '.join(names)}, ...)"
        )
    out = list(given)
    for i, value in enumerate(values):
        if given[i] != FORMER_POSITIONAL[names[i]]:
            raise TypeError(f"{owner}: got multiple values for argument {names[i]!r}")
        out[i] = value
    fix = ", ".join(f"{n}={v!r}" for n, v in zip(names, values, strict=False))
    warn(
        f"{owner}: {', '.join(names[: len(values)])} passed by position; keyword-only now, "
        f"refused by position from the next release: write {owner}(..., {fix})",
        FutureWarning,
    )
    return tuple(out)


def check_momentum(owner: str, momentum: Any) -> None:
    """ValueError naming ``momentum`` outside [0, 1); for a number ≥ 1 (likely a data size
    passed by position into momentum's place), the keyword fix as well."""
    try:
        check_number({"momentum": momentum}, "momentum", 0.0, 1.0)
    except ValueError as err:
        if (
            isinstance(momentum, numbers.Real)
            and not isinstance(momentum, bool)
            and float(momentum) >= 1
        ):
            raise ValueError(
                f"{err}; if {momentum!r} is the number of training examples N, pass it by "
                f"keyword: {owner}(..., data_size={momentum!r})"
            ) from None
        raise


REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "<required>"})()
"""The default of an argument the caller must give: :func:`required` names it."""


def required(owner: str, **arguments: tuple[Any, str]) -> None:
    """TypeError in one line for the first argument still at :data:`REQUIRED` (or ``None``
    for ``lr``), saying what it means: ``arguments`` maps each name to (value, meaning)."""
    for name, (value, meaning) in arguments.items():
        if value is REQUIRED or (name == "lr" and value is None):
            raise TypeError(f"{owner}: {name} is required: {meaning}")
