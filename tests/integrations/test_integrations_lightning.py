"""The optimizers in a real Lightning Trainer (``pip install liegroup_blr[lightning]``; CI
installs it): automatic and manual optimization, checkpoints, gradient accumulation, mixed
precision and :class:`~liegroup_blr.integrations.lightning.BLRCallback`.

Every run is compared with the plain loop it should equal (same network, data, optimizer
seed), bit for bit, and the first layer's weights at every forward pass are recorded: the
training passes must run at posterior samples, the evaluation passes at the point estimate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Normal
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import liegroup_blr as lgb
from liegroup_blr.optim import BLROptimizer
from liegroup_blr.predictive import log_mean_softmax
from tests.integrations.training_loops import (
    BATCH,
    STEPS,
    Recorder,
    assert_moved,
    assert_same,
    batches,
    closure_loop,
    cross_entropy,
    elements,
    make_net,
    point_weights,
    task,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def additive(between_steps: str = "point", mc_samples: int = 1) -> Callable[[Any], BLROptimizer]:
    def make(params: Any) -> BLROptimizer:
        # the default between_steps="point" is left out: these tests also run on releases
        # that predate the option (the silent failures they catch)
        mode = {} if between_steps == "point" else {"between_steps": between_steps}
        return lgb.AdditiveBLR(
            params, lr=0.5, base=Normal(0.0, 0.1), mc_samples=mc_samples, seed=1, **mode
        )

    return make


def classifier(
    make_optimizer: Callable[[Any], BLROptimizer],
    manual: Callable[[Any, Tensor, Tensor], None] | None = None,
    scheduler: Callable[[BLROptimizer], dict[str, Any]] | None = None,
) -> Any:
    """A LightningModule around :func:`make_net` whose first layer is recorded."""
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.recorder = Recorder().attach(self.net[0])
            self.automatic_optimization = manual is None

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x)

        def training_step(self, batch: list[Tensor], index: int) -> Tensor | None:
            if manual is not None:
                manual(self, *batch)
                return None
            return cross_entropy(self, *batch)

        def validation_step(self, batch: list[Tensor], index: int) -> None:
            self.log("val_loss", cross_entropy(self, *batch))

        def test_step(self, batch: list[Tensor], index: int) -> None:
            self.log("test_loss", cross_entropy(self, *batch))

        def predict_step(self, batch: list[Tensor], index: int) -> Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            optimizer = make_optimizer(self.parameters())
            if scheduler is None:
                return optimizer
            return {"optimizer": optimizer, "lr_scheduler": scheduler(optimizer)}

    return Classifier()


def loader(x: Tensor, y: Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def fit(model: Any, callbacks: list[Any] | None = None, **options: Any) -> Any:
    """``trainer.fit`` on the task (unshuffled); the trainer."""
    import lightning.pytorch as pl

    x, y = task()
    ckpt_path = options.pop("ckpt_path", None)
    val = options.pop("val", None)
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    if callbacks is None:
        from liegroup_blr.integrations.lightning import BLRCallback

        callbacks = [BLRCallback()]
    settings["callbacks"] = callbacks
    trainer = pl.Trainer(**{**settings, **options})
    trainer.fit(model, loader(x, y), val, ckpt_path=ckpt_path)
    return trainer


def start(make_optimizer: Callable[[Any], BLROptimizer]) -> tuple[nn.Sequential, BLROptimizer]:
    net = make_net()
    return net, make_optimizer(net.parameters())


# ------------------------------------------------------------ automatic optimization
def test_automatic_mc_samples_scheduler_and_clipping_equal_the_closure_loop():
    """mc_samples=2: Lightning's closure runs at two fresh samples per step (clipped each),
    the scheduler steps per update, and the run equals the plain closure loop."""
    make = additive(mc_samples=2)
    model = classifier(
        make, scheduler=lambda o: {"scheduler": StepLR(o, 1, gamma=0.5), "interval": "step"}
    )
    trainer = fit(model, [], gradient_clip_val=0.1)  # training needs no callback
    optimizer = trainer.optimizers[0]
    assert optimizer is not None

    net, reference = start(make)
    initial = elements(reference, net)
    recorder = Recorder().attach(net[0])
    schedule = StepLR(reference, 1, gamma=0.5)
    points = closure_loop(net, reference, list(batches(*task())), 0.1, schedule.step)
    assert_same(elements(optimizer, model.net), elements(reference, net))
    assert_moved(initial, elements(optimizer, model.net))
    assert optimizer.param_groups[0]["lr"] == 0.5 * 0.5**STEPS

    seen = model.recorder.train_weights()
    assert len(seen) == 2 * STEPS  # mc_samples forward passes per update
    for step in range(STEPS):
        first, second = seen[2 * step], seen[2 * step + 1]
        assert not torch.equal(first, second)
        assert not torch.equal(first, points[step]) and not torch.equal(second, points[step])
    for a, b in zip(seen, recorder.train_weights(), strict=True):
        assert torch.equal(a, b)

    unclipped_net, unclipped = start(make)
    closure_loop(unclipped_net, unclipped, list(batches(*task())), None)
    assert not torch.equal(unclipped_net[0].weight, net[0].weight)  # the clipping acted


@pytest.mark.parametrize("between_steps", ["point", "sample"])
def test_checkpoint_holds_the_point_estimate_and_resumes_bit_for_bit(tmp_path, between_steps):
    import lightning.pytorch as pl

    from liegroup_blr.integrations.lightning import BLRCallback

    def make(params: Any) -> BLROptimizer:
        return lgb.AffineBLR(
            params, lr=0.2, scale_lr=0.05, data_size=64, seed=3, between_steps=between_steps
        )

    full = classifier(make)  # two epochs of two batches
    full_trainer = fit(full, max_epochs=2, limit_train_batches=2)

    class PointAtSave(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == 2 and not hasattr(self, "point"):
                with trainer.optimizers[0].point_estimate():  # type: ignore[union-attr]
                    self.point = {k: v.clone() for k, v in module.state_dict().items()}
                self.held = {k: v.clone() for k, v in module.state_dict().items()}

    saving = pl.callbacks.ModelCheckpoint(tmp_path, save_top_k=-1)  # at the epoch's end
    seen = PointAtSave()
    callbacks = [BLRCallback(), seen, saving]
    fit(classifier(make), callbacks, limit_train_batches=2, enable_checkpointing=True)
    (path,) = tmp_path.glob("*step=2.ckpt")
    checkpoint = torch.load(path, weights_only=False)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(value, seen.point[key]), key
    if between_steps == "sample":  # the parameters held a sample when it was saved
        assert not torch.equal(seen.held["net.0.weight"], seen.point["net.0.weight"])

    resumed = classifier(make)
    resumed_trainer = fit(resumed, ckpt_path=path, max_epochs=2, limit_train_batches=2)
    a, b = (t.optimizers[0] for t in (full_trainer, resumed_trainer))
    assert a is not None and b is not None
    assert_same(elements(a, full.net), elements(b, resumed.net))
    after = full.recorder.train_weights()[2:]
    for w, v in zip(after, resumed.recorder.train_weights(), strict=True):
        assert torch.equal(w, v)  # the same samples after the resume


def test_validating_at_the_model_average_keeps_training_and_resumes_bit_for_bit(tmp_path):
    """``BLRCallback(evaluate="average")`` validating after every epoch in sample mode: the
    same training as without validation, and a resume from the checkpoint taken after the
    first validation equals the uninterrupted run (on the old main: 1.3e-2 apart)."""
    import lightning.pytorch as pl

    from liegroup_blr.integrations.lightning import BLRCallback

    def make(params: Any) -> BLROptimizer:
        return lgb.AffineBLR(
            params, lr=0.2, scale_lr=0.05, data_size=64, seed=3, between_steps="sample"
        )

    val = loader(*task(BATCH, seed=1))
    options = {"max_epochs": 2, "limit_train_batches": 2, "val": val}
    full = classifier(make)
    full_trainer = fit(full, [BLRCallback(evaluate="average", samples=2)], **options)
    quiet = classifier(make)
    quiet_trainer = fit(quiet, max_epochs=2, limit_train_batches=2)
    a, q = full_trainer.optimizers[0], quiet_trainer.optimizers[0]
    assert_same(elements(a, full.net), elements(q, quiet.net))
    saving = pl.callbacks.ModelCheckpoint(tmp_path, save_top_k=-1)
    callbacks = [BLRCallback(evaluate="average", samples=2), saving]
    fit(classifier(make), callbacks, **{**options, "max_epochs": 1}, enable_checkpointing=True)
    (path,) = tmp_path.glob("*.ckpt")
    resumed = classifier(make)
    callbacks = [BLRCallback(evaluate="average", samples=2)]
    resumed_trainer = fit(resumed, callbacks, ckpt_path=path, **options)
    assert_same(elements(a, full.net), elements(resumed_trainer.optimizers[0], resumed.net))


def test_accumulate_grad_batches_in_sample_mode_is_one_sample_on_both_micro_batches():
    make = additive("sample")
    model = classifier(make)
    trainer = fit(model, accumulate_grad_batches=2)
    optimizer = trainer.optimizers[0]
    assert optimizer is not None

    net, reference = start(make)
    initial = elements(reference, net)
    data = list(batches(*task()))
    points = []
    for pair in (data[:2], data[2:]):
        points.append(point_weights(reference, net[0]))
        reference.zero_grad()
        for x, y in pair:
            (cross_entropy(net, x, y) / 2).backward()
        reference.step()
    assert_same(elements(optimizer, model.net), elements(reference, net))
    assert_moved(initial, elements(reference, net))

    seen = model.recorder.train_weights()
    assert len(seen) == 4
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])  # one sample a step
    assert not torch.equal(seen[0], seen[2])
    assert not torch.equal(seen[0], points[0]) and not torch.equal(seen[2], points[1])


@pytest.mark.parametrize(
    ("between_steps", "mc_samples", "fix"),
    [("point", 1, "between_steps='sample'"), ("point", 2, "between_steps='sample'"),
     ("sample", 2, "mc_samples=1")],
)  # fmt: skip
@pytest.mark.parametrize("callback", [True, False], ids=["callback", "engine"])
def test_accumulate_grad_batches_is_refused_where_it_cannot_be_right(
    between_steps, mc_samples, fix, callback
):
    """With the callback: at the start of fit; without it: the optimizer's own error, at
    the first update, reaches the user."""
    make = additive(between_steps, mc_samples)
    model = classifier(make)
    initial = elements(*reversed(start(make)))
    error = ValueError if callback else RuntimeError
    with pytest.raises(error, match=fix):
        fit(model, [] if not callback else None, accumulate_grad_batches=2)
    optimizer = model.trainer.optimizers[0]
    assert_same(initial, elements(optimizer, model.net))  # no update happened


def test_bf16_mixed_on_cpu_trains_at_samples_like_the_autocast_loop():
    make = additive(mc_samples=2)
    model = classifier(make)
    trainer = fit(model, precision="bf16-mixed")
    optimizer = trainer.optimizers[0]
    assert optimizer is not None

    net, reference = start(make)
    initial = elements(reference, net)
    for x, y in batches(*task()):

        def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
            reference.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = cross_entropy(net, x, y)
            loss.backward()
            return loss

        reference.step(closure)
    assert_same(elements(optimizer, model.net), elements(reference, net))
    assert_moved(initial, elements(reference, net))
    training = [d for d, t in zip(model.recorder.dtypes, model.recorder.training, strict=True) if t]
    assert training == [torch.bfloat16] * (2 * STEPS)
    assert all(v.dtype == torch.float32 for v in elements(optimizer, model.net).values())


def test_mixed_precision_plugin_with_a_grad_scaler_steps_the_sample_it_ran_at():
    """Lightning's fp16 path (the plugin a GPU gets for precision="16-mixed"), run on the
    CPU with a CPU GradScaler: the closure runs outside step(), then scaler.step(optimizer);
    in sample mode that equals the autocast + GradScaler plain loop."""
    from lightning.pytorch.plugins import MixedPrecision

    make = additive("sample")
    model = classifier(make)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = fit(model, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    optimizer = trainer.optimizers[0]
    assert optimizer is not None

    net, reference = start(make)
    initial = elements(reference, net)
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for x, y in batches(*task()):
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = cross_entropy(net, x, y)
        plain.scale(loss).backward()
        plain.step(reference)
        plain.update()
    assert_same(elements(optimizer, model.net), elements(reference, net))
    assert_moved(initial, elements(reference, net))
    training = [d for d, t in zip(model.recorder.dtypes, model.recorder.training, strict=True) if t]
    assert training == [torch.float16] * STEPS


@pytest.mark.parametrize("callback", [True, False], ids=["callback", "engine"])
def test_mixed_precision_plugin_with_a_grad_scaler_is_refused_in_point_mode(callback):
    from lightning.pytorch.plugins import MixedPrecision

    model = classifier(additive("point"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with pytest.raises(ValueError if callback else RuntimeError, match="between_steps='sample'"):
        fit(model, None if callback else [], plugins=[MixedPrecision("16-mixed", "cpu", scaler)])


# ------------------------------------------------------------------ evaluation
def test_validation_test_and_predict_run_at_the_point_estimate_in_sample_mode():
    make = additive("sample")
    model = classifier(make)
    x, y = task()
    trainer = fit(model, val=loader(x[:BATCH], y[:BATCH]), val_check_interval=2)
    optimizer = trainer.optimizers[0]
    assert optimizer is not None

    net, reference = start(make)
    points = []
    for x_, y_ in batches(x, y):
        points.append(point_weights(reference, net[0]))
        reference.zero_grad()
        cross_entropy(net, x_, y_).backward()
        reference.step()
    points.append(point_weights(reference, net[0]))
    # validation after steps 2 and 4 did not disturb training: the same run as without it
    assert_same(elements(optimizer, model.net), elements(reference, net))
    validation = model.recorder.eval_weights()
    assert len(validation) == 2
    assert torch.equal(validation[0], points[2]) and torch.equal(validation[1], points[4])
    for seen, point in zip(model.recorder.train_weights(), points, strict=False):
        assert not torch.equal(seen, point)  # training ran at samples

    # after fit the parameters hold the point estimate; test and predict run there too
    assert torch.equal(model.net[0].weight, points[4])
    trainer.test(model, loader(x, y), verbose=False)
    trainer.predict(model, loader(x, y))
    assert all(torch.equal(w, points[4]) for w in model.recorder.eval_weights()[2:])
    assert len(model.recorder.eval_weights()) == 2 + 2 * STEPS


def test_predict_at_the_model_average_of_samples():
    from liegroup_blr.integrations.lightning import BLRCallback

    make = additive("sample")
    model = classifier(make)
    trainer = fit(model, [BLRCallback(evaluate="average", samples=3)])
    optimizer = trainer.optimizers[0]
    assert optimizer is not None
    x, y = task()
    net, twin = copy.deepcopy((model.net, optimizer))  # the same posterior and generators
    expected = []
    for x_, _ in batches(x, y):
        logits = []
        for _ in range(3):
            with twin.sampled_params(), torch.no_grad():
                logits.append(net.eval()(x_))
        expected.append(log_mean_softmax(torch.stack(logits)))
    count = len(model.recorder.weights)
    predictions = trainer.predict(model, loader(x, y))
    assert len(model.recorder.weights) - count == 3 * STEPS  # S forward passes a batch
    for got, want in zip(predictions, expected, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got.logsumexp(-1), torch.zeros(len(got)))
    assert "forward" not in vars(model)  # the module's own forward is back
    point = model(x[:BATCH])
    assert not torch.allclose(predictions[0], torch.log_softmax(point, -1))


# --------------------------------------------------------- manual optimization
def manual_closure(module: Any, x: Tensor, y: Tensor) -> None:
    optimizer = module.optimizers()

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = cross_entropy(module, x, y)
        module.manual_backward(loss)
        return loss

    optimizer.step(closure)


def manual_sample(module: Any, x: Tensor, y: Tensor) -> None:
    optimizer = module.optimizers()
    optimizer.zero_grad()
    module.manual_backward(cross_entropy(module, x, y))
    optimizer.step()


def manual_blocks(module: Any, x: Tensor, y: Tensor) -> None:
    optimizer = module.optimizers()
    with optimizer.sampled_params(train=True):
        optimizer.zero_grad()
        module.manual_backward(cross_entropy(module, x, y))
    optimizer.step()


def plain_sample(net: nn.Module, optimizer: BLROptimizer, x: Tensor, y: Tensor) -> None:
    optimizer.zero_grad()
    cross_entropy(net, x, y).backward()
    optimizer.step()


def plain_blocks(net: nn.Module, optimizer: BLROptimizer, x: Tensor, y: Tensor) -> None:
    with optimizer.sampled_params(train=True):
        optimizer.zero_grad()
        cross_entropy(net, x, y).backward()
    optimizer.step()


def plain_closure(net: nn.Module, optimizer: BLROptimizer, x: Tensor, y: Tensor) -> None:
    closure_loop(net, optimizer, [(x, y)])


@pytest.mark.parametrize(
    ("manual", "plain", "between_steps", "mc_samples"),
    [
        (manual_closure, plain_closure, "point", 2),
        (manual_closure, plain_closure, "sample", 2),
        (manual_sample, plain_sample, "sample", 1),
        (manual_blocks, plain_blocks, "point", 1),
    ],
    ids=["closure-point", "closure-sample", "manual_backward-sample", "sampled_params-point"],
)
def test_manual_optimization_through_self_optimizers_equals_the_plain_loop(
    manual, plain, between_steps, mc_samples
):
    """Every update equals the plain loop's: the first one too (a `sampled_params(train=True)`
    block counted through Lightning's wrapper once made it exactly 3x the right one)."""
    make = additive(between_steps, mc_samples)
    model = classifier(make, manual=manual)
    trainer = fit(model, [], max_steps=1)  # training needs no callback
    optimizer = trainer.optimizers[0]
    assert optimizer is not None

    net, reference = start(make)
    initial = elements(reference, net)
    x, y = next(batches(*task()))
    plain(net, reference, x, y)
    assert_same(elements(optimizer, model.net), elements(reference, net))
    assert_moved(initial, elements(reference, net))
    assert len(model.recorder.train_weights()) == mc_samples


# ------------------------------------------------------- writes to the parameters
@pytest.mark.parametrize("between_steps", ["point", "sample"])
def test_a_callback_that_clamps_the_weights_after_every_step_is_not_undone(between_steps):
    """A Lightning callback that clamps the weights to ±0.05 after each batch: the posterior's
    location stays clamped (on the old main the optimizer undid the clamp at every step)."""
    import lightning.pytorch as pl

    class Clamp(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            with torch.no_grad():
                for p in module.parameters():
                    p.clamp_(-0.05, 0.05)

    model = classifier(additive(between_steps))
    with pytest.warns(UserWarning, match="written outside the optimizer"):
        trainer = fit(model, [blr_callback(), Clamp()], max_epochs=2)
    optimizer, bound = trainer.optimizers[0], torch.tensor(0.05)  # in float32
    for p in model.net.parameters():  # after fit: the point estimate, clamped
        assert bool(p.abs().max() <= bound)
        assert bool(optimizer.group_element(p)["m"].abs().max() <= bound)


def blr_callback(**options: Any) -> Any:
    from liegroup_blr.integrations.lightning import BLRCallback

    return BLRCallback(**options)


def _loss_at(state_dict: dict[str, Tensor], x: Tensor, y: Tensor) -> float:
    net = make_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in state_dict.items()})
    with torch.no_grad():
        return cross_entropy(net, x, y).item()


@pytest.mark.parametrize("between_steps", ["point", "sample"])
def test_test_and_validate_with_the_best_checkpoint_score_that_checkpoint(tmp_path, between_steps):
    """``trainer.test(ckpt_path="best")`` / ``validate(ckpt_path="best")``: Lightning loads the
    best checkpoint's weights; with BLRCallback they are the point estimate evaluated (on the
    old main the callback wrote the last point estimate over them)."""
    import lightning.pytorch as pl

    x, y = task()
    val = loader(*task(BATCH, seed=1))
    best = pl.callbacks.ModelCheckpoint(tmp_path, monitor="val_loss", mode="max")  # not the last
    model = classifier(additive(between_steps))
    trainer = fit(model, [blr_callback(), best], val=val, max_epochs=3, enable_checkpointing=True)
    checkpoint = torch.load(best.best_model_path, weights_only=False)
    last = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = _loss_at(checkpoint["state_dict"], x, y)
    assert abs(expected - _loss_at(last, x, y)) > 1e-3  # the best is not the last
    with pytest.warns(UserWarning, match="written outside the optimizer"):
        (tested,) = trainer.test(model, loader(x, y), ckpt_path="best", verbose=False)
    assert tested["test_loss"] == pytest.approx(expected, rel=1e-6)
    (validated,) = trainer.validate(model, loader(x, y), ckpt_path="best", verbose=False)
    assert validated["val_loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("between_steps", ["point", "sample"])
def test_stochastic_weight_averaging_keeps_its_average(between_steps):
    """Lightning's StochasticWeightAveraging copies its average into the module at the end of
    fit: it stands (in sample mode the old main overwrote it with the point estimate) and
    validate() scores it (the old main scored the point estimate)."""
    import lightning.pytorch as pl

    x, y = task()
    swa = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1)
    model = classifier(additive(between_steps))
    with pytest.warns(UserWarning, match="written outside the optimizer"):
        trainer = fit(model, [blr_callback(), swa], max_epochs=4)
        (validated,) = trainer.validate(model, loader(x, y), verbose=False)
    assert swa._average_model is not None
    average = dict(swa._average_model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), average[name].detach()), name
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert validated["val_loss"] == pytest.approx(_loss_at(state, x, y), rel=1e-6)
