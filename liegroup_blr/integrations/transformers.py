"""Hugging Face ``Trainer`` (``pip install liegroup_blr[transformers]``): the subclass
:class:`BLRTrainer`, or the callback :class:`BLRTrainerCallback` where a callback suffices.

The Trainer calls ``loss.backward()`` (through accelerate), clips the gradients
(``max_grad_norm``) and calls ``optimizer.step()`` without a closure. That is one posterior
sample per update, read from ``p.grad``: the optimizer needs ``between_steps="sample"``
(the parameters then hold a fresh sample between steps) and ``mc_samples=1``, and the
clipping then acts on exactly what the update reads.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from ..optim import BLROptimizer, unwrap
from .evaluation import averaged, blr_optimizers, check_evaluate, park, point, resume

__all__ = ["BLRTrainer", "BLRTrainerCallback"]


def check_optimizer(optimizer: Any) -> None:
    """ValueError, in one line naming the fix, unless ``optimizer`` (or what it wraps) can
    take the Trainer's closure-free ``step()``; optimizers of other kinds pass."""
    blr = unwrap(optimizer, BLROptimizer)
    if blr is None:
        return
    if not blr.holds_samples:
        raise ValueError(
            f"{type(blr).__name__} with between_steps='point': the Trainer calls "
            "optimizer.step() without a closure, after computing the gradients itself; "
            "construct the optimizer with between_steps='sample'"
        )
    if blr.mc_samples > 1:
        raise ValueError(
            f"{type(blr).__name__} with mc_samples={blr.mc_samples}: the Trainer's step() "
            "takes one posterior sample, the one its forward pass ran at; use mc_samples=1"
        )


def _warn_unless_blr(optimizer: Any, args: Any) -> None:
    """Warn, naming how to pass a Lie-group optimizer, when ``optimizer`` (an instance or a
    class) is not one: the Trainer then trains without a posterior."""
    kind = (
        optimizer
        if isinstance(optimizer, type)
        else type(unwrap(optimizer, BLROptimizer) or optimizer)
    )
    if issubclass(kind, BLROptimizer):
        return
    warnings.warn(
        f"BLRTrainer trains with {kind.__name__} (TrainingArguments.optim={args.optim!r}), not "
        "a Lie-group optimizer, so there is no posterior to evaluate or save: pass "
        "optimizers=(liegroup_blr.AffineBLR(model.parameters(), ..., between_steps='sample'), "
        "None) or optimizer_cls_and_kwargs=(liegroup_blr.AffineBLR, {..., 'between_steps': "
        "'sample'})",
        UserWarning,
        stacklevel=3,
    )


class BLRTrainerCallback(transformers.TrainerCallback):
    """What a callback can do for a Lie-group optimizer in a ``Trainer``.

    - Refuses, at the start of ``train()``, an optimizer that cannot take the Trainer's
      closure-free step (``between_steps="point"``, or ``mc_samples > 1``), in one line
      naming the fix.
    - Checkpoints and evaluations during training run at the point estimate: after a step
      that the Trainer follows with a save or an evaluation, the parameters hold the point
      estimate (in ``between_steps="sample"`` they hold a training sample between steps)
      until the save or the evaluation is done; then the training sample is drawn again, bit
      for bit, so training goes on exactly as without them.
    - At the end of ``train()`` writes the point estimate into the parameters, so the model
      saved, served or evaluated after training is the point estimate; a further ``train()``
      draws the training sample again first. With ``load_best_model_at_end`` the best
      checkpoint's weights, which the Trainer loads, are adopted as the posterior's location
      (its spread stays the last state's: the Trainer loads weights, not the optimizer).

    A callback cannot change the forward pass: only :class:`BLRTrainer` evaluates at the
    model average (``evaluate="average"``).
    """

    def __init__(self) -> None:
        self._parked: list[BLROptimizer] = []  # for an evaluation or a save during training
        self._ended: list[BLROptimizer] = []  # at the end of training, for the next train()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        check_optimizer(optimizer)
        resume([o for o in self._ended if o is unwrap(optimizer, BLROptimizer)])
        self._parked, self._ended = [], []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save or control.should_evaluate:  # set by the flow callback before
            self._parked = park(blr_optimizers([kwargs.get("optimizer")]))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not control.should_save:  # else the save follows: resumed after it
            self._resume()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._resume()

    def _resume(self) -> None:
        resume(self._parked)
        self._parked = []

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ended = park(blr_optimizers([kwargs.get("optimizer")]))


class BLRTrainer(transformers.Trainer):
    r"""A ``Trainer`` for the Lie-group optimizers (``between_steps="sample"``).

    Everything :class:`BLRTrainerCallback` does (it adds one), and:

    - ``evaluate`` and ``predict`` (also the evaluations during training) run at the point
      estimate of the optimizer (``evaluate="point"``, default), or at the model average of
      ``samples`` posterior samples (``evaluate="average"``): each batch's logits are then
      :math:`\log \frac1S \sum_s \operatorname{softmax}(\text{logits}(x; \theta_s))` (log
      probabilities; S fresh samples per batch) and, with labels, the loss is the NLL of
      that average (classification: logits ``(..., K)``, integer labels, -100 ignored).
    - ``save_model`` (also in checkpoints) saves the point estimate; the optimizer state
      saved beside it holds the posterior and its noise generators, so
      ``train(resume_from_checkpoint=...)`` continues the run bit for bit.

    Args:
        *args: as for ``transformers.Trainer``; an optimizer given in
            ``optimizers=(optimizer, scheduler)`` is checked at once.
        evaluate: ``"point"`` or ``"average"``.
        samples: S, the posterior samples of the model average.
        **kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, evaluate: str = "point", samples: int = 32, **kwargs: Any):
        check_evaluate(evaluate, samples)
        self.evaluate_at = evaluate
        self.samples = samples
        super().__init__(*args, **kwargs)
        check_optimizer(self.optimizer)
        given = self.optimizer_cls_and_kwargs
        if self.optimizer is not None or given is not None:
            _warn_unless_blr(self.optimizer or given[0], self.args)  # type: ignore[index]
        self.add_callback(BLRTrainerCallback())

    def _posterior(self) -> list[BLROptimizer]:
        return blr_optimizers([self.optimizer])

    def _evaluating(self) -> list[BLROptimizer]:
        """The optimizers whose point estimate evaluation holds (none for the average,
        which draws its samples itself)."""
        return self._posterior() if self.evaluate_at == "point" else []

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The checkpoint's weights, its point estimate. Where its optimizer state follows
        (``optimizer.pt``, ``.bin`` or a folder), which replaces the posterior, the optimizers
        take the weights as written by themselves, not as outside writes to adopt as the
        posterior's location (and warn of) at the Trainer's next call."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if any(name.startswith("optimizer") for name in os.listdir(resume_from_checkpoint)):
            for optimizer in self._posterior():
                optimizer._writes.mark()

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        check_optimizer(optimizer)
        _warn_unless_blr(optimizer, self.args)
        return optimizer

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with point(self._evaluating()):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with point(self._evaluating()):
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        with point(self._posterior()):
            super().save_model(output_dir, _internal_call)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        optimizers = self._posterior()
        if self.evaluate_at == "point" or not optimizers:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        labels: list[Tensor | None] = []

        def logits() -> Tensor:
            _, out, label = super(BLRTrainer, self).prediction_step(
                model, inputs, False, ignore_keys
            )
            if not isinstance(out, Tensor):
                raise TypeError(
                    "BLRTrainer(evaluate='average') averages the softmax of one logits "
                    f"tensor; the model gave {type(out).__name__} (pass ignore_keys)"
                )
            labels[:] = [label]
            return out

        log_probs = averaged(logits, optimizers, self.samples)()
        label = labels[0]
        loss = None
        if isinstance(label, Tensor):
            flat = log_probs.reshape(-1, log_probs.shape[-1])
            loss = nn.functional.nll_loss(flat, label.reshape(-1).to(flat.device))
        if prediction_loss_only:
            return loss, None, None
        return loss, log_probs, label
