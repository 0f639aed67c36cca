"""Mean-field variational inference from the ``posteriors`` library (``posteriors.vi.diag``)
as a torch optimizer that :func:`experiments.common.training.train` steps like the others.

It fits q(θ) = N(μ, diag σ²) by minimising, on each minibatch B, posteriors' scaled NELBO

    −E_q[(1/|B|) Σ_{i∈B} log p(y_i | x_i, θ) + log p(θ)/N] + (τ/N) E_q[log q(θ)],   τ = 1,

with the prior p(θ) = N(0, 1/δ) (δ = 0: flat), ``mc_samples`` reparameterised samples
θ = μ + σ ε per step (each one gradient evaluation), the sticking-the-landing gradient
(posteriors' default) and torchopt's Adam on (μ, log σ) under the run's learning-rate
schedule. The model's parameters hold μ between steps; :meth:`MeanFieldVI.sampled_params`
swaps a sample in, as IVON's does. Needs the peers' environment
(experiments/requirements-peers.txt): posteriors and torchopt are imported here only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import optree
import posteriors
import torch
import torchopt
from torch import Tensor, nn
from torch.nn.functional import cross_entropy

from experiments.common.batches import Batch, BatchOptimizer


class MeanFieldVI(BatchOptimizer):
    """``posteriors.vi.diag`` over the parameters ``params``; ``data_size`` is N.

    ``init_log_sd`` is log σ at the start for every weight; ``betas`` are Adam's.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        data_size: float,
        prior_precision: float = 0.0,
        init_log_sd: float = -3.0,
        betas: tuple[float, float] = (0.9, 0.999),
        mc_samples: int = 1,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas)})
        self.data_size, self.prior_precision = data_size, prior_precision
        self.mc_samples = mc_samples
        # Adam's step size is the param group's, which the run's scheduler sets
        self.adam = torchopt.adam(lambda _: self.param_groups[0]["lr"], betas=tuple(betas))
        self.vi = posteriors.vi.diag.init(self._means(), self.adam, init_log_sds=init_log_sd)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _means(self) -> dict[str, Tensor]:
        """μ as the tree posteriors holds: parameter index → a copy of the parameter."""
        return {str(i): p.detach().clone() for i, p in enumerate(self._params())}

    def _log_posterior(
        self, model: nn.Module, params: dict[str, Tensor], batch: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """(1/|B|) Σ log p(y|x, θ) + log p(θ)/N, the scale posteriors asks for, and the
        mean cross-entropy at θ."""
        x, y = batch
        names = [name for name, _ in model.named_parameters()]
        theta = [params[str(i)] for i in range(len(names))]
        logits = torch.func.functional_call(model, dict(zip(names, theta, strict=True)), (x,))
        loss = cross_entropy(logits, y)
        log_prior = -0.5 * self.prior_precision * sum(t.square().sum() for t in theta)
        return -loss + log_prior / self.data_size, loss.detach()

    def step(self, closure: Any = None, *, batch: Batch | None = None) -> float:  # type: ignore[override]
        """One update of (μ, log σ) on the minibatch ``batch = (model, x, y)``; returns the
        mean cross-entropy at the sampled parameters."""
        if batch is None:
            raise TypeError(
                "MeanFieldVI computes its own gradients: call step(batch=(model, x, y))"
            )
        model, x, y = batch

        def log_posterior(params: dict[str, Tensor], data: Any) -> tuple[Tensor, Tensor]:
            return self._log_posterior(model, params, data)

        self.vi, loss = posteriors.vi.diag.update(
            self.vi,
            (x, y),
            log_posterior,
            self.adam,
            temperature=1.0 / self.data_size,
            n_samples=self.mc_samples,
        )
        self._load(self.vi.params)
        return float(loss.mean())

    @contextmanager
    def sampled_params(self) -> Iterator[None]:
        """Within the block the parameters hold one sample θ ~ q; then μ again."""
        self._load(posteriors.vi.diag.sample(self.vi))
        try:
            yield
        finally:
            self._load(self.vi.params)

    @torch.no_grad()
    def _load(self, tree: Any) -> None:
        """Copy a tree of posteriors' (parameter index → tensor) into the parameters."""
        for i, p in enumerate(self._params()):
            p.copy_(tree[str(i)])

    def state_dict(self) -> dict[str, Any]:
        """log σ, Adam's moments and counts and the step, as plain tensors (μ is the
        model's parameters)."""
        state = (self.vi.log_sd_diag, self.vi.opt_state, self.vi.step)
        return {
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "leaves": [t.detach().clone() for t in optree.tree_leaves(state)],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; μ is read from the parameters (load the model first)."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        fresh = (self.vi.log_sd_diag, self.vi.opt_state, self.vi.step)
        leaves, spec = optree.tree_flatten(fresh)
        if len(leaves) != len(state_dict["leaves"]):
            raise ValueError("the saved mean-field VI state does not fit these parameters")
        log_sd, opt_state, step = optree.tree_unflatten(spec, list(state_dict["leaves"]))
        self.vi = posteriors.vi.diag.VIDiagState(
            self._means(), log_sd, opt_state, self.vi.nelbo, step
        )
