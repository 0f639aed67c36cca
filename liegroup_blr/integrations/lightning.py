"""Lightning: one callback, ``Trainer(callbacks=[BLRCallback()])`` (``pip install
liegroup_blr[lightning]``).

Lightning's automatic optimization already calls ``optimizer.step(closure)``, so training
needs nothing from here; the callback decides what the *other* loops see and what is saved.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl

from ..optim import BLROptimizer
from .evaluation import averaged, blr_optimizers, check_evaluate, park, point, resume

__all__ = ["BLRCallback"]


class BLRCallback(pl.Callback):
    r"""Validation, test and predict at the point estimate (or the model average), checkpoints
    holding the point estimate, and what cannot work refused before the first step.

    - **Evaluation.** With ``evaluate="point"`` (default) the validation, test and predict
      loops run at the point estimate of every Lie-group optimizer of the trainer (m,
      g⁺ − g⁻ or b), whatever the parameters hold between steps. With ``evaluate="average"``
      they run at the model average of ``samples`` posterior samples: a callback cannot change
      ``validation_step``, so for those loops the module's ``forward`` is replaced by one that
      returns :math:`\log \frac1S \sum_s \operatorname{softmax}(\text{forward}(x; \theta_s))`
      (log probabilities over the last axis: their cross-entropy with the labels is the
      average's NLL, their argmax its prediction). Each call draws S fresh samples, and the
      steps must call the module itself (``self(x)``), not a submodule.
    - **Checkpoints.** The ``state_dict`` saved in a checkpoint holds the point estimate of
      the trained parameters; the optimizer state holds the posterior and its noise
      generators, so ``trainer.fit(ckpt_path=...)`` resumes the run bit for bit (with
      ``between_steps="sample"`` it draws the same training sample again).
    - **After fit.** With ``between_steps="sample"`` the parameters hold a training sample
      between steps; at the end of training the callback writes the point estimate into them
      (and draws the training sample again if the same optimizer is trained further).
    - **Refused** (``ValueError`` at the start of fit, in automatic optimization):
      ``accumulate_grad_batches > 1`` or a mixed-precision plugin with a ``GradScaler``
      (``precision="16-mixed"`` on a GPU) with an optimizer in ``between_steps="point"``
      (Lightning then runs the training step outside ``optimizer.step()``, at the point
      estimate), and either with ``mc_samples > 1`` (one sample spans the micro-batches).

    Args:
        evaluate: ``"point"`` or ``"average"``.
        samples: S, the posterior samples of the model average.
    """

    def __init__(self, evaluate: str = "point", samples: int = 32) -> None:
        check_evaluate(evaluate, samples)
        self.evaluate = evaluate
        self.samples = samples
        self._optimizers: list[BLROptimizer] = []
        self._parked: list[BLROptimizer] = []
        self._evaluation: ExitStack | None = None

    # ------------------------------------------------------------------- fit
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._optimizers = blr_optimizers(trainer.optimizers)
        resume([o for o in self._parked if o in self._optimizers])
        self._parked = []
        if pl_module.automatic_optimization:
            for optimizer in self._optimizers:
                _check_automatic(trainer, optimizer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parked = park(self._optimizers)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        optimizers = self._optimizers or blr_optimizers(trainer.optimizers)
        trained = {p for o in optimizers for g in o.param_groups for p in g["params"]}
        state = checkpoint.get("state_dict", {})
        with point(optimizers):
            for name, p in pl_module.named_parameters():
                if p in trained and name in state:
                    state[name] = p.detach().clone()

    # ------------------------------------------------------------ evaluation
    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()
        optimizers = self._optimizers or blr_optimizers(trainer.optimizers)
        stack = ExitStack()
        if self.evaluate == "point":
            stack.enter_context(point(optimizers))
        elif not optimizers:
            raise ValueError(
                "BLRCallback(evaluate='average') needs the Lie-group optimizer: fit with this "
                "callback first (the model alone holds no posterior)"
            )
        else:
            own = vars(pl_module).get("forward")
            pl_module.forward = averaged(pl_module.forward, optimizers, self.samples)  # type: ignore[method-assign]
            stack.callback(_put_forward, pl_module, own)
        self._evaluation = stack

    def _end(
        self, trainer: pl.Trainer | None = None, pl_module: pl.LightningModule | None = None
    ) -> None:
        if self._evaluation is not None:
            evaluation, self._evaluation = self._evaluation, None
            evaluation.close()

    on_validation_start = on_test_start = on_predict_start = _begin
    on_validation_end = on_test_end = on_predict_end = _end

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._end()


def _put_forward(module: pl.LightningModule, own: Any) -> None:
    """Give ``module`` its forward back (its class's, or the instance's own)."""
    if own is None:
        del module.forward
    else:
        module.forward = own  # type: ignore[method-assign]


def _check_automatic(trainer: pl.Trainer, optimizer: BLROptimizer) -> None:
    """ValueError, in one line naming the fix, for what Lightning's automatic optimization
    cannot do right with ``optimizer``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    outside = []  # what makes Lightning run training steps outside optimizer.step()
    if trainer.accumulate_grad_batches > 1:
        outside.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
    if scaler is not None:
        outside.append(f"a GradScaler (precision={trainer.precision!r})")
    if not outside:
        return
    what = " and ".join(outside)
    if not optimizer.holds_samples:
        raise ValueError(
            f"{what}: Lightning runs training steps outside optimizer.step(), which would "
            f"compute their gradients at the point estimate; construct the optimizer with "
            f"between_steps='sample' (and mc_samples=1)"
        )
    if optimizer.mc_samples > 1:
        raise ValueError(
            f"{what}: one posterior sample spans the step (Lightning zeroes the gradients on "
            f"the first micro-batch only, GradScaler.step takes one backward pass), but the "
            f"optimizer has mc_samples={optimizer.mc_samples}; use mc_samples=1"
        )
