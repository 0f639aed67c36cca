r"""A posterior as the prior of the next task: (τ/N)·KL(q ‖ prior) in place of the N(0, 1/δ)
prior and the entropy term.

For task t with N_t examples the tempered sequential objective is

.. math:: E_q[\bar\ell_t(\theta)] + \frac{\tau}{N_t}\,\mathrm{KL}(q \,\|\, q_{t-1}),

whose algebra gradient adds :math:`\frac{\tau}{N_t}\nabla_X \mathrm{KL}(q_{g\exp X}\,\|\,q_h)`
(:func:`liegroup_blr.kl.kl_gradient`, the entropy's part included) to the loss's. A parameter
the prior does not cover (a new head) keeps its param group's regularisers: the entropy and
the N(0, 1/δ) prior.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..distributions import Dirac
from ..fisher import entropy_gradient
from ..kl import kl_gradient
from ..posterior import Posterior
from ..posterior_io import describe_base
from .outside import take_writes
from .scratch import state_dtype
from .state import GroupStateOptimizer
from .tensors import GroupTensors

if TYPE_CHECKING:
    from ..groups import LieGroup

__all__ = ["Prior", "PriorHolding"]


class Prior:
    """Each covered parameter's prior element h (in its state's dtype and device), checked
    against the optimizer's groups and bases when it was set.

    Args:
        elements: prior element by parameter.
        kl_samples: Monte-Carlo draws of a KL gradient without a closed form, per step.
    """

    def __init__(self, elements: dict[Tensor, Tensor], kl_samples: int) -> None:
        self.elements = elements
        self.kl_samples = kl_samples

    def gradients(
        self, opt: GroupStateOptimizer, group: dict[str, Any], t: GroupTensors
    ) -> list[Tensor] | None:
        r"""Per tensor of ``t``: :math:`\frac{\tau}{N}\nabla_X\mathrm{KL}(q_g\|q_h)` for a covered
        parameter, the entropy's :math:`-\frac{\tau}{N}\nabla_X\log|\det J|` for another;
        ``None`` when the param group has no covered parameter."""
        if not any(p in self.elements for p in t.params):
            return None
        G: LieGroup = opt._group_of(group)
        weight = group["temperature"] / group["data_size"] if group["temperature"] else 0.0
        out = []
        for p, g in zip(t.params, t.elements, strict=True):
            h = self.elements.get(p)
            if h is None:
                grad = entropy_gradient(G, G.identity(p.shape, dtype=g.dtype, device=g.device))
                out.append(grad.mul_(-weight))
                continue
            generator = opt.noise_source.generator(g.device)
            grad = kl_gradient(
                G, group["base"], g, h, num_samples=self.kl_samples, generator=generator
            )
            out.append(grad.mul_(weight))
        return out


class PriorHolding(GroupStateOptimizer):
    """The part of :class:`~liegroup_blr.optim.BLROptimizer` that turns its posterior into an
    object and a posterior into its prior: :meth:`~liegroup_blr.optim.BLROptimizer.posterior`,
    :meth:`~liegroup_blr.optim.BLROptimizer.set_prior`,
    :meth:`~liegroup_blr.optim.BLROptimizer.next_task`."""

    def posterior(self, model: nn.Module | None = None) -> Posterior:
        """The current posterior, detached from the optimizer
        (:meth:`liegroup_blr.Posterior.from_optimizer`): keyed by ``model``'s parameter names
        when given, else by position in the order of the param groups. A value written into
        a parameter since the optimizer's last call is adopted first."""
        take_writes(self)
        return Posterior.from_optimizer(self, model)

    def set_prior(self, posterior: Posterior | None, model: nn.Module | None = None) -> None:
        """Use ``posterior`` as the prior: the update takes (τ/N)·∇KL(q ‖ posterior) in place
        of the N(0, 1/δ) prior and the entropy term for every parameter it covers (``None``:
        back to those). A posterior keyed by names needs the ``model`` that names the
        parameters (else its entries are matched to the trained parameters in order).

        Raises:
            ValueError: in one line, for a posterior whose parameters, shapes, group or base
                do not match, a Dirac base (infinite KL), or a covered parameter whose param
                group has ``prior_precision > 0``.
        """
        if posterior is not None and self._mesh_param is not None:
            raise NotImplementedError(
                "set_prior: not with sharded (DTensor, FSDP2) parameters yet; train the next "
                "task with DistributedDataParallel, or on one process"
            )
        if posterior is None:
            self._engine.prior = None
            return
        if not isinstance(posterior, Posterior):
            raise ValueError(f"prior: expected a liegroup_blr.Posterior, got {posterior!r}")
        elements = {}
        for p, key, entry in self._match(posterior, model):
            group = self._param_group(p)
            G = self._group_of(group)
            where = f"prior: entry {key!r}"
            if isinstance(group["base"], Dirac):
                raise ValueError(
                    f"{where}: a Dirac base has no density, so KL(q || prior) is infinite; use a "
                    "base with a density"
                )
            if type(entry.group) is not type(G) or entry.group.extra_repr() != G.extra_repr():
                raise ValueError(f"{where} was learnt with {entry.group}, this optimizer has {G}")
            if describe_base(entry.base) != describe_base(group["base"]):
                raise ValueError(
                    f"{where} was learnt with base {describe_base(entry.base)}, this optimizer's "
                    f"is {describe_base(group['base'])}: the KL needs one base"
                )
            if entry.element.shape != G.element_shape(p.shape):
                raise ValueError(
                    f"{where} has shape {tuple(entry.shape)}, the parameter {tuple(p.shape)}"
                )
            for name in ("prior_precision", "weight_decay"):
                if group.get(name):
                    raise ValueError(
                        f"{name}: {group[name]} with a prior for entry {key!r}: the prior "
                        f"replaces the N(0, 1/δ) prior; set {name}=0"
                    )
            elements[p] = entry.element.detach().to(p.device, state_dtype(p), copy=True)
        self._engine.prior = Prior(elements, kl_samples=self.mc_samples)

    def _match(
        self, posterior: Posterior, model: nn.Module | None
    ) -> list[tuple[Tensor, str | int, Any]]:
        """(parameter, key, entry) for every entry of ``posterior``."""
        params = [p for group in self.param_groups for p in group["params"]]
        if posterior.by_position:
            if posterior.size != len(params):
                raise ValueError(
                    f"prior: a posterior of {posterior.size} parameters for an optimizer of "
                    f"{len(params)}; take it with opt.posterior() over the same parameters"
                )
            return [(params[key], key, entry) for key, entry in posterior.items()]  # type: ignore[index]
        if model is not None:
            named = dict(model.named_parameters())
            unknown = [k for k in posterior if k not in named]
            if unknown:
                raise ValueError(f"prior: entries {unknown[:3]} are not parameters of the model")
            return [(named[key], key, entry) for key, entry in posterior.items()]  # type: ignore[index]
        trained = [p for p in params if p.requires_grad]
        if len(posterior) != len(trained):
            raise ValueError(
                f"prior: {len(posterior)} entries by name for {len(trained)} trained parameters; "
                "pass the model that names them: set_prior(posterior, model)"
            )
        return [(p, key, entry) for p, (key, entry) in zip(trained, posterior.items(), strict=True)]

    _extra_state_keys = ("prior",)

    def _extra_state(self) -> dict[str, Any]:
        """The prior's elements by position in the param groups (groups and bases are the
        optimizer's own)."""
        prior = self._engine.prior
        if prior is None:
            return {}
        params = [p for group in self.param_groups for p in group["params"]]
        return {
            "prior": {i: prior.elements[p] for i, p in enumerate(params) if p in prior.elements}
        }

    def _load_extra_state(self, extras: dict[str, Any]) -> None:
        saved = extras.get("prior")
        params = [p for group in self.param_groups for p in group["params"]]
        self._engine.prior = (
            None
            if saved is None
            else Prior(
                {
                    params[i]: h.to(params[i].device, state_dtype(params[i]))
                    for i, h in saved.items()
                },
                kl_samples=self.mc_samples,
            )
        )

    @torch.no_grad()
    def next_task(self, data_size: float) -> Posterior:
        """Start the next task of a sequence: the current posterior becomes the prior
        (:meth:`set_prior`), every param group's ``data_size`` becomes N_t = ``data_size`` and
        its ``prior_precision`` 0 (the posterior replaces the N(0, 1/δ) prior), and the
        momenta are reset to 0. Kept: the elements (the task starts from the posterior), the
        step sizes and other hyperparameters, lr schedules, the noise generators and the skip
        count. Returns the new prior.

        Raises:
            RuntimeError: between ``sampled_params(train=True)`` blocks and ``step()``.
        """
        if self._engine.samples:
            raise RuntimeError("next_task() between sampled_params(train=True) and step()")
        for group in self.param_groups:
            group["data_size"] = data_size
            group["prior_precision"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            self._validate(group)
        posterior = self.posterior()
        self.set_prior(posterior)
        for state in self.state.values():
            state["momentum"].zero_()
        return posterior
