r"""The memorable past: a few examples of each finished task and the old model's predictions
on them, kept beside the posterior, and a functional regulariser on them for later tasks.

After task :math:`t` the memory keeps :math:`m` of the task's training examples
:math:`(x_j, y_j)` (:data:`SELECTIONS`) and the old model's outputs on them,
:math:`f^{\text{old}}_j = f(x_j;\theta_t)`: the logits, or the predicted mean of a Gaussian
likelihood. Each kept example counts as one example of a later task's mean-loss objective:
with :math:`N` that task's training-set size and :math:`B` a minibatch of the :math:`M`
memory rows,

.. math:: R(\theta) = \frac1N\,\frac{M}{|B|}\sum_{j\in B} r_j\bigl(f(x_j;\theta)\bigr),

an unbiased estimate of :math:`\frac1N\sum_{j=1}^M r_j`, added to the task's mean loss with a
weight :math:`\lambda` (1: each kept example weighs as much as a current one). A rule with the
previous posterior as prior then minimises :math:`\mathbb E_q[\bar\ell_t + \lambda R] +
\frac{\tau}{N}\mathrm{KL}(q\,\|\,q_{t-1})`. The term :math:`r_j` (:data:`USES`), with
:math:`\Delta_j = f_j - f^{\text{old}}_j`:

* ``"kprior"`` (K-prior, Khan & Swaroop, NeurIPS 2021): categorical
  :math:`r_j = \mathrm{KL}(\operatorname{softmax} f^{\text{old}}_j\,\|\,\operatorname{softmax}
  f_j)`, whose gradient in :math:`f_j` is :math:`\operatorname{softmax} f_j - p^{\text{old}}_j`
  (the likelihood's with the old model's soft labels); Gaussian
  :math:`r_j = \|\Delta_j\|^2/2\sigma^2`. For a generalised linear model with every example of
  task 1 kept and the prior :math:`\frac\delta2\|\theta-\theta_1\|^2` at the MAP
  :math:`\theta_1` (``next_task(prior="delta")``), :math:`\sum_j r_j` plus the prior has the
  gradient of task 1's likelihood plus :math:`\frac\delta2\|\theta\|^2`, so task 2 ends at
  the joint MAP: exact.
* ``"fromp"`` (FROMP, Pan et al., NeurIPS 2020, as its code defines it): on the softmax
  *probabilities* (a Gaussian likelihood: the predicted mean), per stored task :math:`t` and
  class :math:`c`, with :math:`\Delta_{t,c} = p_{\cdot c}(\theta) - p^{\text{old}}_{\cdot c}`
  over the task's :math:`m_t` kept examples,

  .. math:: \sum_j r_j = \sum_t\sum_c \tfrac12\Delta_{t,c}^\top K_{t,c}^{-1}\Delta_{t,c},
            \qquad K_{t,c} = J_{t,c}\Sigma J_{t,c}^\top + 10^{-5} I_{m_t},

  :math:`J_{t,c} = \partial p_{\cdot c}/\partial\theta` (:math:`m_t \times P`) and
  :math:`\Sigma` diagonal: a posterior's variances over τ, or a covariance the caller passes
  (FROMP's code: :math:`(\sum_t \mathrm{GGN}_t + \delta)^{-1}`, the diagonal GGN summed
  over every finished task's training examples, :math:`\delta = 10^{-5}`). The targets and
  kernels of every stored task are recomputed from the current weights by
  :meth:`~liegroup_blr.MemorablePast.refresh` (FROMP's code: at the start of every task).
  The examples of a task are coupled: the loss takes every row at once.
* ``"fromp_logits"`` (this library's earlier FROMP, named for what differs): on the
  *logits*, :math:`r_j = \frac12\Delta_j^\top K_j^{-1}\Delta_j`,
  :math:`K_j = J_j\Sigma J_j^\top/\tau` the example's class × class block of the logits'
  covariance under the posterior that ended its task
  (:func:`~liegroup_blr.memory_maps.prediction_variance` with ``cross_class=True``): the kernel is
  block-diagonal over the examples. For a linear-Gaussian model the weight-space prior
  :math:`\frac12(\theta-\theta_1)^\top\Sigma_1^{-1}(\theta-\theta_1)` equals
  :math:`\frac12\Delta^\top(X\Sigma_1X^\top)^{-1}\Delta` on :math:`d` memory points with
  invertible :math:`X`; the per-example blocks give it where :math:`X\Sigma_1X^\top` is
  diagonal (one weight, or axis-aligned inputs and a diagonal :math:`\Sigma_1`).
* ``"replay"`` (the control): the label's negative log-likelihood,
  :math:`-\log\operatorname{softmax}(f_j)_{y_j}` or :math:`\|f_j - y_j\|^2/2\sigma^2`.

**Weight terms, and double counting.** The function terms pull toward the old model's own
predictions (their gradient is zero where they were taken). The K-prior pairs its term with
the δ-prior centred on the old mean (``next_task(prior="delta")``), FROMP's code with no
weight term (``prior="none"``). Composed with the posterior as prior either counts the past
twice: the posterior already holds every finished task's evidence. ``"replay"`` re-adds the
kept examples' likelihood, which such a prior already holds (VCL's coreset, Nguyen et al.,
ICLR 2018, removes it from the prior). ``"fromp"`` follows the reference code
(``team-approx-bayes/fromp``): λ-selected points, the softmax *probabilities* (a sigmoid for
one output: not offered), a kernel per class over each task's points (cross-example terms
kept) from a diagonal (GGN + prior precision) covariance, jitter :math:`10^{-5}I`, refreshed
every task. ``"fromp_logits"`` regularises the *logits* (the probabilities'
:math:`\Lambda J\Sigma J^\top\Lambda` is singular), a class × class block per example computed
once from the posterior that ended its task, jitter :math:`10^{-6}` times the kept examples'
mean prediction variance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.functional import cross_entropy, log_softmax, softmax

from . import posterior_io
from .memory_maps import (
    LIKELIHOODS,
    evaluating,
    jacobian_obstacle,
    prediction_variance,
    resolve_posterior,
    sensitivity,
)
from .posterior import Posterior

__all__ = ["SELECTIONS", "USES", "MemorablePast"]

SELECTIONS = ("lambda", "random", "sensitivity")
"""How :meth:`~liegroup_blr.MemorablePast.add_task` chooses a task's examples: ``"lambda"``
(FROMP's memorable points: the highest :math:`\\lambda_i = \\sum_k p_{ik}(1 - p_{ik})` at the
model's outputs, class-balanced; categorical only, the categorical default), ``"random"``
(uniformly, without replacement: the control, and the Gaussian default) or
``"sensitivity"`` (the highest :func:`~liegroup_blr.memory_maps.sensitivity` scores; needs a
posterior)."""

_DEFAULT_SELECTIONS = {"categorical": "lambda", "gaussian": "random"}
"""The selection of each likelihood when none is given. A Gaussian likelihood's λ analogue,
the curvature of the loss in the outputs, is :math:`1/\\sigma^2` for every example: it ranks
nothing, so the Gaussian default is a uniform draw."""

USES = ("kprior", "fromp", "fromp_logits", "replay")
"""The memory's term :math:`r_j` in :meth:`~liegroup_blr.MemorablePast.loss`: ``"kprior"``
(the old model's predictions as soft labels), ``"fromp"`` (FROMP as its code defines it: the
probabilities' distance in the metric of per-class inverse kernels over each task's examples,
refreshed by :meth:`~liegroup_blr.MemorablePast.refresh` from a posterior or a diagonal
covariance), ``"fromp_logits"`` (the logits' distance in per-example class × class inverse
kernels, fixed when the task is added; needs a posterior) or ``"replay"`` (the hard labels:
the control)."""

_FIELDS = ("inputs", "targets", "tasks", "scores", "outputs_old", "kernel_inverse")
_SETTINGS = ("per_task", "selection", "use", "likelihood", "noise_variance")
_JITTER = 1e-6
FROMP_JITTER = 1e-5
r"""ε of ``"fromp"``'s kernels :math:`J\Sigma J^\top + \varepsilon I` (FROMP's code)."""


class MemorablePast:
    r"""A memory of ``per_task`` training examples of every finished task, the old model's
    outputs on them, and the functional regulariser :math:`R(\theta)` on it.

    The optimizer's :meth:`~liegroup_blr.optim.BLROptimizer.next_task` carries the posterior
    over to the next task and sees no data; this object carries a few examples and what the
    model predicted on them::

        memory = lgb.MemorablePast(per_task=200)  # selection="lambda", use="kprior"
        for t, (x, y) in enumerate(tasks):
            if t:
                optimizer.next_task(data_size=len(y))
            for xb, yb in batches(x, y):

                def closure():
                    optimizer.zero_grad()
                    loss = cross_entropy(model(xb), yb)
                    if len(memory):
                        memory_loss = memory.loss(model(memory.inputs), data_size=len(y))
                        loss = loss + strength * memory_loss
                    loss.backward()
                    return loss

                optimizer.step(closure)
            memory.add_task(model, posterior=optimizer, inputs=x, targets=y)
            # use="fromp": memory.refresh(model, posterior=optimizer), or covariance=...

    ``"kprior"`` and ``"replay"`` need only the point estimate (``posterior=None``: an Adam or
    EWC baseline can use them); ``"fromp"`` needs :meth:`refresh` after every
    :meth:`add_task` (with a posterior, or a diagonal covariance such as an Adam baseline's
    inverse summed GGN); ``"fromp_logits"`` and the ``"sensitivity"`` selection need a
    posterior.

    Args:
        per_task: examples kept of each task (at most its training set).
        selection: one of :data:`~liegroup_blr.memorable.SELECTIONS`; by default the
            likelihood's: ``"lambda"`` for a categorical likelihood, ``"random"`` for a
            Gaussian one, whose λ analogue (the loss's curvature in the outputs,
            :math:`1/\sigma^2`) is the same for every example and ranks nothing.
        use: one of ``USES``: ``"kprior"``, ``"fromp"``, ``"fromp_logits"`` or ``"replay"``
            (module docstring).
        likelihood: ``"categorical"`` (outputs are logits, labels integers) or
            ``"gaussian"`` (outputs are the predicted mean, targets values).
        noise_variance: σ² of the Gaussian likelihood.

    Attributes:
        selection: the selection in use (the likelihood's default resolved).
        inputs: ``[M, ...]`` the kept inputs, task after task.
        targets: ``[M]`` their labels (or ``[M, ...]`` values of a Gaussian likelihood).
        tasks: ``[M]`` the index of the task each came from (0 for the first added).
        scores: ``[M]`` their selection scores: λ, the memory-map score, or NaN (random).
        outputs_old: ``[M, K]`` the model's outputs on them when their task was added
            (``"fromp"``: at the last :meth:`refresh`).
        kernel_inverse: ``[M, K, K]`` the inverse kernel blocks :math:`K_j^{-1}`
            (``"fromp_logits"``; empty otherwise).
        task_kernel_inverse: per stored task, ``[K, m_t, m_t]`` its per-class inverse
            kernels :math:`K_{t,c}^{-1}` (``"fromp"``, after :meth:`refresh`; empty
            otherwise).
        num_tasks: the tasks added.

    Raises:
        ValueError: naming the argument, for ``per_task`` < 1, an unknown selection, use or
            likelihood, a noise variance ≤ 0 or given to a categorical likelihood, or
            ``selection="lambda"`` with a Gaussian likelihood.
    """

    def __init__(
        self,
        per_task: int,
        selection: str | None = None,
        use: str = "kprior",
        *,
        likelihood: str = "categorical",
        noise_variance: float = 1.0,
    ) -> None:
        if isinstance(per_task, bool) or not isinstance(per_task, int) or per_task < 1:
            raise ValueError(f"per_task: must be an integer >= 1, got {per_task!r}")
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood: must be one of {LIKELIHOODS}, got {likelihood!r}")
        if selection is None:
            selection = _DEFAULT_SELECTIONS[likelihood]
        for name, value, valid in (("selection", selection, SELECTIONS), ("use", use, USES)):
            if value not in valid:
                raise ValueError(f"{name}: must be one of {valid}, got {value!r}")
        if isinstance(noise_variance, bool) or not noise_variance > 0:
            raise ValueError(f"noise_variance: must be > 0, got {noise_variance!r}")
        if likelihood == "categorical" and noise_variance != 1.0:
            raise ValueError("noise_variance: only the Gaussian likelihood has one")
        if likelihood == "gaussian" and selection == "lambda":
            raise ValueError(
                "selection: 'lambda' ranks by the softmax's p(1 - p), whose Gaussian analogue "
                "1/σ² is the same for every example; use selection='random' (its default)"
            )
        self.per_task = per_task
        self.selection = selection
        self.use = use
        self.likelihood = likelihood
        self.noise_variance = float(noise_variance)
        self.inputs = self.targets = self.tasks = self.scores = torch.empty(0)
        self.outputs_old = self.kernel_inverse = torch.empty(0)
        self.task_kernel_inverse: list[Tensor] = []
        self.num_tasks = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def __repr__(self) -> str:
        return (
            f"MemorablePast(per_task={self.per_task}, selection={self.selection!r}, "
            f"use={self.use!r}, likelihood={self.likelihood!r}): {len(self)} examples of "
            f"{self.num_tasks} task(s)"
        )

    # ---------------------------------------------------------------- filling
    def add_task(
        self,
        model: nn.Module,
        *positional: Any,
        posterior: Posterior | Any = None,
        inputs: Tensor | None = None,
        targets: Tensor | None = None,
        samples: int = 32,
        batch_size: int = 256,
        generator: torch.Generator | None = None,
        temperature: float | None = None,
    ) -> Tensor:
        r"""Keep ``per_task`` examples of a finished task with the model's outputs on them.

        ``"lambda"`` splits ``per_task`` as evenly as possible over the classes present in
        ``targets`` (a class with too few examples gives the rest to the others, lower labels
        first) and keeps the highest :math:`\lambda_i = \sum_k p_{ik}(1 - p_{ik})`,
        :math:`p_i = \operatorname{softmax} f(x_i)`, of each class, class after class in
        descending λ. ``"sensitivity"`` keeps the highest
        :func:`~liegroup_blr.memory_maps.sensitivity` scores in descending order; ``"random"`` a
        uniform draw, scoring nothing. The outputs are the model's as it holds its
        parameters now (a BLR optimizer's point estimate between steps), in eval mode, with
        no gradient. ``"fromp_logits"`` also stores :math:`K_j^{-1}`, :math:`K_j` the
        example's class × class block of :math:`J\Sigma J^\top/\tau`
        (:func:`~liegroup_blr.memory_maps.prediction_variance`, ``cross_class=True``) plus
        :math:`10^{-6}` times the mean of the kept examples' prediction variances times
        the identity; ``"fromp"`` computes its kernels in :meth:`refresh`.

        Everything after ``model`` is keyword-only::

            memory.add_task(model, posterior=optimizer, inputs=x, targets=y)

        Args:
            model: the network, its outputs the logits of the task's classes or the
                predicted mean (a multi-head network: a module giving this task's head).
            posterior: a :class:`~liegroup_blr.Posterior` of ``model``'s parameters, the
                Lie-group BLR optimizer that trained them, or None (``"kprior"``,
                ``"fromp"`` and ``"replay"`` with the ``"lambda"`` or ``"random"``
                selection). A Posterior's
                recorded temperature is read as the optimizer's: the same scores and kernel.
            inputs: ``[n, ...]`` the task's training inputs.
            targets: ``[n]`` their labels in ``[0, K)`` (Gaussian: ``[n]`` or ``[n, K]``
                values).
            samples: posterior samples of the sensitivity scores and the kernel where they
                are estimated by sampling (:func:`~liegroup_blr.memory_maps.memory_map`).
            batch_size: examples per batch through the model.
            generator: draws the posterior samples or the random choice (default: torch's
                global generator).
            temperature: τ the posterior was trained at, for the sensitivity scores and the
                kernel (:func:`~liegroup_blr.memory_maps.memory_map`'s ``temperature``); default:
                the one the optimizer or the Posterior holds.

        Returns:
            The indices of the kept examples in ``inputs``.

        Raises:
            TypeError: in one line, for arguments after ``model`` passed by position.
            ValueError: in one line, for missing inputs or targets, targets that do not fit,
                or ``posterior=None`` where the selection or the use needs one.
        """
        if positional:
            raise TypeError(
                f"add_task: takes the model, then keywords; got {len(positional)} more "
                "argument(s) by position; write add_task(model, posterior=..., inputs=x, "
                "targets=y)"
            )
        if inputs is None or targets is None:
            raise ValueError("inputs, targets: pass the finished task's training examples")
        if len(inputs) == 0:
            raise ValueError("inputs: no examples; pass the finished task's training inputs")
        if len(targets) != len(inputs):
            raise ValueError(
                f"targets: {len(targets)} targets for {len(inputs)} inputs; pass one per input"
            )
        if posterior is None and self.selection == "sensitivity":
            raise ValueError(
                "posterior: selection='sensitivity' scores with a posterior; pass one (or the "
                "BLR optimizer), or use selection='lambda' or 'random'"
            )
        if posterior is None and self.use == "fromp_logits":
            raise ValueError(
                "posterior: use='fromp_logits' builds its kernel from a posterior; pass one (or "
                "the BLR optimizer), or use use='fromp' (refresh() with a covariance)"
            )
        outputs = self._outputs(model, inputs, batch_size)
        self._check_targets(targets, outputs)
        keep = min(self.per_task, len(inputs))
        if self.selection == "lambda":
            p = softmax(outputs.double(), dim=-1)
            lam = (p * (1 - p)).sum(-1)
            rows = _balanced_top(lam, targets.to(lam.device), keep)
            kept = lam[rows].to(outputs.dtype)
        elif self.selection == "sensitivity":
            scores = sensitivity(
                model,
                posterior,
                inputs,
                targets,
                samples=samples,
                batch_size=batch_size,
                generator=generator,
                temperature=temperature,
                likelihood=self.likelihood,
                noise_variance=self.noise_variance,
            )
            rows = scores.topk(keep).indices
            kept = scores[rows]
        else:
            device = inputs.device if generator is None else generator.device
            rows = torch.randperm(len(inputs), generator=generator, device=device)[:keep]
            kept = torch.full((keep,), math.nan)
        rows = rows.to(inputs.device)
        chosen = inputs[rows]
        new = {
            "inputs": chosen,
            "targets": targets[rows.to(targets.device)],
            "tasks": torch.full((keep,), self.num_tasks, device=inputs.device),
            "scores": kept.to(inputs.device),
            "outputs_old": outputs[rows.to(outputs.device)].to(inputs.device),
        }
        if self.use == "fromp_logits":
            new["kernel_inverse"] = self._kernel_inverse(
                model, posterior, chosen, samples, batch_size, generator, outputs, temperature
            ).to(inputs.device)
        if len(self) and new["outputs_old"].shape[1:] != self.outputs_old.shape[1:]:
            raise ValueError(
                f"model: {new['outputs_old'].shape[1]} outputs, the memory's earlier tasks have "
                f"{self.outputs_old.shape[1]}; give every task's head the same number"
            )
        for name, value in new.items():
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, value.detach()]) if len(self) else value.detach())
        self.num_tasks += 1
        return rows

    def _outputs(self, model: nn.Module, inputs: Tensor, batch_size: int) -> Tensor:
        """``[n, K]`` the model's outputs at its current parameters, eval mode, no gradient."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        parameter = next(iter(model.parameters()), None)
        device = inputs.device if parameter is None else parameter.device
        parts = []
        with torch.no_grad(), evaluating(model):
            for start in range(0, len(inputs), batch_size):
                x = inputs[start : start + batch_size].to(device)
                parts.append(model(x).reshape(len(x), -1))
        return torch.cat(parts)

    def _check_targets(self, targets: Tensor, outputs: Tensor) -> None:
        K = outputs.shape[1]
        if self.likelihood == "gaussian":
            if targets[0].numel() != K or not targets.is_floating_point():
                raise ValueError(
                    f"targets: a Gaussian likelihood takes float values [n] or [n, {K}] for a "
                    f"model with {K} outputs, got {targets.dtype} of shape {tuple(targets.shape)}"
                )
            return
        if targets.ndim != 1 or targets.is_floating_point() or targets.is_complex():
            raise ValueError(
                f"targets: a categorical likelihood takes integer labels [n], got "
                f"{targets.dtype} of shape {tuple(targets.shape)}"
            )
        if int(targets.min()) < 0 or int(targets.max()) >= K:
            raise ValueError(f"targets: labels must lie in [0, {K}) for a model with {K} outputs")

    def _kernel_inverse(
        self,
        model: nn.Module,
        posterior: Any,
        inputs: Tensor,
        samples: int,
        batch_size: int,
        generator: torch.Generator | None,
        outputs: Tensor,
        temperature: float | None,
    ) -> Tensor:
        """``[m, K, K]`` the inverses of the kept examples' kernel blocks plus the jitter."""
        V = prediction_variance(
            model,
            posterior,
            inputs,
            samples=samples,
            batch_size=batch_size,
            generator=generator,
            temperature=temperature,
            cross_class=True,
        ).double()
        V = (V + V.mT) / 2
        jitter = _JITTER * float(V.diagonal(dim1=-2, dim2=-1).mean())
        if not jitter > 0:
            raise ValueError(
                "posterior: gives the kept examples no prediction variance, so FROMP's kernel "
                "cannot be inverted; use use='kprior'"
            )
        eye = torch.eye(V.shape[-1], dtype=V.dtype, device=V.device)
        inverse = torch.cholesky_inverse(torch.linalg.cholesky(V + jitter * eye))
        return ((inverse + inverse.mT) / 2).to(outputs.dtype)

    # ----------------------------------------------------------------- refresh
    def refresh(
        self,
        model: nn.Module,
        *positional: Any,
        posterior: Posterior | Any = None,
        covariance: Mapping[str, Tensor] | None = None,
        head: Callable[[Tensor, int], Tensor] | None = None,
        temperature: float | None = None,
        jitter: float = FROMP_JITTER,
        batch_size: int = 256,
    ) -> None:
        r"""``"fromp"``: the targets and kernels of every stored task, recomputed at the
        model's current parameters (FROMP's code does this at the start of every task).

        For task :math:`t`'s kept inputs, :math:`p_j = \operatorname{softmax} f(x_j;\theta)`
        (a Gaussian likelihood: :math:`f`) and :math:`J_{t,c} = \partial p_{\cdot c} /
        \partial\theta`, one row per kept input, over every weight with a variance:

        .. math:: f^{\text{old}}_j \leftarrow f(x_j;\theta), \qquad
                  K_{t,c}^{-1} \leftarrow (J_{t,c}\Sigma J_{t,c}^\top + \varepsilon I)^{-1}.

        :math:`\Sigma` is diagonal: ``posterior``'s coordinate variances divided by τ (the
        untempered covariance, as :func:`~liegroup_blr.memory_maps.prediction_variance`), or
        ``covariance`` as given. Weights without a variance are held fixed. Everything after
        ``model`` is keyword-only::

            memory.refresh(model, posterior=optimizer)  # a BLR rule
            memory.refresh(model, covariance={n: 1 / (ggn[n] + 1e-5) for n in ggn})  # Adam

        Args:
            model: the network whose named parameters are the weights, in eval mode here.
            posterior: a :class:`~liegroup_blr.Posterior` of ``model``'s parameters or the
                Lie-group BLR optimizer (a group with a diagonal covariance).
            covariance: the diagonal covariance instead, by parameter name, each of its
                parameter's shape (e.g. the inverse of a summed GGN plus a prior precision).
            head: ``head(outputs, t)`` → ``[n, K]``, the outputs of stored task ``t``'s head
                from ``model``'s outputs on its inputs (a multi-head network; default: the
                outputs as they are).
            temperature: τ of ``posterior`` (default: the one it records).
            jitter: ε > 0 (FROMP's code: ``FROMP_JITTER``, 1e-5).
            batch_size: examples per vectorised Jacobian.

        Raises:
            TypeError: in one line, for arguments after ``model`` passed by position.
            ValueError: in one line, naming the argument, for another use, an empty memory,
                neither or both of ``posterior`` and ``covariance``, a posterior without a
                diagonal covariance, a covariance of unknown names, other shapes or negative
                values, a head of another number of outputs, or ε ≤ 0.
        """
        if positional:
            raise TypeError(
                f"refresh: takes the model, then keywords; got {len(positional)} more "
                "argument(s) by position; write refresh(model, posterior=...) or "
                "refresh(model, covariance=...)"
            )
        if self.use != "fromp":
            raise ValueError(
                f"refresh: use={self.use!r} keeps the targets of when each task was added; "
                "only use='fromp' refreshes"
            )
        if not len(self):
            raise ValueError("memory: empty; add_task() a finished task first")
        if (posterior is None) == (covariance is None):
            raise ValueError(
                "posterior, covariance: pass exactly one, a posterior (or the BLR optimizer) "
                "or a diagonal covariance by parameter name"
            )
        if isinstance(jitter, bool) or not (isinstance(jitter, (int, float)) and jitter > 0):
            raise ValueError(f"jitter: must be a number > 0, got {jitter!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        named = dict(model.named_parameters())
        if posterior is not None:
            variances = _posterior_variances(model, named, posterior, temperature)
        else:
            assert covariance is not None
            variances = _given_variances(named, covariance)
        params = {n: named[n].detach() for n in variances}
        outputs, inverses = [], []
        with evaluating(model):
            for t in range(self.num_tasks):
                x = self.inputs[self.tasks == t]
                f, kernel = self._task_kernel(model, params, variances, x, head, t, batch_size)
                if f.shape[1:] != self.outputs_old.shape[1:]:
                    raise ValueError(
                        f"head: gives task {t} {f.shape[1]} outputs, the memory holds "
                        f"{self.outputs_old.shape[1]}; return that task's head [n, "
                        f"{self.outputs_old.shape[1]}]"
                    )
                kernel = kernel.double()
                kernel = (kernel + kernel.mT) / 2
                eye = torch.eye(kernel.shape[-1], dtype=kernel.dtype, device=kernel.device)
                inverse = torch.cholesky_inverse(torch.linalg.cholesky(kernel + jitter * eye))
                outputs.append(f.to(self.outputs_old.device, self.outputs_old.dtype))
                inverses.append(((inverse + inverse.mT) / 2).to(f.dtype).to(x.device))
        self.outputs_old = torch.cat(outputs)
        self.task_kernel_inverse = inverses

    def _task_kernel(
        self,
        model: nn.Module,
        params: dict[str, Tensor],
        variances: dict[str, Tensor],
        x: Tensor,
        head: Callable[[Tensor, int], Tensor] | None,
        t: int,
        batch_size: int,
    ) -> tuple[Tensor, Tensor]:
        """``[m, K]`` the outputs of task t's inputs ``x`` and ``[K, m, m]`` its kernels
        :math:`J_c\\Sigma J_c^\\top`, by per-example Jacobians (``torch.func``)."""
        device = next(iter(params.values())).device

        def outputs_of(p: dict[str, Tensor], xi: Tensor) -> Tensor:
            out = functional_call(model, p, (xi[None],))
            return (out if head is None else head(out, t)).reshape(-1)

        def mean(p: dict[str, Tensor], xi: Tensor) -> tuple[Tensor, Tensor]:
            f = outputs_of(p, xi)
            return (softmax(f, dim=-1) if self.likelihood == "categorical" else f), f

        per_example = vmap(jacrev(mean, has_aux=True), in_dims=(None, 0))
        parts = [per_example(params, xb.to(device)) for xb in x.split(batch_size)]
        jac = {n: torch.cat([j[n] for j, _ in parts]).flatten(2) for n in params}  # [m, K, P]
        batches = []
        with torch.no_grad():  # the targets batched, as the loss sees them
            for xb in x.split(batch_size):
                out = model(xb.to(device))
                batches.append((out if head is None else head(out, t)).reshape(len(xb), -1))
        f = torch.cat(batches)
        kernels = [
            torch.einsum("ikp,p,jkp->kij", j, variances[n].flatten(), j) for n, j in jac.items()
        ]
        return f, torch.stack(kernels).sum(0)

    # ------------------------------------------------------------ regulariser
    def loss(self, outputs: Tensor, data_size: float, rows: Tensor | None = None) -> Tensor:
        r""":math:`R(\theta) = \frac1N\frac{M}{|B|}\sum_{j\in B} r_j`, differentiable in
        ``outputs``: each memory example counts as one example of the current task's mean
        loss, so a minibatch ``rows`` gives an unbiased estimate of the whole memory's
        :math:`\frac1N\sum_j r_j` (:math:`r_j` of the memory's ``use``: module docstring).
        ``"fromp"`` couples each task's examples through its kernels: it takes every row,
        :math:`R = \frac1N\sum_t\sum_c\frac12\Delta_{t,c}^\top K_{t,c}^{-1}\Delta_{t,c}`, so
        FROMP's objective :math:`\frac1\tau\bar\ell + \sum_t\sum_c\frac12\Delta^\top
        K^{-1}\Delta` is :math:`\frac1\tau(\bar\ell + \lambda R)` with :math:`\lambda =
        \tau N`.

        Args:
            outputs: ``[|B|, K]`` the network's outputs (logits, or the predicted mean) on
                ``inputs[rows]``, each on its task's head.
            data_size: N, the current task's training-set size (the optimizer's data_size).
            rows: the memory rows ``B`` (default: every row, in order; ``"fromp"``: None).

        Raises:
            ValueError: in one line, for an empty memory, outputs of other rows or classes,
                ``data_size`` ≤ 0, or (``"fromp"``) ``rows`` or tasks added since the last
                :meth:`refresh`.
        """
        if not len(self):
            raise ValueError("memory: empty; add_task() a finished task first")
        if isinstance(data_size, bool) or not data_size > 0:
            raise ValueError(
                f"data_size: must be > 0, the current task's training-set size; got {data_size!r}"
            )
        if self.use == "fromp" and rows is not None:
            raise ValueError(
                "rows: use='fromp' couples each task's examples through its kernels; pass "
                "the outputs of every row with rows=None"
            )
        if self.use == "fromp" and len(self.task_kernel_inverse) != self.num_tasks:
            raise ValueError(
                f"memory: {self.num_tasks - len(self.task_kernel_inverse)} task(s) added since "
                "the last refresh; call refresh(model, posterior=...) or refresh(model, "
                "covariance=...) first"
            )
        if rows is not None:
            rows = torch.as_tensor(rows, dtype=torch.long, device=self.tasks.device)
        old = self.outputs_old if rows is None else self.outputs_old[rows]
        if outputs.shape != old.shape:
            raise ValueError(
                f"outputs: shape {tuple(outputs.shape)} for {len(old)} memory rows of "
                f"{old.shape[1]} outputs; pass the outputs [rows, {old.shape[1]}] of "
                "inputs[rows]"
            )
        old = old.to(device=outputs.device, dtype=outputs.dtype)
        if self.use == "replay":
            y = self.targets if rows is None else self.targets[rows]
            y = y.to(outputs.device)
            if self.likelihood == "categorical":
                r = cross_entropy(outputs, y, reduction="none")
            else:
                r = (outputs - y.reshape(outputs.shape).to(outputs.dtype)).square().sum(-1)
                r = r / (2 * self.noise_variance)
        elif self.use == "kprior":
            if self.likelihood == "categorical":
                log_old = log_softmax(old, dim=-1)
                r = (log_old.exp() * (log_old - log_softmax(outputs, dim=-1))).sum(-1)
            else:
                r = (outputs - old).square().sum(-1) / (2 * self.noise_variance)
        elif self.use == "fromp":
            return self._fromp(outputs, old) / float(data_size)
        else:
            K_inv = self.kernel_inverse if rows is None else self.kernel_inverse[rows]
            delta = outputs - old
            K_inv = K_inv.to(device=outputs.device, dtype=outputs.dtype)
            r = torch.einsum("bk,bkl,bl->b", delta, K_inv, delta) / 2
        return r.sum() * (len(self) / len(old) / float(data_size))

    def _fromp(self, outputs: Tensor, old: Tensor) -> Tensor:
        r""":math:`\sum_t\sum_c\frac12\Delta_{t,c}^\top K_{t,c}^{-1}\Delta_{t,c}` of every
        row's ``outputs`` against the refreshed ``old`` ones (probabilities, or the mean)."""
        if self.likelihood == "categorical":
            delta = softmax(outputs, dim=-1) - softmax(old, dim=-1)
        else:
            delta = outputs - old
        tasks = self.tasks.to(outputs.device)
        total = outputs.new_zeros(())
        for t, K_inv in enumerate(self.task_kernel_inverse):
            d = delta[tasks == t]
            K_inv = K_inv.to(device=outputs.device, dtype=outputs.dtype)
            total = total + torch.einsum("ik,kij,jk->", d, K_inv, d) / 2
        return total

    # ---------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """The settings and the stored tensors (loadable with ``torch.load(weights_only=True)``)."""
        settings = {name: getattr(self, name) for name in _SETTINGS}
        fields = {name: getattr(self, name) for name in _FIELDS}
        kernels = {"task_kernel_inverse": list(self.task_kernel_inverse)}
        return {**settings, "num_tasks": self.num_tasks, **fields, **kernels}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: in one line, for a state of other settings (``per_task``,
                selection, use, likelihood, noise variance), missing a field, or saved with
                ``use="fromp"`` before it became FROMP's own (per-example kernels: now
                ``"fromp_logits"``).
        """
        missing = sorted({*_SETTINGS, "num_tasks", *_FIELDS} - set(state_dict))
        if missing:
            raise ValueError(f"state_dict: not a MemorablePast's (missing {missing})")
        if state_dict["use"] == "fromp" and "task_kernel_inverse" not in state_dict:
            raise ValueError(
                "state_dict: saved by an older version whose use='fromp' (per-example [M, K, K] "
                "kernels on the logits) is now use='fromp_logits'; set state_dict['use'] = "
                "'fromp_logits' and load it into a memory of that use"
            )
        for key in _SETTINGS:
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict: holds {key}={state_dict[key]!r}, this memory has "
                    f"{getattr(self, key)!r}; build it with MemorablePast.from_state_dict"
                )
        self.num_tasks = int(state_dict["num_tasks"])
        for name in _FIELDS:
            setattr(self, name, state_dict[name])
        self.task_kernel_inverse = list(state_dict.get("task_kernel_inverse", []))

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any]) -> MemorablePast:
        """A memory rebuilt from :meth:`state_dict`."""
        missing = sorted(set(_SETTINGS) - set(state_dict))
        if missing:
            raise ValueError(f"state_dict: not a MemorablePast's (missing {missing})")
        memory = cls(
            int(state_dict["per_task"]),
            str(state_dict["selection"]),
            str(state_dict["use"]),
            likelihood=str(state_dict["likelihood"]),
            noise_variance=float(state_dict["noise_variance"]),
        )
        memory.load_state_dict(state_dict)
        return memory

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` atomically (a temporary file moved into place)."""
        posterior_io.save(self.state_dict(), path)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu"
    ) -> MemorablePast:
        """Read a file written by :meth:`save` (``torch.load(weights_only=True)``)."""
        return cls.from_state_dict(torch.load(path, map_location=map_location, weights_only=True))


def _posterior_variances(
    model: nn.Module, named: Mapping[str, Tensor], posterior: Any, temperature: float | None
) -> dict[str, Tensor]:
    """Per parameter name, the posterior's coordinate variances over τ: a diagonal Σ."""
    post, tau = resolve_posterior(posterior, model, temperature)
    if not len(post):
        raise ValueError("posterior: holds no entries (no parameter was trained)")
    order = list(named)
    variances = {}
    for key, entry in post.items():
        reason = jacobian_obstacle(entry)
        if reason is not None:
            raise ValueError(
                f"posterior: entry {key!r}: {reason}; pass covariance= (a diagonal one) instead"
            )
        name = order[key] if isinstance(key, int) else key
        if name not in named or named[name].shape != entry.shape:
            raise ValueError(
                f"posterior: entry {key!r} is no parameter of the model's shape; pass the "
                "posterior of this model's parameters"
            )
        variance = entry.group.coordinate_variance(entry.element, entry.base)
        variances[name] = (variance / tau).to(named[name])
    return variances


def _given_variances(
    named: Mapping[str, Tensor], covariance: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """``covariance`` checked against the model's parameters (names, shapes, values ≥ 0)."""
    if not covariance:
        raise ValueError("covariance: empty; pass the variance of at least one parameter")
    variances = {}
    for name, value in covariance.items():
        if name not in named:
            raise ValueError(
                f"covariance: {name!r} is not a parameter of the model; key it by "
                "model.named_parameters()"
            )
        value = torch.as_tensor(value)
        if value.shape != named[name].shape:
            raise ValueError(
                f"covariance: {name!r} has shape {tuple(value.shape)}, its parameter "
                f"{tuple(named[name].shape)}; pass the diagonal in the parameter's shape"
            )
        if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
            raise ValueError(f"covariance: {name!r} holds a negative or non-finite variance")
        variances[name] = value.detach().to(named[name])
    return variances


def _balanced_top(scores: Tensor, labels: Tensor, keep: int) -> Tensor:
    """The rows of the ``keep`` highest ``scores``, split as evenly as possible over the
    classes in ``labels`` (round-robin, lower labels first; a class with too few examples
    gives the rest to the others): class after class, each in descending score."""
    classes = labels.unique(sorted=True)
    members = [(labels == c).nonzero().squeeze(1) for c in classes]
    quota = [0] * len(members)
    left = keep
    while left:
        for i, rows in enumerate(members):
            if left and quota[i] < len(rows):
                quota[i] += 1
                left -= 1
    chosen = []
    for rows, q in zip(members, quota, strict=True):
        order = scores[rows].sort(descending=True, stable=True).indices
        chosen.append(rows[order[:q]])
    return torch.cat(chosen)
