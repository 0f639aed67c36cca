r"""Leave-one-out changes predicted from the exact Hessian of the converged retraining's
objective, and the approximations that lead from it to the memory-map estimate.

At the converged control u* of a :class:`~experiments.memory.converged.Retrainer`'s objective
J (N examples, the draws fixed), removing example i subtracts ℓ̄_i/N from J (ℓ̄_i its loss
averaged over the draws), which moves the minimiser by the Newton step

    Δu = (N H)⁻¹ ∇ℓ̄_i,    H = ∇²J(u*),

and the logits at the posterior mean by J_i Δu (J_i = ∂f_i/∂u). Each form of
:data:`FORMS` predicts the change f_i^{\i} − f_i, one approximation at a time:

- ``newton``: J_i (NH)⁻¹ ∇ℓ̄_i, the first-order change of the minimiser;
- ``full``: V_i e_i, V_i = J_i (NH)⁻¹ J_iᵀ, e_i = softmax(f_i) − y_i: the memory-perturbation
  equation with the Laplace covariance (NH)⁻¹ and the gradient taken at the mean;
- ``diagonal``: diag(V_i) ⊙ e_i, each output's variance only (the score's form);
- ``mean_field``: diag(J_i Σ J_iᵀ) ⊙ e_i with Σ = diag(1/(N Hₚₚ)), the inverse of the
  precision's diagonal (what a mean-field Gaussian fitted at τ = 1 learns).

The memory map itself replaces Σ by the rule's learned covariance divided by τ
(``memory_converged``'s estimates at the control).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import grad, jacrev, jvp, vmap

from experiments.memory.stats import against

FORMS = ("newton", "full", "diagonal", "mean_field")
"""The predictions of :func:`predict`, from the Newton step to the memory map's form."""


def _flat(params: dict[str, Tensor]) -> tuple[Tensor, Any]:
    """The parameters as one vector, and the function that splits such a vector back."""
    names = list(params)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    u = torch.cat([params[n].reshape(-1) for n in names]).detach()

    def unflat(vector: Tensor) -> dict[str, Tensor]:
        parts = vector.split(sizes)
        return {n: p.reshape(s) for n, p, s in zip(names, parts, shapes, strict=True)}

    return u, unflat


def hessian(retrainer: Any, params: dict[str, Tensor], block: int = 16) -> Tensor:
    """∇²J at ``params`` (``[P, P]``, float64): Hessian-vector products, forward over reverse,
    ``block`` columns at a time."""
    u, unflat = _flat(params)
    gradient = grad(lambda v: retrainer.objective(unflat(v), None))

    def column(direction: Tensor) -> Tensor:
        return jvp(gradient, (u,), (direction,))[1]

    eye = torch.eye(len(u), dtype=u.dtype)
    H = torch.cat([vmap(column)(eye[k : k + block]) for k in range(0, len(u), block)])
    return 0.5 * (H + H.T)  # symmetric up to rounding


def predict(retrainer: Any, params: dict[str, Tensor], examples: list[int]) -> dict[str, Any]:
    """The predicted change of the logits at the mean of each of ``examples`` (``[n, K]`` per
    form of :data:`FORMS`), at the converged ``params`` of ``retrainer``; with whether H is
    positive definite, how many of its diagonal entries are not positive, and seconds."""
    t0 = time.perf_counter()
    u, unflat = _flat(params)
    N = retrainer.size
    H = hessian(retrainer, params)
    index = torch.tensor(examples)
    Jf = jacrev(lambda v: retrainer.mean_logits(unflat(v), index))(u)  # [n, K, P]
    n, K, P = Jf.shape
    losses = [grad(lambda v, i=i: retrainer.example_loss(unflat(v), i))(u) for i in examples]
    G = torch.stack(losses)  # ∇ℓ̄_i, [n, P]
    factor, info = torch.linalg.cholesky_ex(N * H)
    right = torch.cat([G.T, Jf.reshape(n * K, P).T], dim=1)
    if int(info) == 0:
        solved = torch.cholesky_solve(right, factor)
    else:
        solved = torch.linalg.solve(N * H, right)
    step, kernel = solved[:, :n], solved[:, n:].reshape(P, n, K)
    with torch.no_grad():
        f = retrainer.mean_logits(params, index)
    e = f.softmax(-1) - torch.nn.functional.one_hot(retrainer.y[index], K).to(f.dtype)
    V = torch.einsum("nkp,pnl->nkl", Jf, kernel)  # J_i (NH)⁻¹ J_iᵀ, [n, K, K]
    diag = torch.diagonal(N * H)
    mean_field = torch.where(diag > 0, 1.0 / diag.clamp_min(1e-300), torch.zeros_like(diag))
    return {
        "newton": torch.einsum("nkp,pn->nk", Jf, step),
        "full": torch.einsum("nkl,nl->nk", V, e),
        "diagonal": torch.diagonal(V, dim1=1, dim2=2) * e,
        "mean_field": torch.einsum("nkp,p->nk", Jf.square(), mean_field) * e,
        "examples": examples,
        "positive_definite": int(info) == 0,
        "diagonal_not_positive": int((diag <= 0).sum()),
        "parameters": P,
        "seconds": time.perf_counter() - t0,
    }


def _order(predicted: dict[str, Any], changes: dict[str, Any]) -> list[int]:
    """The rows of ``predicted`` in the order of the examples of ``changes``."""
    return [predicted["examples"].index(int(i)) for i in changes["examples"]]


def summarise(predicted: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Per form, the L1 size of the prediction against the true change of the logits
    (``changes`` as :func:`experiments.memory.converged.changes` gives them): median ratio
    and quartiles, Spearman, Pearson of the logs, and the median cosine with the true
    change."""
    at = _order(predicted, changes)
    truth, signed = changes["truth_f"], changes["signed"]
    out: dict[str, Any] = {
        key: predicted[key] for key in ("positive_definite", "diagonal_not_positive", "seconds")
    }
    for form in FORMS:
        moved = predicted[form][at].double().numpy()
        norms = np.linalg.norm(moved, axis=1) * np.linalg.norm(signed, axis=1)
        cosine = (moved * signed).sum(1) / np.where(norms > 0, norms, np.nan)
        out[form] = {
            **against(np.abs(moved).sum(1), truth),
            "cosine_median": float(np.nanmedian(cosine)),
        }
    return out


LABELS = {
    "newton": "Newton step, exact Hessian",
    "full": "V e, Laplace covariance",
    "diagonal": "diag(V) e",
    "mean_field": "mean-field covariance",
}


def figure(
    predicted: dict[str, Any], rule: Tensor, changes: dict[str, Any], path: Path, title: str
) -> None:
    """Each form's predicted change of the logits (L1) and the rule's estimate (``rule``,
    ``[N]``, at the control) against the true change, log-log, with the identity line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at = _order(predicted, changes)
    truth = changes["truth_f"]
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    sizes = {form: np.abs(predicted[form][at].double().numpy()).sum(1) for form in FORMS}
    sizes["rule"] = rule[changes["examples"]].double().numpy()
    for form, shown in sizes.items():
        name = LABELS.get(form, "the rule's covariance ÷ τ (the memory map)")
        ax.loglog(truth, shown, ".", ms=3, label=name)
    every = np.concatenate([truth, *sizes.values()])
    lo, hi = every[every > 0].min(), every.max()
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="identity")
    ax.set_xlabel("true change of the logits ‖Δf‖₁ (converged retraining)")
    ax.set_ylabel("predicted change")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
