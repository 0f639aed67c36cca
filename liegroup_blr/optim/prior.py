r"""A posterior as the prior of the next task: (τ/N)·KL(q ‖ prior) in place of the N(0, 1/δ)
prior and the entropy term.

For task t with N_t examples the tempered sequential objective is

.. math:: E_q[\bar\ell_t(\theta)] + \frac{\tau}{N_t}\,\mathrm{KL}(q \,\|\, q_{t-1}),

whose algebra gradient adds :math:`\frac{\tau}{N_t}\nabla_X \mathrm{KL}(q_{g\exp X}\,\|\,q_h)`
(:func:`liegroup_blr.kl.kl_gradient`, the entropy's part included) to the loss's.

A prior of strength w > 0 (``strength``) is the tempered prior :math:`q_{t-1}^w/Z`: only the
cross-entropy is weighted, the entropy keeps weight 1,

.. math::
    E_q[\bar\ell_t] + \frac{\tau}{N_t}\big[-H(q) - w\,E_q \log q_{t-1}\big]
    = E_q[\bar\ell_t] + \frac{\tau}{N_t}\,\mathrm{KL}(q \,\|\, q_{t-1}^w/Z) + \text{const},

with the gradient :math:`\frac{\tau}{N_t}\big[w\nabla_X\mathrm{KL}(q\|q_{t-1})
- (1 - w)\nabla_X H(q)\big]`. w = 1 is exact sequential Bayes; for a Gaussian
:math:`q_{t-1} = \mathcal N(m, P^{-1})`, :math:`q_{t-1}^w/Z = \mathcal N(m, (wP)^{-1})`: w > 1
pulls back harder, w < 1 lets the new task move further. A parameter
the prior does not cover (a new head) keeps its param group's regularisers: the entropy and
the N(0, 1/δ) prior. :class:`Prior` holds the prior's elements and computes that part;
:func:`prior_for` checks a posterior against an optimizer's parameters and makes one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from ..distributions import has_density
from ..groups import LieGroup
from ..kl import kl_gradient
from ..posterior import Posterior
from ..posterior_io import describe_base
from .scratch import state_dtype

__all__ = ["NEXT_PRIORS", "Prior", "check_next_prior", "check_strength", "prior_for", "task_reset"]

NEXT_PRIORS = ("posterior", "delta", "none")
r"""What :meth:`~liegroup_blr.optim.BLROptimizer.next_task` makes of the finished task:

* ``"posterior"``: its posterior as the prior, tempered by the strength w (this module);
* ``"delta"``: the K-prior's weight term (Khan & Swaroop, 2021), each group's N(0, 1/δ) prior
  centred on the point estimate :math:`\theta_\text{prev}` that ended the task, δ its
  ``prior_precision``: :math:`E_q[\bar\ell] + \frac{\delta}{N}E_q[\tfrac12\|\theta -
  \theta_\text{prev}\|^2] - \frac{\tau}{N}H(q)`. With a
  :class:`~liegroup_blr.MemorablePast` of use ``"kprior"`` holding every example of the
  finished tasks, at the δ and τ they were trained with, a generalised linear model's
  objective is the joint one up to a constant: it ends where training on every task at once
  ends;
* ``"none"``: no prior, :math:`E_q[\bar\ell] - \frac{\tau}{N}H(q)` (FROMP's code pairs its
  function term with no weight term)."""


def check_strength(strength: Any) -> float:
    """``strength`` as a float, checked: finite and > 0.

    Raises:
        ValueError: in one line, naming the argument.
    """
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real):
        raise ValueError(f"strength: expected a finite float > 0, got {strength!r}")
    value = float(strength)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"strength: expected a finite float > 0, got {strength!r}")
    return value


def check_next_prior(prior: Any, strength: Any, sharded: bool) -> float:
    """``strength`` checked for ``prior`` (one of :data:`NEXT_PRIORS`; a strength other than 1
    only with ``"posterior"``; ``"delta"`` not with ``sharded`` parameters).

    Raises:
        ValueError: in one line, naming the argument.
        NotImplementedError: ``"delta"`` with sharded parameters.
    """
    if prior not in NEXT_PRIORS:
        raise ValueError(f"prior: must be one of {NEXT_PRIORS}, got {prior!r}")
    strength = check_strength(strength)
    if prior != "posterior" and strength != 1.0:
        raise ValueError(f"strength: weights the posterior as prior; prior={prior!r} has none")
    if prior == "delta" and sharded:
        raise NotImplementedError(
            "next_task(prior='delta'): not with sharded (DTensor, FSDP2) parameters yet; "
            "train the next task with DistributedDataParallel, or on one process"
        )
    return strength


def task_reset(group: dict[str, Any], data_size: float, prior: str) -> dict[str, Any]:
    """What ``next_task(data_size, prior=prior)`` writes into a param group: the new data
    size, and, but for ``"delta"`` (which keeps δ as the centred prior's precision), a prior
    precision and weight decay of 0.

    Raises:
        ValueError: in one line, for ``weight_decay`` > 0 with ``"delta"``.
    """
    if prior != "delta":
        reset = {"data_size": data_size, "prior_precision": 0.0}
        if "weight_decay" in group:
            reset["weight_decay"] = 0.0
        return reset
    if group.get("weight_decay"):
        raise ValueError(
            f"weight_decay: {group['weight_decay']} with prior='delta', which centres the "
            "prior_precision's N(0, 1/δ) prior; train with prior_precision instead"
        )
    return {"data_size": data_size}


class Prior:
    r"""Each covered parameter's prior element h (in its state's dtype and device), checked
    against the optimizer's groups and bases when it was set, and the prior's strength w: the
    prior is :math:`q_h^w/Z` (the module's docstring).

    Args:
        elements: prior element by parameter.
        kl_samples: Monte-Carlo draws of a KL gradient without a closed form, per step.
        strength: w, a finite float > 0; 1: the posterior itself (exact sequential Bayes).

    Raises:
        ValueError: in one line, for a ``strength`` that is not a finite float > 0.
    """

    def __init__(
        self, elements: dict[Tensor, Tensor], kl_samples: int, *, strength: float = 1.0
    ) -> None:
        self.elements = elements
        self.kl_samples = kl_samples
        self.strength = check_strength(strength)

    def covers(self, params: list[Tensor]) -> bool:
        """Whether the prior covers any of ``params``."""
        return any(p in self.elements for p in params)

    def gradients(
        self,
        G: LieGroup,
        base: Distribution,
        keys: list[Tensor],
        elements: list[Tensor],
        weight: float,
        entropy: Callable[[Tensor], Tensor],
        generator: Callable[[torch.device], torch.Generator],
    ) -> list[Tensor]:
        r"""Per parameter ``keys[i]`` with element ``elements[i]``, with c = τ/N (``weight``)
        and w = ``strength``: where covered,
        :math:`c\,[w\nabla_X\mathrm{KL}(q_g\|q_h) - (1 - w)\nabla_X H(q_g)]`, the
        gradient of :math:`c\,\mathrm{KL}(q_g\|q_h^w/Z)` (:math:`\nabla_X H =
        \nabla_X\log|\det J|`, ``entropy(element)``; the second term is left out at w = 1
        and for a group of constant entropy); elsewhere the entropy's :math:`-c\nabla_X H`."""
        out = []
        w = self.strength
        for p, g in zip(keys, elements, strict=True):
            h = self.elements.get(p)
            if h is None:
                out.append(entropy(g).mul(-weight))
                continue
            grad = kl_gradient(
                G, base, g, h, num_samples=self.kl_samples, generator=generator(g.device)
            )
            if w == 1.0:
                out.append(grad.mul_(weight))
                continue
            grad.mul_(weight * w)
            if not G.constant_entropy:
                grad.sub_(entropy(g), alpha=(1.0 - w) * weight)
            out.append(grad)
        return out

    def state_dict(self, params: list[Tensor]) -> dict[int, Tensor]:
        """The elements by position of their parameters in ``params``."""
        return {i: self.elements[p] for i, p in enumerate(params) if p in self.elements}

    @classmethod
    def from_state_dict(
        cls,
        saved: dict[int, Tensor],
        params: list[Tensor],
        kl_samples: int,
        strength: float = 1.0,
    ):
        """:meth:`state_dict` loaded over ``params``, each element in its state dtype, with the
        saved ``strength`` (1 for a state dict saved without one)."""
        elements = {
            params[i]: h.to(params[i].device, state_dtype(params[i])) for i, h in saved.items()
        }
        return cls(elements, kl_samples, strength=strength)


def prior_for(
    posterior: Posterior,
    params: list[Tensor],
    trained: list[Tensor],
    model: nn.Module | None,
    group_of: Callable[[Tensor], dict[str, Any]],
    lie_group_of: Callable[[dict[str, Any]], LieGroup],
    kl_samples: int,
    strength: float = 1.0,
) -> Prior:
    """The prior ``posterior`` makes for an optimizer's parameters ``params`` (``trained``: the
    trained ones), each matched by name through ``model``, else by position, at ``strength``
    w (the prior :math:`q^w/Z`).

    Raises:
        ValueError: in one line, for a ``strength`` that is not a finite float > 0, a
            posterior whose parameters, shapes, group or base do not match, a Dirac base
            (infinite KL), or a covered parameter whose param group has
            ``prior_precision > 0`` or ``weight_decay > 0``.
    """
    strength = check_strength(strength)
    if not isinstance(posterior, Posterior):
        raise ValueError(f"prior: expected a liegroup_blr.Posterior, got {posterior!r}")
    elements = {}
    for p, key, entry in _match(posterior, params, trained, model):
        group = group_of(p)
        G = lie_group_of(group)
        where = f"prior: entry {key!r}"
        if not has_density(group["base"]):
            raise ValueError(
                f"{where}: a {type(group['base']).__name__} base has no density, so "
                "KL(q || prior) is infinite; use a base with a density"
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
    return Prior(elements, kl_samples, strength=strength)


def _match(
    posterior: Posterior, params: list[Tensor], trained: list[Tensor], model: nn.Module | None
) -> list[tuple[Tensor, str | int, Any]]:
    """(parameter, key, entry) for every entry of ``posterior``."""
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
    if len(posterior) != len(trained):
        raise ValueError(
            f"prior: {len(posterior)} entries by name for {len(trained)} trained parameters; "
            "pass the model that names them: set_prior(posterior, model)"
        )
    return [(p, key, entry) for p, (key, entry) in zip(trained, posterior.items(), strict=True)]
