"""The full affine group θ = Lξ + b with L lower-triangular: full-covariance posteriors."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal

from .base import LieGroup, Shape, register_group

__all__ = ["FullAffineGroup"]


def _tril(n: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Row and column indices of the lower triangle of an n × n matrix, row-major."""
    rows, cols = torch.tril_indices(n, n, device=device)
    return rows, cols


def _size(length: int) -> int:
    """n from the packed length n(n+1)/2 + n = n(n+3)/2."""
    n = (math.isqrt(9 + 8 * length) - 3) // 2
    if n < 1 or n * (n + 3) // 2 != length:
        raise ValueError(f"full affine elements have shape (n(n+3)/2,), got length {length}")
    return n


@register_group
class FullAffineGroup(LieGroup):
    r"""Affine maps :math:`g = (L, b)` with :math:`L` lower-triangular with a positive diagonal,
    acting on the flattened parameter by :math:`g \cdot \xi = L\xi + b`.

    With a Gaussian base :math:`\xi \sim \mathcal N(0, \sigma^2 I)` the candidates are every
    Gaussian :math:`\mathcal N(b, \sigma^2 L L^\top)`: a full-covariance posterior over the
    ``n`` entries of one tensor (``L`` is its Cholesky factor up to σ).

    One element spans one parameter tensor of ``n`` entries. Elements are packed vectors
    ``[L[tril], b]`` of length ``n(n+1)/2 + n`` (``L``'s lower triangle row by row, as
    :func:`torch.tril_indices` orders it, then ``b``), and algebra vectors likewise
    ``[X[tril], v]``, a lower-triangular ``X`` (any diagonal) and a translation ``v``. As
    ``(n+1) × (n+1)`` matrices :math:`\begin{psmallmatrix} L & b \\ 0 & 1\end{psmallmatrix}`,
    composition is the matrix product and

    .. math:: \exp(X, v) = \operatorname{expm}\begin{pmatrix} X & v \\ 0 & 0\end{pmatrix}
              \quad (\texttt{torch.linalg.matrix\_exp}),

    :math:`\log|\det J_g| = \sum_i \log L_{ii}`. The point estimate (ξ₀ = 0) is :math:`b`.

    The algebra has ``d = n(n+3)/2`` dimensions, too many for a Monte-Carlo Fisher metric
    beyond a few dozen entries, so :meth:`fisher` gives it in closed form for a centred
    Gaussian base: diagonal, 2 on :math:`X_{ii}`, 1 on :math:`X_{ij}` (i > j),
    :math:`1/\sigma^2` on :math:`v`.
    """

    name = "FullAffine"

    def element_shape(self, shape: Shape) -> torch.Size:
        n = math.prod(shape)
        return torch.Size((n * (n + 3) // 2,))

    def param_shape(self, element_shape: Shape) -> torch.Size:
        if len(element_shape) != 1:
            raise ValueError(f"full affine elements are vectors, got shape {tuple(element_shape)}")
        return torch.Size((_size(element_shape[0]),))  # the flattened parameter

    # ------------------------------------------------------- packing
    def matrices(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(L, b)`` of a packed element (or ``(X, v)`` of an algebra vector)."""
        n = _size(g.shape[-1])
        rows, cols = _tril(n, g.device)
        L = g.new_zeros(n, n).index_put((rows, cols), g[: len(rows)])
        return L, g[len(rows) :]

    def pack(self, L: Tensor, b: Tensor) -> Tensor:
        """The packed element of a lower-triangular ``L`` and a shift ``b``."""
        rows, cols = _tril(len(L), L.device)
        return torch.cat((L[rows, cols], b))

    # ------------------------------------------------------- structure
    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        n = math.prod(shape)
        eye = torch.eye(n, dtype=dtype, device=device)
        return self.pack(eye, torch.zeros(n, dtype=dtype, device=device))

    def exp(self, X: Tensor) -> Tensor:
        A, v = self.matrices(X)
        n = len(A)
        M = torch.cat((torch.cat((A, v[:, None]), 1), X.new_zeros(1, n + 1)))
        E = torch.linalg.matrix_exp(M)
        return self.pack(E[:n, :n], E[:n, n])

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        (L1, b1), (L2, b2) = self.matrices(g), self.matrices(h)
        return self.pack(L1 @ L2, L1 @ b2 + b1)

    def inverse(self, g: Tensor) -> Tensor:
        L, b = self.matrices(g)
        eye = torch.eye(len(L), dtype=g.dtype, device=g.device)
        L_inv = torch.linalg.solve_triangular(L, eye, upper=False)
        return self.pack(L_inv, -L_inv @ b)

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        L, b = self.matrices(g)
        return (L @ x.reshape(-1) + b).reshape(x.shape)

    def log_abs_det(self, g: Tensor) -> Tensor:
        return self.matrices(g)[0].diagonal().log().sum()

    def from_point(self, theta: Tensor, scale: float = 1.0) -> Tensor:
        """``(L, b) = (scale · I, θ)``: an isotropic start centred at θ."""
        theta = theta.detach().reshape(-1)
        return self.pack(scale * torch.eye(len(theta), dtype=theta.dtype), theta.clone())

    def with_point(self, g: Tensor, theta: Tensor, xi0: Tensor | None = None) -> Tensor:
        """``(L, θ − Lξ₀)``: the factor L, the posterior's covariance, is kept."""
        L, _ = self.matrices(g)
        b = theta.detach().reshape(-1)
        return self.pack(L, b if xi0 is None else b - L @ xi0.reshape(-1))

    def parts(self, g: Tensor) -> dict[str, Tensor]:
        L, b = self.matrices(g)
        return {"L": L, "b": b}

    def check_element(self, g: Tensor) -> tuple[bool, str | None]:
        ok, reason = super().check_element(g)
        if ok and not bool((self.matrices(g)[0].diagonal() > 0).all()):
            return False, "the diagonal of L must be positive"
        return ok, reason

    def projx(self, x: Tensor) -> Tensor:
        """Entries clamped to the finite range of the dtype, L's diagonal to [tiny, max]."""
        self.one_element(x)
        info = torch.finfo(x.dtype)
        L, b = self.matrices(x.clamp(-info.max, info.max))
        L = L.tril(-1) + torch.diag(L.diagonal().clamp(info.tiny, info.max))
        return self.pack(L, b)

    def fisher(self, base: Distribution, shape: Shape) -> Tensor | None:
        """Diagonal: 2 on X_ii, 1 on X_ij (i > j), 1/σ² on v, for a centred Gaussian base."""
        if not (isinstance(base, Normal) and float(base.loc) == 0):
            return None
        n = math.prod(shape)
        rows, cols = _tril(n)
        scale_part = torch.where(rows == cols, 2.0, 1.0).to(torch.float64)
        shift_part = torch.full((n,), 1 / float(base.scale) ** 2, dtype=torch.float64)
        return torch.cat((scale_part, shift_part))
