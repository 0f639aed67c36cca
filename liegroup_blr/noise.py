r"""Where the base noise ξ comes from: fresh draws, a pre-drawn table, antithetic pairs.

On a CPU a fresh ``normal_`` over a network's parameters costs more than its forward and
backward pass. :class:`NoiseTable` draws base noise once and serves each request as a window
of the table at a uniformly random offset, copied into place — one memory pass and a single
random integer instead of a random number per coordinate, as evolution-strategies codes do.
Antithetic sampling pairs ξ with its reflection :math:`2c - \xi` about the centre c of a
symmetric base: half the draws, and lower variance of the gradient estimate.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Cauchy, Distribution, Laplace, Normal, StudentT, Uniform

from .distributions import Dirac, sample_into

__all__ = ["NOISE_SOURCES", "NoiseTable", "symmetric_centre"]

NOISE_SOURCES = ("fresh", "table")
"""Noise sources the optimizers accept (fresh draws from the base, or a :class:`NoiseTable`)."""


def symmetric_centre(base: Distribution) -> float | None:
    """Centre c of a base symmetric about c (so 2c − ξ has the base's law), else ``None``."""
    if isinstance(base, (Normal, Laplace, StudentT, Cauchy)):
        return float(base.loc)
    if isinstance(base, Uniform):
        return float(base.low + base.high) / 2
    if isinstance(base, Dirac):
        return float(base.value)
    return None


class NoiseTable:
    r"""``size`` i.i.d. draws of ``base``, served as windows at uniformly random offsets.

    A request for n values returns ``table[o : o + n]`` with o uniform on {0, …, T − n}.
    Every window is an i.i.d. sample of the base (a stretch of i.i.d. draws). Two requests
    share a coordinate's value only if their offsets coincide, so the correlation of a
    coordinate across two draws is :math:`1/(T - n + 1)`; windows that merely overlap reuse
    values at other coordinates. The table is a deterministic function of ``seed``, so it is
    rebuilt, not stored, when an optimizer resumes.

    Args:
        base: scalar base distribution.
        size: T, the number of pre-drawn values.
        seed: seed of the table's own generator.
        dtype: dtype of the table.
        device: device of the table.
    """

    def __init__(
        self,
        base: Distribution,
        size: int,
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size: must be ≥ 1, got {size}")
        generator = torch.Generator(device=device).manual_seed(seed)
        self.table = sample_into(base, torch.empty(size, dtype=dtype, device=device), generator)

    @property
    def size(self) -> int:
        """T, the number of pre-drawn values."""
        return self.table.numel()

    def window(self, numel: int, offset: int) -> Tensor:
        """The ``numel`` values at ``offset`` (a view: no copy, read-only by convention)."""
        if numel > self.size:
            raise ValueError(f"numel: a window of {numel} exceeds the table of {self.size}")
        return self.table.narrow(0, offset % (self.size - numel + 1), numel)

    def fill_(self, out: Tensor, offset: int) -> Tensor:
        """Copy the window at ``offset`` into ``out``."""
        return out.copy_(self.window(out.numel(), offset).view(out.shape))
