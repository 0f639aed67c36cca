"""Validation of hyperparameters: a ValueError that names the argument."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ..distributions import check_base
from ..groups import LieGroup
from ..noise import symmetric_centre

__all__ = ["check_choice", "check_count", "check_hyperparameters", "check_number"]


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
    hp: dict[str, Any], group: LieGroup, *, antithetic: bool, point_estimate: str
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
    if point_estimate == "mean" and not math.isfinite(float(hp["base"].mean)):
        raise ValueError("point_estimate: 'mean' needs a base with a finite mean")
