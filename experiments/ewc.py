r"""Online elastic weight consolidation: the continual-learning baseline of the drivers.

EWC (Kirkpatrick et al., PNAS 2017) keeps a Laplace approximation of the previous tasks'
posterior: a Gaussian around their solution :math:`\theta^*` with the diagonal Fisher as
precision. Its online form (Schwarz et al., ICML 2018, "Progress & Compress") keeps one
running Fisher instead of one per task. After task t, with :math:`F_t` the diagonal Fisher
of task t at :math:`\theta^*_t`,

.. math::
    \tilde F_t = \gamma\,\tilde F_{t-1} + F_t, \qquad
    \mathcal L_{t+1}(\theta) = \bar\ell_{t+1}(\theta)
        + \frac{\lambda}{2}\sum_i \tilde F_{t,i}\,(\theta_i - \theta^*_{t,i})^2,

where :math:`\bar\ell` is the mean loss per example and :math:`F_t` the mean Fisher per
example, :math:`F_t = \frac1{N_t}\sum_n \sum_k p_k(x_n)\,(\nabla\log p_k(x_n))^2` with the
expectation over the model's own predictive :math:`p(\cdot\mid x_n)` taken exactly (the
"true" Fisher, not the empirical one at the labels). In these units λ = 1 with γ = 1 is the
Laplace approximation's own weight when tasks have equal sizes
(:math:`N_{t+1}\bar\ell_{t+1} + \tfrac12 N_t F_t\,\Delta^2`, divided by :math:`N_{t+1}`);
γ < 1 forgets old tasks' curvature geometrically.
"""

from __future__ import annotations

if __name__ == "__main__":
    from experiments import usage

    raise SystemExit(usage.helper("experiments.ewc", __doc__, ("continual",)))

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

# per-example Jacobians of a chunk hold (chunk × classes) gradients of the whole model
_ROWS_PER_CHUNK = 256


def diagonal_fisher(model: nn.Module, inputs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    r"""The mean diagonal Fisher per example,
    :math:`F = \frac1N\sum_n\sum_k p_k(x_n)\,(\nabla_\theta\log p_k(x_n))^2`, of every
    trainable parameter, by name.

    ``mask`` (added to the logits: 0 on the head's columns, −∞ elsewhere) restricts the
    softmax to the task's classes; the sum over k runs over those. Exact in k: per-example
    Jacobians of the log-probabilities (``torch.func``), in chunks.
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    classes = torch.isfinite(mask).nonzero().flatten()

    def log_probs(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        logits = functional_call(model, theta, (x[None],))[0] + mask
        return torch.log_softmax(logits, dim=-1)[classes]

    per_example = vmap(jacrev(log_probs), in_dims=(None, 0))
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    chunk = max(1, _ROWS_PER_CHUNK // len(classes))
    was_training = model.training
    model.eval()
    try:
        for x in inputs.split(chunk):
            jac = per_example(params, x)  # name → (chunk, classes, *shape)
            with torch.no_grad():
                p = torch.exp(vmap(log_probs, in_dims=(None, 0))(params, x))
                for n, j in jac.items():
                    weights = p.reshape(*p.shape, *[1] * (j.ndim - 2))
                    fisher[n] += (weights * j.square()).sum(dim=(0, 1))
    finally:
        model.train(was_training)
    return {n: f / len(inputs) for n, f in fisher.items()}


class OnlineEWC:
    r"""The online EWC penalty :math:`\frac{\lambda}{2}\sum_i\tilde F_i(\theta_i -
    \theta^*_i)^2` and its consolidation :math:`\tilde F \leftarrow \gamma\tilde F + F`,
    :math:`\theta^* \leftarrow \theta` after each task.

    Args:
        strength: λ > 0.
        decay: γ ∈ [0, 1].

    Raises:
        ValueError: naming the argument, for λ ≤ 0 or γ outside [0, 1].
    """

    def __init__(self, strength: float, decay: float = 1.0) -> None:
        if not strength > 0:
            raise ValueError(f"ewc_lambda: must be > 0, got {strength}")
        if not 0 <= decay <= 1:
            raise ValueError(f"ewc_gamma: must be in [0, 1], got {decay}")
        self.strength = strength
        self.decay = decay
        self.fisher: dict[str, Tensor] = {}
        self.anchor: dict[str, Tensor] = {}

    def penalty(self, model: nn.Module) -> Tensor:
        """The penalty at the model's parameters (0 before the first consolidation)."""
        terms = [
            (self.fisher[n] * (p - self.anchor[n]).square()).sum()
            for n, p in model.named_parameters()
            if n in self.fisher
        ]
        if not terms:
            return torch.zeros(())
        return 0.5 * self.strength * torch.stack(terms).sum()

    @torch.no_grad()
    def consolidate(self, model: nn.Module, fisher: dict[str, Tensor]) -> None:
        """Fold a finished task's Fisher into the running one and anchor at the model."""
        for n, f in fisher.items():
            old = self.fisher.get(n)
            self.fisher[n] = f.clone() if old is None else self.decay * old + f
        params = dict(model.named_parameters())
        self.anchor = {n: params[n].detach().clone() for n in self.fisher}

    def state_dict(self) -> dict[str, Any]:
        return {"fisher": dict(self.fisher), "anchor": dict(self.anchor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fisher = dict(state["fisher"])
        self.anchor = dict(state["anchor"])
