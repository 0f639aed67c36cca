"""The optimizers in a real Hugging Face ``Trainer`` (``pip install
liegroup_blr[transformers]``; CI installs it), on a custom MLP and on a tiny BERT built from
a config (no download): training at posterior samples with the Trainer's gradient clipping,
evaluation at the point estimate or the model average, saving and resuming.

Every run is compared with the plain loop it should equal, bit for bit: in sample mode the
Trainer's ``backward``, ``clip_grad_norm_``, ``optimizer.step()`` is that loop.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.optim import BLROptimizer
from liegroup_blr.predictive import predictive_log_probs
from tests.integrations.training_loops import (
    BATCH,
    STEPS,
    Recorder,
    assert_moved,
    assert_same,
    batches,
    elements,
    make_net,
    point_weights,
    task,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure of it
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
CLIP = 0.5


class MLP(nn.Module):
    """:func:`make_net` with the Trainer's interface: ``model(x=..., labels=...)`` returns
    ``{"loss", "logits"}``; its first layer is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.recorder = Recorder().attach(self.net[0])

    def forward(self, x: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def dataset(n: int = BATCH * STEPS) -> list[dict[str, Tensor]]:
    x, y = task(n)
    return [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]


def additive(between_steps: str = "sample", mc_samples: int = 1) -> Callable[[Any], BLROptimizer]:
    def make(params: Any) -> BLROptimizer:
        return lgb.AdditiveBLR(
            params,
            lr=0.5,
            base=Normal(0.0, 0.1),
            seed=1,
            between_steps=between_steps,
            mc_samples=mc_samples,
        )

    return make


def arguments(path: Path, **options: Any) -> Any:
    """Batches of 16, a constant learning rate, ``max_grad_norm`` = CLIP."""
    import transformers

    settings: dict[str, Any] = {
        "output_dir": str(path),
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": BATCH,
        "max_steps": STEPS,
        "lr_scheduler_type": "constant",
        "max_grad_norm": CLIP,
        "remove_unused_columns": False,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    return transformers.TrainingArguments(**{**settings, **options})


def in_order(trainer: type) -> type:
    """``trainer`` reading the training set unshuffled, as the plain loops do (the Trainer's
    own option for it, ``train_sampling_strategy``, is newer than transformers 5.0)."""

    class InOrder(trainer):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    return InOrder


def trainer_for(model: nn.Module, optimizer: Any, path: Path, **options: Any) -> Any:
    from liegroup_blr.integrations.transformers import BLRTrainer

    extra = {k: options.pop(k) for k in ("evaluate", "samples") if k in options}
    return in_order(BLRTrainer)(
        model=model,
        args=arguments(path, **options),
        train_dataset=dataset(),
        eval_dataset=dataset()[:BATCH],
        optimizers=(optimizer, None),
        **extra,
    )


def plain_loop(
    net: nn.Module, optimizer: BLROptimizer, steps: int = STEPS, clip: float | None = CLIP
) -> list[Tensor]:
    """backward, clip, step() per batch (sample mode); the point weights before each step."""
    points = []
    data = list(batches(*task()))
    for x, y in data[:steps]:
        points.append(point_weights(optimizer, net[0]))
        nn.functional.cross_entropy(net(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    points.append(point_weights(optimizer, net[0]))
    return points


# ------------------------------------------------------------------ custom MLP
def test_trainer_steps_the_clipped_gradient_at_samples_and_evaluates_at_the_point(tmp_path):
    make = additive()
    model = MLP()
    optimizer = make(model.parameters())
    initial = elements(optimizer, model.net)
    trainer = trainer_for(model, optimizer, tmp_path)
    trainer.train()

    net = make_net()
    reference = make(net.parameters())
    recorder = Recorder().attach(net[0])
    points = plain_loop(net, reference)
    assert_same(elements(optimizer, model.net), elements(reference, net))
    assert_moved(initial, elements(optimizer, model.net))
    seen = model.recorder.train_weights()
    assert len(seen) == STEPS  # one sample per update
    for w, v, point in zip(seen, recorder.train_weights(), points, strict=False):
        assert torch.equal(w, v) and not torch.equal(w, point)

    clipped_off = make_net()
    plain_loop(clipped_off, make(clipped_off.parameters()), clip=None)
    assert not torch.equal(clipped_off[0].weight, net[0].weight)  # the clipping acted

    assert torch.equal(model.net[0].weight, points[-1])  # after train(): the point estimate
    metrics = trainer.evaluate()
    assert all(torch.equal(w, points[-1]) for w in model.recorder.eval_weights())
    x, y = task(BATCH)
    with reference.point_estimate(), torch.no_grad():
        loss = nn.functional.cross_entropy(net(x), y).item()
    assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-6)


RULES: dict[str, Callable[[Any], BLROptimizer]] = {
    "additive": additive(),
    "multiplicative": lambda params: multiplicative(params),
    "affine": lambda params: lgb.AffineBLR(
        params, lr=0.1, scale_lr=0.01, data_size=64, seed=3, between_steps="sample"
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_evaluating_during_training_changes_no_step(tmp_path, rule):
    """An evaluation every 5 of 11 steps: the training forwards, group elements and
    parameters are bit for bit those of the run without (on the old main the forwards after
    the evaluations at steps 5 and 10 ran at the point estimate)."""
    runs = []
    for options in ({}, {"eval_strategy": "steps", "eval_steps": 5}):
        model = MLP()
        optimizer = RULES[rule](model.parameters())
        trainer_for(model, optimizer, tmp_path, max_steps=11, **options).train()
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        runs.append((model.recorder, elements(optimizer, model.net), weights))
    (quiet, *silent), (evaluating, *evaluated) = runs
    assert len(evaluating.eval_weights()) == 3 and not quiet.eval_weights()  # 5, 10, 11
    seen = evaluating.train_weights()
    assert len(seen) == 11
    assert all(torch.equal(w, v) for w, v in zip(seen, quiet.train_weights(), strict=True))
    for a, b in zip(evaluated, silent, strict=True):
        assert_same(a, b)


def test_trainer_evaluates_the_model_average_of_samples(tmp_path):
    model = MLP()
    optimizer = additive()(model.parameters())
    trainer = trainer_for(model, optimizer, tmp_path, evaluate="average", samples=3)
    trainer.train()
    x, y = task(BATCH)
    twin, posterior = copy.deepcopy((model.net, optimizer))  # the same generators
    log_probs = predictive_log_probs(twin, [x], posterior, samples=3)
    count = len(model.recorder.weights)
    metrics = trainer.evaluate()
    assert len(model.recorder.weights) - count == 3  # S forward passes on the one batch
    nll = nn.functional.nll_loss(log_probs, y).item()
    assert metrics["eval_loss"] == pytest.approx(nll, rel=1e-6)
    with optimizer.point_estimate(), torch.no_grad():
        at_point = nn.functional.cross_entropy(model.net(x), y).item()
    assert abs(metrics["eval_loss"] - at_point) > 1e-4
    output = trainer.predict(dataset()[:BATCH])
    probabilities = torch.as_tensor(output.predictions).exp().sum(-1)
    torch.testing.assert_close(probabilities, torch.ones(BATCH))


def test_trainer_saves_the_point_estimate_and_resumes_bit_for_bit(tmp_path):
    import transformers
    from safetensors.torch import load_file

    make = additive()

    class PointAtSave(transformers.TrainerCallback):
        points: dict[int, dict[str, Tensor]] = {}  # noqa: RUF012

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            from liegroup_blr.optim import unwrap

            model, blr = kwargs["model"], unwrap(kwargs["optimizer"])
            assert blr is not None
            held = model.net[0].weight.detach().clone()
            with blr.point_estimate():
                self.points[state.global_step] = {
                    k: v.detach().clone() for k, v in model.state_dict().items()
                }
            assert not torch.equal(held, self.points[state.global_step]["net.0.weight"])

    model = MLP()
    optimizer = make(model.parameters())
    trainer = trainer_for(model, optimizer, tmp_path / "run", save_strategy="steps", save_steps=2)
    trainer.add_callback(PointAtSave())
    trainer.train()
    saved = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert saved.keys() == PointAtSave.points[2].keys()
    for key, value in saved.items():
        assert torch.equal(value, PointAtSave.points[2][key]), key

    net = make_net()
    reference = make(net.parameters())
    plain_loop(net, reference)
    assert_same(elements(optimizer, model.net), elements(reference, net))  # saving changed nothing

    resumed = MLP()
    again = make(resumed.parameters())
    resumer = trainer_for(resumed, again, tmp_path / "resumed")
    resumer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_same(elements(again, resumed.net), elements(optimizer, model.net))
    after = model.recorder.train_weights()[2:]
    for w, v in zip(after, resumed.recorder.train_weights(), strict=True):
        assert torch.equal(w, v)  # the same samples after the resume


def test_trainer_evaluating_the_model_average_during_training_resumes_bit_for_bit(tmp_path):
    """An evaluation at the model average every step, a checkpoint at step 2, the resumed run
    equal to the uninterrupted one (on the old main the averages drew from the training noise,
    which the checkpoint's state does not hold: 1.7e-3 apart)."""
    make = additive()
    options = {"evaluate": "average", "samples": 2, "eval_strategy": "steps", "eval_steps": 1}
    model = MLP()
    optimizer = make(model.parameters())
    trainer = trainer_for(
        model, optimizer, tmp_path / "run", save_strategy="steps", save_steps=2, **options
    )
    trainer.train()
    quiet = MLP()
    silent = make(quiet.parameters())
    trainer_for(quiet, silent, tmp_path / "quiet").train()  # no evaluation at all
    assert_same(elements(optimizer, model.net), elements(silent, quiet.net))
    resumed = MLP()
    again = make(resumed.parameters())
    resumer = trainer_for(resumed, again, tmp_path / "resumed", **options)
    resumer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_same(elements(again, resumed.net), elements(optimizer, model.net))


@pytest.mark.parametrize(
    ("between_steps", "mc_samples", "fix", "engine"),
    [
        ("point", 1, "between_steps='sample'", "between_steps='sample'"),
        ("sample", 2, "use mc_samples=1", r"mc_samples=2 needs step\(closure\)"),
    ],
)
def test_what_the_trainer_cannot_step_is_refused_in_one_line(
    tmp_path, between_steps, mc_samples, fix, engine
):
    import transformers

    from liegroup_blr.integrations.transformers import BLRTrainerCallback

    make = additive(between_steps, mc_samples)
    with pytest.raises(ValueError, match=fix):
        trainer_for(MLP(), make(MLP().parameters()), tmp_path)
    model = MLP()
    optimizer = make(model.parameters())
    initial = elements(optimizer, model.net)
    refusals = (([BLRTrainerCallback()], ValueError, fix), (None, RuntimeError, engine))
    for callbacks, error, message in refusals:
        trainer = in_order(transformers.Trainer)(
            model=model,
            args=arguments(tmp_path),
            train_dataset=dataset(),
            optimizers=(optimizer, None),
            callbacks=callbacks,
        )
        with pytest.raises(error, match=message):  # without the callback: the optimizer's
            trainer.train()
    assert_same(initial, elements(optimizer, model.net))


def test_the_callback_leaves_the_point_estimate_and_a_second_train_continues_exactly(tmp_path):
    import transformers

    from liegroup_blr.integrations.transformers import BLRTrainerCallback

    make = additive()
    model = MLP()
    optimizer = make(model.parameters())
    trainer = in_order(transformers.Trainer)(
        model=model,
        args=arguments(tmp_path, max_steps=2),
        train_dataset=dataset(),
        optimizers=(optimizer, None),
        callbacks=[BLRTrainerCallback()],
    )
    trainer.train()
    assert torch.equal(model.net[0].weight, point_weights(optimizer, model.net[0]))
    trainer.train()  # the same batches again, from where the optimizer stands

    net = make_net()
    reference = make(net.parameters())
    plain_loop(net, reference, steps=2)
    plain_loop(net, reference, steps=2)
    assert_same(elements(optimizer, model.net), elements(reference, net))


# -------------------------------------------- best checkpoints, callback checkpoints
def _loss_at(weights: dict[str, Tensor]) -> float:
    net = make_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in weights.items()})
    x, y = task(BATCH)
    with torch.no_grad():
        return nn.functional.cross_entropy(net(x), y).item()


BEST = {  # "best" is the highest eval loss: never the last checkpoint here
    "eval_strategy": "steps",
    "eval_steps": 1,
    "save_strategy": "steps",
    "save_steps": 1,
    "load_best_model_at_end": True,
    "metric_for_best_model": "loss",
    "greater_is_better": True,
}


def test_load_best_model_at_end_evaluates_and_saves_the_best_checkpoint(tmp_path):
    """``BLRTrainer`` with ``load_best_model_at_end``: the Trainer loads the best checkpoint's
    weights, which are then evaluated and saved (on the old main: the last point estimate)."""
    from safetensors.torch import load_file

    model = MLP()
    trainer = trainer_for(model, additive()(model.parameters()), tmp_path / "run", **BEST)
    trainer.train()
    best = load_file(Path(trainer.state.best_model_checkpoint) / "model.safetensors")
    last = load_file(tmp_path / "run" / f"checkpoint-{STEPS}" / "model.safetensors")
    assert abs(_loss_at(best) - _loss_at(last)) > 1e-4
    assert trainer.evaluate()["eval_loss"] == pytest.approx(_loss_at(best), rel=1e-6)
    trainer.save_model(str(tmp_path / "final"))
    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(saved[k], best[k]) for k in best)


def test_the_callback_saves_and_evaluates_the_point_estimate_during_training(tmp_path):
    """A plain ``Trainer`` with ``BLRTrainerCallback``: every checkpoint holds the point
    estimate (the old main saved a training sample, and with ``load_best_model_at_end``
    restored one as "best"), evaluations run there, and training is the plain loop's."""
    import transformers
    from safetensors.torch import load_file

    from liegroup_blr.integrations.transformers import BLRTrainerCallback

    class Points(transformers.TrainerCallback):
        seen: dict[int, Tensor] = {}  # noqa: RUF012

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seen[state.global_step] = point_weights(
                kwargs["optimizer"].optimizer, model.net[0]
            )

    model = MLP()
    optimizer = additive()(model.parameters())
    trainer = in_order(transformers.Trainer)(
        model=model,
        args=arguments(tmp_path, **BEST),
        train_dataset=dataset(),
        eval_dataset=dataset()[:BATCH],
        optimizers=(optimizer, None),
        callbacks=[Points(), BLRTrainerCallback()],
    )
    trainer.train()
    for step in range(1, STEPS + 1):
        saved = load_file(tmp_path / f"checkpoint-{step}" / "model.safetensors")
        assert torch.equal(saved["net.0.weight"], Points.seen[step]), step
    evaluated = model.recorder.eval_weights()
    assert len(evaluated) == STEPS  # one evaluation after each step, each at the point
    assert all(torch.equal(w, Points.seen[s]) for s, w in enumerate(evaluated, 1))
    best = load_file(Path(trainer.state.best_model_checkpoint) / "model.safetensors")
    assert torch.equal(model.net[0].weight, best["net.0.weight"])  # a point estimate
    net = make_net()
    points = plain_loop(net, additive()(net.parameters()))  # the same training
    assert all(torch.equal(points[s], Points.seen[s]) for s in range(1, STEPS + 1))


def test_weight_decay_in_the_trainers_param_groups_is_the_gaussian_prior(tmp_path):
    """``optimizer_cls_and_kwargs`` with ``TrainingArguments(weight_decay=0.1)``: the decayed
    group's gradient gains 0.1·θ, the prior N(0, 1/(0.1 N)) (the old main ignored it, bit for
    bit the run with 0); biases, which the Trainer leaves undecayed, keep 0."""
    import transformers

    n = 64  # a power of 2: 0.1·N / N is 0.1 exactly

    def run(**options: Any) -> dict[str, Tensor]:
        model = MLP()
        kwargs = {"lr": 0.5, "base": Normal(0.0, 0.1), "seed": 1, "between_steps": "sample"}
        trainer = in_order(transformers.Trainer)(
            model=model,
            args=arguments(tmp_path, **options),
            train_dataset=dataset(),
            optimizer_cls_and_kwargs=(lgb.AdditiveBLR, {**kwargs, "data_size": n}),
        )
        trainer.train()
        return elements(trainer.optimizer.optimizer, model.net)

    decayed, plain = run(weight_decay=0.1), run(weight_decay=0.0)
    net = make_net()
    weights = [p for name, p in net.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in net.named_parameters() if name.endswith("bias")]
    reference = lgb.AdditiveBLR(
        [{"params": weights, "prior_precision": 0.1 * n}, {"params": biases}],
        lr=0.5,
        base=Normal(0.0, 0.1),
        seed=1,
        between_steps="sample",
        data_size=n,
    )
    plain_loop(net, reference, clip=CLIP)
    assert_same(decayed, elements(reference, net))
    assert any(not torch.equal(decayed[k], plain[k]) for k in decayed)


def test_a_blr_trainer_without_a_lie_group_optimizer_warns(tmp_path):
    from liegroup_blr.integrations.transformers import BLRTrainer

    model = MLP()
    trainer = BLRTrainer(model=model, args=arguments(tmp_path), train_dataset=dataset())
    with pytest.warns(UserWarning, match="not a Lie-group optimizer.*optimizers="):
        trainer.train()


# ------------------------------------------------------------------- tiny BERT
def tiny_bert() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,  # no dropout: the plain loop repeats the run exactly
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config)
    model.recorder = Recorder().attach(model.classifier)
    return model


def sentences(n: int = BATCH * STEPS) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (n, 8), generator=g)
    labels = (ids[:, 0] > 20).long()
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]


def multiplicative(params: Any) -> BLROptimizer:
    return lgb.MultiplicativeBLR(
        params,
        lr=0.05,
        data_size=64,
        temperature=0.01,
        seed=2,
        between_steps="sample",
        init="auto",
    )


def test_multiplicative_default_init_keeps_the_layer_norms_of_a_tiny_bert():
    """Once every LayerNorm weight became exactly 0 (g+ = g- from a permutation of a
    constant tensor) and the network gave every input the same output."""
    model = tiny_bert()
    lgb.MultiplicativeBLR(model.parameters(), lr=0.05, data_size=64, seed=2, init="auto")
    norms = [m.weight for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(torch.allclose(w, torch.ones_like(w), atol=1e-4) for w in norms)
    ids = torch.stack([r["input_ids"] for r in sentences(8)])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    assert logits.std(0).min() > 1e-3  # inputs are told apart


def test_tiny_bert_trains_evaluates_saves_and_resumes(tmp_path):
    from liegroup_blr.integrations.transformers import BLRTrainer

    def run(path: Path, resume: str | None = None, **options: Any) -> tuple[Any, Any, Any]:
        model = tiny_bert()
        optimizer = multiplicative(model.parameters())
        trainer = in_order(BLRTrainer)(
            model=model,
            args=arguments(path, **options),
            train_dataset=sentences(),
            eval_dataset=sentences(BATCH),
            optimizers=(optimizer, None),
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, optimizer, trainer

    model, optimizer, trainer = run(tmp_path / "run", save_strategy="steps", save_steps=2)
    norms = [m.weight for m in model.modules() if isinstance(m, nn.LayerNorm)]
    with optimizer.point_estimate():
        assert all(bool((w > 0.5).all()) for w in norms)  # never zeroed (init="auto")

    reference = tiny_bert()
    plain = multiplicative(reference.parameters())
    initial = elements(plain, reference)
    points = []
    for chunk in range(STEPS):
        rows = sentences()[chunk * BATCH : (chunk + 1) * BATCH]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        points.append(point_weights(plain, reference.classifier))
        reference(**batch).loss.backward()
        nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        plain.step()
        plain.zero_grad()
    assert_same(elements(optimizer, model), elements(plain, reference))
    assert_moved(initial, elements(optimizer, model))
    seen = model.recorder.train_weights()
    assert len(seen) == STEPS
    assert all(not torch.equal(w, p) for w, p in zip(seen, points, strict=True))

    metrics = trainer.evaluate()
    final = point_weights(plain, reference.classifier)
    assert all(torch.equal(w, final) for w in model.recorder.eval_weights())
    rows = sentences(BATCH)
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    with plain.point_estimate(), torch.no_grad():
        loss = reference.eval()(**batch).loss.item()
    assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-5)

    resumed, again, _ = run(tmp_path / "resumed", resume=str(tmp_path / "run" / "checkpoint-2"))
    assert_same(elements(again, resumed), elements(optimizer, model))


def test_a_resume_takes_the_checkpoint_s_weights_without_adopting_them(tmp_path):
    """``train(resume_from_checkpoint=...)`` loads the checkpoint's weights before its
    optimizer state, which replaces the posterior: no warning of weights written outside the
    optimizer, the run bit for bit the uninterrupted one. A checkpoint without optimizer state
    has its weights adopted as the posterior's location, with the warning."""
    import shutil
    import warnings

    make = additive()
    model = MLP()
    optimizer = make(model.parameters())
    trainer_for(model, optimizer, tmp_path / "run", save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    resumed = MLP()
    again = make(resumed.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for(resumed, again, tmp_path / "resumed").train(
            resume_from_checkpoint=str(checkpoint)
        )
    assert not [w for w in caught if "written outside the optimizer" in str(w.message)]
    assert_same(elements(again, resumed.net), elements(optimizer, model.net))

    weights_only = tmp_path / "weights-only"
    shutil.copytree(checkpoint, weights_only)
    (weights_only / "optimizer.pt").unlink()
    fresh = MLP()
    with pytest.warns(UserWarning, match="written outside the optimizer"):
        trainer_for(fresh, make(fresh.parameters()), tmp_path / "fresh").train(
            resume_from_checkpoint=str(weights_only)
        )
