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
γ < 1 forgets old tasks' curvature geometrically. :func:`diagonal_ggn` gives the same
Fisher (for a softmax it is the GGN) with one batched backward per class where the network is
linear layers; the continual driver uses it.
"""

from __future__ import annotations

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


def diagonal_ggn(
    model: nn.Module, inputs: Tensor, mask: Tensor, chunk: int = 1000
) -> dict[str, Tensor]:
    r""":func:`diagonal_fisher` (the mean diagonal GGN of the softmax over the head's columns,
    ``mask``), fast where every trained parameter is an ``nn.Linear``'s on 2-d inputs: per class k
    one batched backward of :math:`\sqrt{p_k}(e_k - p)` from the logits, and per layer :math:`\sum_i
    g_{ik}^2 a_i^{2\top}` (its per-example gradients
    :math:`g_{ik}a_i^\top` are outer products). Otherwise ``diagonal_fisher`` itself."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    trained = {n: q for n, q in model.named_parameters() if q.requires_grad}
    owned = {id(q) for m in linears for q in m.parameters()}
    if any(id(q) not in owned for q in trained.values()):
        return diagonal_fisher(model, inputs, mask)
    names = {id(q): n for n, q in trained.items()}
    total = {n: torch.zeros_like(q) for n, q in trained.items()}
    seen: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def keep(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        seen[module] = (args[0].detach(), output)

    hooks = [m.register_forward_hook(keep) for m in linears]
    was_training = model.training
    model.eval()
    try:
        for x in inputs.split(chunk):
            seen.clear()
            logits = model(x) + mask
            if any(a.ndim != 2 for a, _ in seen.values()):
                return diagonal_fisher(model, inputs, mask)
            p = torch.softmax(logits, dim=-1).detach()
            outputs = [seen[m][1] for m in linears]
            for k in torch.isfinite(mask).nonzero().flatten().tolist():
                direction = -p
                direction[:, k] += 1
                direction = direction * p[:, k : k + 1].sqrt()
                grads = torch.autograd.grad(logits, outputs, direction, retain_graph=True)
                for m, g in zip(linears, grads, strict=True):
                    a, g2 = seen[m][0], g.detach().square()
                    if id(m.weight) in names:
                        total[names[id(m.weight)]] += g2.T @ a.square()
                    if m.bias is not None and id(m.bias) in names:
                        total[names[id(m.bias)]] += g2.sum(0)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return {n: v / len(inputs) for n, v in total.items()}
