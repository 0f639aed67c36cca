r"""Continual learning on a stream of tasks: fine-tuning, online EWC, joint training, and the
Lie-group rules with each task's posterior as the next task's prior.

    python -m experiments.continual.learn CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]

CONFIG has the tables ``[stream]`` (``name = "permuted"`` or ``"split"``, ``tasks``,
``heads``, ``dataset``), ``[model]``, ``[train]``, ``[eval]`` and one ``[methods.LABEL]``
per method, with its ``strategy`` and an ``[methods.LABEL.optimizer]`` table
(experiments/common/config.py's optimizer keys):

- ``finetune``: SGD or Adam on each task in turn, nothing else;
- ``ewc``: the same plus the online EWC penalty (experiments/continual/ewc.py, ``ewc_lambda`` λ and
  ``ewc_gamma`` γ);
- ``joint``: on task t, train on the union of tasks 1 … t (the upper reference: it keeps
  every task's data);
- ``posterior``: a Lie-group rule; the first task with its δ-prior, then at every task
  boundary ``optimizer.next_task(data_size=N_t, strength=prior_strength)``, which makes the
  posterior learned so far (raised to the power ``prior_strength``, 1 = sequential Bayes) the
  prior of the next task. ``prior = "initial"`` is its ablation: the same boundary, but every
  task keeps the first task's N(0, 1/δ) prior and entropy term (the rule fine-tunes).
  ``prior = "delta"`` is the K-prior's weight term (``next_task(prior="delta")``): the
  N(0, 1/δ) prior centred on the point estimate that ended the task; ``prior = "none"``
  drops the prior (FROMP's code has no weight term). With a memory, ``"posterior"`` counts
  the kept examples' task twice (in the posterior and in the memory's term).

Every strategy but ``joint`` takes a memory: ``memory = m`` > 0 keeps m examples of every
finished task in a :class:`liegroup_blr.MemorablePast` (``memory_selection``: ``"lambda"``,
FROMP's class-balanced λ; ``"random"``; ``"sensitivity"``, the memory-map score) with the
model's prediction on them at the end of their task, and adds ``memory_strength`` times its
term (``memory_use``: ``"kprior"``, the KL from the old prediction to the new;
``"fromp_logits"``, the logits' distance weighted by per-example kernels; ``"replay"``, the
hard labels' NLL) on a minibatch of the memory as large as the data's, each memory example
counted as one of the task's N_t examples and scored on its task's head. The memory-map score
and ``"fromp_logits"``'s kernel need a posterior (``posterior`` methods only).
``memory_use = "fromp"`` is FROMP as its code defines it: the probabilities' distance in
per-class kernels over each task's points, on every memory row at every step, targets and
kernels recomputed from the current weights for every stored task at each task boundary;
its Σ is the posterior's (a rule) or the inverse of the diagonal GGN summed over the finished
tasks' training examples plus ``memory_prior_precision`` (fine-tuning, EWC). FROMP's
objective (1/τ)·mean loss + Σ ½ΔᵀK⁻¹Δ is ``memory_strength`` = τ·N_t with the gradient norm
clipped at τ times FROMP's clip.

``[train]`` ``schedule``: ``"cosine"`` (restarted every task, after ``warmup`` epochs) or
``"constant"``; ``clip_norm`` > 0 clips the norm of every gradient a closure computes (0:
none); ``restart_optimizer = true`` restarts a baseline optimizer's state (Adam's moments and
step count) at every task boundary, as FROMP's code does; ``drop_last = false`` trains on the
last partial minibatch of every pass too (as a torch ``DataLoader`` does by default).
``[model] init``: ``"truncated_normal"`` (the default) or ``"torch"``, ``nn.Linear``'s own
(:data:`experiments.common.models.INITS`).

``[stream] validation = V`` > 0 holds out V examples of the dataset's training set (drawn
with ``validation_seed``, :func:`experiments.common.data.validation_split`): the tasks are
built from the rest and evaluated on the held-out ones, and the test set is never loaded
(:mod:`experiments.continual.tune` tunes on it).

Every method and seed trains into ``DIR/LABEL/seedS`` (``config.json``, ``tasks.jsonl`` with
one row per finished task, ``checkpoint.pt`` after every epoch, ``results.json``, and the
final ``posterior.pt`` of a rule and ``memory.pt`` of its memory); ``DIR`` receives
``config.json``, ``results.json``, ``report.md``, ``average_accuracy.png`` and
``final_accuracy.png``. ``--resume`` continues every run from its last checkpoint and ends
as an uninterrupted run would (docs/runs.md; docs/lifelong.md has the method and the
results). A run that diverges is a result, not the end of the comparison: its folder keeps
``diverged.json`` (the error), the other runs train, the method's summary is over the seeds
that trained, and the report names the diverged seeds.
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.continual.learn"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.functional import cross_entropy
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

import liegroup_blr as lgb
from experiments.common import config as config_module
from experiments.common import loop, runfiles, skeleton
from experiments.common.config import ConfigError, fill
from experiments.common.data import DATASETS, Dataset, check_finite, load_dataset, validation_split
from experiments.common.evaluate import posterior_mean
from experiments.common.loop import DivergedError, Divergence
from experiments.common.models import ACTIVATIONS, INITS, MLP
from experiments.common.optimizers import OPTIMIZERS, build_optimizer, lr_factor
from experiments.common.progress import Planned
from experiments.common.schema import COUNT, NAME, NUMBER
from experiments.common.skeleton import CHECKPOINT, RESULTS, ProgressHook
from experiments.common.training import resolve_device
from experiments.continual import report as continual_report
from experiments.continual.ewc import OnlineEWC, diagonal_ggn
from experiments.continual.streams import HEADS, STREAMS, Head, Task, build_stream, column_mask
from liegroup_blr import predictive
from liegroup_blr.memorable import SELECTIONS, USES

TASKS = "tasks.jsonl"
POSTERIOR = "posterior.pt"
MEMORY = "memory.pt"
DIVERGED = "diverged.json"
PRIORS = ("posterior", "initial", "delta", "none")

SECTIONS: dict[str, dict[str, Any]] = {
    "stream": {
        "name": NAME,
        "tasks": COUNT,
        "heads": "single",
        "dataset": "mnist5k",
        "root": "data",
        "validation": 0,  # > 0: hold out that many training examples, evaluate on them
        "validation_seed": 0,
    },
    "model": {"widths": [100, 100], "activation": "relu", "init": "truncated_normal"},
    "train": {
        "epochs": COUNT,
        "batch_size": 64,
        "warmup": 0,
        "test_batch_size": 1000,
        "schedule": "cosine",
        "clip_norm": 0.0,  # > 0: clip every gradient's norm to it
        "restart_optimizer": False,  # a baseline's state restarts at every task boundary
        "drop_last": True,  # false: the last partial minibatch of a pass is a step too
    },
    "eval": {"samples": 32, "bins": 20},
}

# a memory of each finished task (liegroup_blr.MemorablePast), any strategy but joint
MEMORY_KEYS: dict[str, Any] = {
    "memory": 0,
    "memory_selection": "lambda",
    "memory_use": "kprior",
    "memory_strength": 1.0,
    "memory_prior_precision": 1e-5,  # "fromp" without a posterior: Σ = 1/(summed GGN + this)
}
# keys of a [methods.LABEL] table besides its optimizer, by strategy
STRATEGIES: dict[str, dict[str, Any]] = {
    "finetune": dict(MEMORY_KEYS),
    "ewc": {"ewc_lambda": NUMBER, "ewc_gamma": 1.0, **MEMORY_KEYS},
    "joint": {},
    "posterior": {"prior": "posterior", "prior_strength": 1.0, **MEMORY_KEYS},
}
NEEDS_POSTERIOR = {"memory_selection": "sensitivity", "memory_use": "fromp_logits"}
"""Memory settings that need a posterior (a ``posterior`` method): the memory-map score and
``"fromp_logits"``'s kernel (``"fromp"`` takes the summed GGN without one)."""
SCHEDULES = ("cosine", "constant")

_LEAST = [
    ("stream", "tasks", 1),
    ("stream", "validation", 0),
    ("model", "widths", 1),
    ("train", "epochs", 1),
    ("train", "batch_size", 1),
    ("train", "test_batch_size", 1),
    ("eval", "samples", 1),
    ("eval", "bins", 1),
]


# ----------------------------------------------------------------------------- configs
def _method(label: str, given: Any) -> dict[str, Any]:
    """A resolved ``[methods.LABEL]`` table: its strategy's keys and its optimizer."""
    where = f"[methods.{label}]"
    if not isinstance(given, dict):
        raise ConfigError(f"{where} must be a table, got {given!r}")
    strategy = given.get("strategy")
    if strategy not in STRATEGIES:
        raise ConfigError(f"{where}.strategy: unknown {strategy!r}; valid: {sorted(STRATEGIES)}")
    schema = {"strategy": NAME, "optimizer": {}, **STRATEGIES[strategy]}
    method = fill(where, given, schema)
    opt = method["optimizer"]
    # posterior: a Lie-group rule; finetune, ewc, joint: a point estimate (SGD, Adam)
    posterior = "liegroup" if strategy == "posterior" else None
    valid = [name for name, kind in OPTIMIZERS.items() if kind.posterior == posterior]
    if opt.get("name") not in valid:
        raise ConfigError(
            f"{where}.optimizer.name: strategy {strategy!r} takes one of {list(valid)}, got "
            f"{opt.get('name')!r}"
        )
    schema = {"name": NAME, **OPTIMIZERS[opt["name"]].keys}
    method["optimizer"] = fill(f"{where}.optimizer", opt, schema)
    config_module.check_base(method["optimizer"])
    if strategy == "posterior":
        _check_prior(where, method)
    if "memory" in method:
        _check_memory(where, method)
    return method


def _check_prior(where: str, method: dict[str, Any]) -> None:
    """The prior keys of a ``posterior`` method."""
    if method["prior"] not in PRIORS:
        raise ConfigError(f"{where}.prior: unknown {method['prior']!r}; valid: {list(PRIORS)}")
    strength = method["prior_strength"]
    if not (math.isfinite(strength) and strength > 0):
        raise ConfigError(f"{where}.prior_strength must be finite and > 0, got {strength}")
    if method["prior"] != "posterior" and strength != 1.0:
        raise ConfigError(
            f"{where}.prior_strength: {strength} weights the previous posterior, which "
            f'prior = "{method["prior"]}" does not use; drop prior_strength'
        )


def _check_memory(where: str, method: dict[str, Any]) -> None:
    """The memory keys of a method."""
    if method["memory"] < 0:
        raise ConfigError(f"{where}.memory must be >= 0 examples per task, got {method['memory']}")
    for key, valid in (("memory_selection", SELECTIONS), ("memory_use", USES)):
        if method[key] not in valid:
            raise ConfigError(f"{where}.{key}: unknown {method[key]!r}; valid: {list(valid)}")
    if not method["memory_strength"] > 0:
        raise ConfigError(f"{where}.memory_strength must be > 0, got {method['memory_strength']}")
    if not method["memory_prior_precision"] > 0:
        raise ConfigError(
            f"{where}.memory_prior_precision must be > 0, got {method['memory_prior_precision']}"
        )
    if method["strategy"] != "posterior" and method["memory"]:
        for key, value in NEEDS_POSTERIOR.items():
            if method[key] == value:
                raise ConfigError(
                    f"{where}.{key}: {value!r} needs a posterior; strategy "
                    f"{method['strategy']!r} has a point estimate only (use memory_selection "
                    '"lambda" or "random", memory_use "kprior", "fromp" or "replay")'
                )


TOP_LEVEL: dict[str, Any] = {"seed": 0, "device": "auto", "threads": 0}


def resolve(raw: dict[str, Any], label: str, seed: int) -> dict[str, Any]:
    """The resolved config of one method and seed: every default filled in, every range
    checked."""
    cfg = config_module.top_level({**raw, "seed": seed}, TOP_LEVEL)
    for section, schema in SECTIONS.items():
        cfg[section] = config_module.table(raw, section, schema)
    cfg["method"] = _method(label, raw["methods"][label])
    _check_ranges(cfg)
    return cfg


def _check_ranges(cfg: dict[str, Any]) -> None:
    config_module.check_least(cfg, _LEAST)
    stream = cfg["stream"]
    if stream["name"] not in STREAMS:
        raise ConfigError(f"[stream].name: unknown {stream['name']!r}; valid: {list(STREAMS)}")
    if stream["heads"] not in HEADS:
        raise ConfigError(f"[stream].heads: unknown {stream['heads']!r}; valid: {list(HEADS)}")
    if stream["name"] == "permuted" and stream["heads"] != "single":
        raise ConfigError("[stream].heads: permuted tasks share all classes; use 'single'")
    if stream["dataset"] not in DATASETS:
        raise ConfigError(
            f"[stream].dataset: unknown {stream['dataset']!r}; valid: {sorted(DATASETS)}"
        )
    if cfg["model"]["activation"] not in ACTIVATIONS:
        raise ConfigError(
            f"[model].activation: unknown {cfg['model']['activation']!r}; valid: "
            f"{sorted(ACTIVATIONS)}"
        )
    if cfg["model"]["init"] not in INITS:
        raise ConfigError(f"[model].init: unknown {cfg['model']['init']!r}; valid: {INITS}")
    if not 0 <= cfg["train"]["warmup"] < cfg["train"]["epochs"]:
        raise ConfigError("[train].warmup must satisfy 0 <= warmup < epochs")
    train = cfg["train"]
    if train["schedule"] not in SCHEDULES:
        raise ConfigError(f"[train].schedule: unknown {train['schedule']!r}; valid: {SCHEDULES}")
    if not train["clip_norm"] >= 0:
        raise ConfigError(
            f"[train].clip_norm must be >= 0 (0: no clipping), got {train['clip_norm']}"
        )
    if train["restart_optimizer"] and cfg["method"]["strategy"] == "posterior":
        raise ConfigError(
            "[train].restart_optimizer: a rule's state is its posterior, which the next task "
            "takes as prior; restart only baselines (drop it for posterior methods)"
        )


def run_configs(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> dict[str, dict[int, dict[str, Any]]]:
    """label → seed → resolved run config, for every ``[methods.LABEL]`` and seed."""
    config_module.check_keys(raw, {"seeds", "methods", *TOP_LEVEL, *SECTIONS})
    methods = raw.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise ConfigError("a continual config needs at least one [methods.LABEL] table")
    for label in methods:
        config_module.check_label(label, "method")
    seeds = config_module.seed_list(raw, seeds)
    return {label: {s: resolve(raw, label, s) for s in seeds} for label in methods}


# ----------------------------------------------------------------------------- the learner
@dataclass
class Learner(loop.Trainee):
    """A run: its config, tasks (on the device), the logit masks of their heads and their
    columns, the model, optimizer, schedule, data order, for EWC the penalty, for a rule with
    a memory the memory (both checkpointed with the rest), and what the tasks are evaluated
    on (``"test"`` or ``"validation"``)."""

    cfg: dict[str, Any]
    tasks: list[Task]
    masks: Tensor
    columns: Tensor
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    data_rng: torch.Generator
    ewc: OnlineEWC | None
    memory: lgb.MemorablePast | None
    eval_set: str
    ggn: SummedGGN | None = None

    @property
    def strategy(self) -> str:
        return str(self.cfg["method"]["strategy"])

    def extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"ewc": self.ewc, "memory": self.memory}
        return extra if self.ggn is None else {**extra, "ggn": self.ggn}


class SummedGGN:
    r"""FROMP's Σ without a posterior: the diagonal GGN summed over the finished tasks' training
    examples, :math:`G = \sum_t N_t F_t` (:func:`~experiments.continual.ewc.diagonal_fisher`'s mean
    Fisher of a softmax, which is its GGN :math:`J^\top(\operatorname{diag}p - pp^\top)J`), and
    :math:`\Sigma = (G + \delta)^{-1}`."""

    def __init__(self) -> None:
        self.ggn: dict[str, Tensor] = {}

    def add(self, mean_ggn: dict[str, Tensor], size: int) -> None:
        for n, g in mean_ggn.items():
            self.ggn[n] = size * g if n not in self.ggn else self.ggn[n] + size * g

    def covariance(self, prior_precision: float) -> dict[str, Tensor]:
        return {n: 1 / (g + prior_precision) for n, g in self.ggn.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"ggn": dict(self.ggn)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ggn = dict(state["ggn"])


@functools.lru_cache(maxsize=1)
def _dataset(name: str, root: str) -> Dataset:
    """The dataset, loaded once for all the runs of a process (its tensors are only read)."""
    return load_dataset(name, root)


def _stream_data(stream: dict[str, Any]) -> Dataset:
    """The dataset of ``[stream]``; with ``validation`` > 0 its validation split (the test
    set left out)."""
    data = _dataset(stream["dataset"], stream["root"])
    if stream["validation"]:
        data = validation_split(data, stream["validation"], stream["validation_seed"])
    return data


def _task_lr(epoch: int, epochs: int, warmup: int, schedule: str = "cosine") -> float:
    """The learning-rate factor of global epoch ``epoch``: every task restarts the schedule
    (warm-up, then a cosine over its ``epochs``, or constant)."""
    if schedule == "constant":
        return lr_factor(epoch % epochs, epochs, warmup) if epoch % epochs < warmup else 1.0
    return lr_factor(epoch % epochs, epochs, warmup)


def build(cfg: dict[str, Any]) -> Learner:
    """Seed every RNG with the run's seed and set ``threads``
    (:func:`~experiments.common.skeleton.seed_everything`), then build the stream, model and
    optimizer."""
    seed = cfg["seed"]
    skeleton.seed_everything(seed, cfg["threads"])
    device = resolve_device(cfg["device"])
    s, m, t = cfg["stream"], cfg["model"], cfg["train"]
    data = _stream_data(s)
    tasks = [
        task.to(device) for task in build_stream(s["name"], data, s["tasks"], s["heads"], seed)
    ]
    _check_tasks(tasks, t["batch_size"], data.eval_set)
    masks = torch.stack([column_mask(task.classes, data.num_classes) for task in tasks])
    columns = torch.tensor([task.classes for task in tasks], device=device)
    model = MLP(data.input_shape, data.num_classes, m["widths"], m["activation"], m["init"])
    model = model.to(device)
    method = cfg["method"]
    optimizer = build_optimizer(method["optimizer"], model.parameters(), len(tasks[0].train_y))
    schedule = partial(_task_lr, epochs=t["epochs"], warmup=t["warmup"], schedule=t["schedule"])
    scheduler = LambdaLR(optimizer, schedule)
    ewc = None
    if method["strategy"] == "ewc":
        ewc = OnlineEWC(method["ewc_lambda"], method["ewc_gamma"])
    memory = None
    if method.get("memory"):
        memory = lgb.MemorablePast(
            method["memory"], method["memory_selection"], method["memory_use"]
        )
    generator = torch.Generator().manual_seed(seed)
    masks = masks.to(device)
    parts = (model, optimizer, scheduler, generator, ewc, memory, data.eval_set)
    ggn = None
    if memory is not None and memory.use == "fromp" and method["strategy"] != "posterior":
        ggn = SummedGGN()
    return Learner(cfg, tasks, masks, columns, *parts, ggn)


def _check_tasks(tasks: list[Task], batch_size: int, eval_set: str) -> None:
    """Every task takes a step per epoch, and its inputs are finite: the error names the
    first non-finite one by its task and index (the batches are drawn anew every epoch)."""
    for t, task in enumerate(tasks, 1):
        if len(task.train_y) < batch_size:
            raise ConfigError(
                f"[train].batch_size {batch_size} exceeds the {len(task.train_y)} training "
                f"examples of task {task.name!r}: no step would run"
            )
        check_finite(task.train_x, f"task {t} training")
        check_finite(task.test_x, f"task {t} {eval_set}")


def _posterior(optimizer: torch.optim.Optimizer, model: nn.Module) -> lgb.Posterior:
    return lgb.Posterior.from_optimizer(optimizer, model)


# ----------------------------------------------------------------------------- training
def _training_set(learner: Learner, t: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs, labels and task index of every training example of task t (of tasks 1 … t
    for joint training)."""
    first = 0 if learner.strategy == "joint" else t
    chosen = learner.tasks[first : t + 1]
    x = torch.cat([task.train_x for task in chosen])
    y = torch.cat([task.train_y for task in chosen])
    ids = torch.cat([torch.full_like(task.train_y, first + i) for i, task in enumerate(chosen)])
    return x, y, ids


def _closure(
    learner: Learner, x: Tensor, y: Tensor, mask: Tensor, rows: Tensor | None, size: int
) -> Any:
    """Mean cross-entropy over each example's head (+ the EWC penalty, + λ times the memory's
    term on its ``rows``, each memory example one of the task's ``size``), backward, the
    gradient's norm clipped to ``[train] clip_norm`` where it is > 0."""
    clip = learner.cfg["train"]["clip_norm"]

    def closure() -> Tensor:
        learner.optimizer.zero_grad()
        loss = cross_entropy(learner.model(x) + mask, y)
        if learner.ewc is not None:
            loss = loss + learner.ewc.penalty(learner.model)
        if rows is not None:
            strength = learner.cfg["method"]["memory_strength"]
            loss = loss + strength * _memory_loss(learner, rows, size)
        loss.backward()
        if clip:
            _clip_gradient(learner.model, clip)
        return loss.detach()

    return closure


def _clip_gradient(model: nn.Module, clip: float) -> None:
    """Scale the gradient to norm ``clip`` where its norm is larger (FROMP's code's clip)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if norm > clip:
        for g in grads:
            g.mul_(clip / norm)


def _memory_loss(learner: Learner, rows: Tensor, size: int) -> Tensor:
    """The memory's term on its ``rows``, each on its task's head, for a task of ``size``
    training examples (:meth:`liegroup_blr.MemorablePast.loss`)."""
    memory = learner.memory
    assert memory is not None
    logits = learner.model(memory.inputs[rows])
    head = logits.gather(1, learner.columns[memory.tasks[rows]])
    return memory.loss(head, data_size=size, rows=None if memory.use == "fromp" else rows)


def train_epoch(learner: Learner, data: tuple[Tensor, Tensor, Tensor], t: int, epoch: int) -> float:
    """One pass over ``data`` in a fresh order (the last partial batch dropped,
    :meth:`experiments.common.loop.Trainee.steps`); returns the mean training objective. Raises
    :class:`~experiments.common.loop.DivergedError` as soon as a loss or, after an update, a
    parameter is not finite."""
    cfg = learner.cfg
    desc = f"task {t + 1}/{len(learner.tasks)} epoch {epoch + 1}/{cfg['train']['epochs']}"
    steps = _steps(learner, data)
    total = _step_count(len(data[1]), cfg["train"])
    return learner.steps(epoch, steps, desc, total=total, diverged=partial(_diverged, t))


def _steps(learner: Learner, data: tuple[Tensor, Tensor, Tensor]) -> Iterator[partial[Any]]:
    """The steps of one pass over ``data``: each an optimizer step on a minibatch of a fresh
    order and, with a memory, a minibatch of the memory as large (``"fromp"``: every row)."""
    x, y, ids = data
    batch = learner.cfg["train"]["batch_size"]
    order = torch.randperm(len(y), generator=learner.data_rng).to(y.device)
    memory = learner.memory
    for step in range(_step_count(len(y), learner.cfg["train"])):
        idx = order[step * batch : (step + 1) * batch]
        rows = None
        if memory is not None and len(memory) and memory.use == "fromp":
            rows = torch.arange(len(memory), device=y.device)
        elif memory is not None and len(memory):
            rows = torch.randperm(len(memory), generator=learner.data_rng)[:batch]
            rows = rows.to(y.device)
        closure = _closure(learner, x[idx], y[idx], learner.masks[ids[idx]], rows, len(y))
        yield partial(learner.optimizer.step, closure)


def _step_count(n: int, train: dict[str, Any]) -> int:
    """Minibatches in a pass over ``n`` examples: the full ones, and the partial last one
    unless ``drop_last``."""
    full, rest = divmod(n, train["batch_size"])
    return full + (rest > 0 and not train["drop_last"])


def _diverged(t: int, divergence: Divergence) -> DivergedError:
    """A divergence in task t, in the words of the stream's runs."""
    where = f"task {t + 1}, epoch {divergence.epoch + 1}"
    advice = "Lower the method's lr and train into a new folder"
    if divergence.step is None:  # at the end of the epoch
        return divergence.error(where, advice)
    return DivergedError(
        f"training diverged in {where}, step {divergence.step} (loss {divergence.loss}); "
        f"nothing of this epoch was saved. {advice}"
    )


def _next_task(learner: Learner, t: int) -> None:
    """The task boundary after task t: EWC consolidates; a rule keeps task t's examples in
    its memory and starts task t + 1 with ``next_task`` (its data size, the method's
    ``prior``), or, with ``prior = "initial"``, restarts the momenta and keeps its first
    prior."""
    if learner.ewc is not None:
        task = learner.tasks[t]
        fisher = diagonal_ggn(learner.model, task.train_x, learner.masks[t])
        learner.ewc.consolidate(learner.model, fisher)
    if learner.memory is not None:
        _remember(learner, t)
    if learner.cfg["train"]["restart_optimizer"]:
        learner.optimizer.state.clear()  # Adam's moments and step count, as FROMP's code
    if learner.strategy == "posterior":
        method, optimizer = learner.cfg["method"], learner.optimizer
        size, strength = len(learner.tasks[t + 1].train_y), method["prior_strength"]
        prior = "none" if method["prior"] == "initial" else method["prior"]
        next_task = optimizer.next_task  # type: ignore[attr-defined]
        next_task(data_size=size, prior=prior, strength=strength)
        if method["prior"] == "initial":
            for group in optimizer.param_groups:
                group["prior_precision"] = method["optimizer"]["prior_precision"]


def _remember(learner: Learner, t: int) -> None:
    """Add task t's examples to the memory, chosen and predicted on its head (with the
    posterior where the method has one), with a generator seeded by the run's seed and t;
    ``"fromp"`` then refreshes every stored task's targets and kernels, Σ the posterior's or
    the inverse of task 1 … t's summed GGN plus ``memory_prior_precision``."""
    assert learner.memory is not None
    task, columns = learner.tasks[t], learner.columns[t]
    labels = (task.train_y[:, None] == columns).int().argmax(1)  # the label's column in its head
    seed = int(np.random.SeedSequence([learner.cfg["seed"], t]).generate_state(1)[0])
    generator = torch.Generator(device=columns.device).manual_seed(seed)
    head = Head(learner.model, columns)
    learner.memory.add_task(
        head,
        posterior=learner.optimizer if learner.strategy == "posterior" else None,
        inputs=task.train_x,
        targets=labels,
        generator=generator,
    )
    if learner.memory.use != "fromp":
        return
    select = partial(_head_of, learner.columns)
    if learner.ggn is None:
        learner.memory.refresh(learner.model, posterior=learner.optimizer, head=select)
        return
    learner.ggn.add(diagonal_ggn(learner.model, task.train_x, learner.masks[t]), len(task.train_y))
    covariance = learner.ggn.covariance(learner.cfg["method"]["memory_prior_precision"])
    learner.memory.refresh(learner.model, covariance=covariance, head=select)


def _head_of(columns: Tensor, outputs: Tensor, t: int) -> Tensor:
    """The outputs of task t's head: its columns of the network's."""
    return outputs[:, columns[t]]


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def _log_probs(learner: Learner) -> list[Tensor]:
    """Per task, the log-probabilities of its test images over its head."""
    size = learner.cfg["train"]["test_batch_size"]
    learner.model.eval()
    out = []
    for task, mask in zip(learner.tasks, learner.masks, strict=True):
        logits = torch.cat([learner.model(x) for x in task.test_x.split(size)])
        out.append(torch.log_softmax(logits + mask, dim=-1))
    learner.model.train()
    return out


def _metrics(learner: Learner, log_probs: list[Tensor], t: int) -> dict[str, Any]:
    """Accuracy, NLL and ECE of every task, and the metrics pooled over tasks 1 … t + 1."""
    bins = learner.cfg["eval"]["bins"]
    per_task = [
        predictive.metrics(lp, task.test_y, bins)
        for lp, task in zip(log_probs, learner.tasks, strict=True)
    ]
    seen = predictive.metrics(
        torch.cat(log_probs[: t + 1]), torch.cat([k.test_y for k in learner.tasks[: t + 1]]), bins
    )
    return {key: [m[key] for m in per_task] for key in ("accuracy", "nll", "ece")} | {"seen": seen}


def evaluate(learner: Learner, t: int) -> dict[str, Any]:
    """The test metrics of every task after task t at the point estimate and, for a rule, at
    the posterior mean E[θ] where it is another point (:func:`experiments.common.evaluate.
    posterior_mean`: the multiplicative rule's E[ξ](g⁺ − g⁻)) and of the model average of
    ``[eval] samples`` posterior samples (drawn from the posterior object with a generator
    seeded by the run's seed: the same draws at every evaluation)."""
    row: dict[str, Any] = {"task": t + 1, "point": _metrics(learner, _log_probs(learner), t)}
    if learner.strategy != "posterior":
        return row
    mean = posterior_mean(learner.model, learner.optimizer)
    if mean is not None:
        with mean.at_point_estimate(learner.model):
            row["mean"] = _metrics(learner, _log_probs(learner), t)
    post = _posterior(learner.optimizer, learner.model)
    device = learner.masks.device
    generator = torch.Generator(device=device).manual_seed(learner.cfg["seed"])
    samples = learner.cfg["eval"]["samples"]
    total: list[Tensor] = []
    for _ in range(samples):
        with post.sampled(learner.model, generator):
            log_p = _log_probs(learner)
        total = (
            log_p
            if not total
            else [torch.logaddexp(a, b) for a, b in zip(total, log_p, strict=True)]
        )
    average = [lp - math.log(samples) for lp in total]
    row["average"] = _metrics(learner, average, t)
    return row


# ----------------------------------------------------------------------------- checkpoints
@dataclass
class Position:
    """Where a run stands: the task in progress, the epochs done in it, the training seconds
    spent on it, and the rows of the finished tasks (first in the checkpoint, which also
    holds model, optimizer, schedule, every RNG state, the EWC state and the memory)."""

    task: int = 0
    epoch: int = 0
    seconds: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)


def _restore(learner: Learner, path: Path) -> Position:
    """The state of checkpoint ``path`` restored into ``learner``; where the run stands."""
    return learner.restore(
        path,
        lambda state: Position(
            int(state["task"]), int(state["epoch"]), float(state["seconds"]), list(state["rows"])
        ),
    )


# ----------------------------------------------------------------------------- one run
def run(
    cfg: dict[str, Any],
    out: Path,
    resume: bool = False,
    progress: ProgressHook | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Learn the stream of one method and seed into ``out``; returns its summary
    (:func:`experiments.continual.report.run_summary` plus timings).

    Everything is checked before anything is written. A checkpoint follows every epoch and
    every task boundary, the task rows live inside it and ``tasks.jsonl`` is rewritten from
    them, so a kill at any instant loses at most the epoch in progress. ``progress`` hears of
    the epochs done over the whole stream; ``title`` names the run in its task lines.
    """
    opened = skeleton.opened_run(out, cfg, resume, TASKS, partial(build, cfg), _restore, Position())
    with opened as (learner, at):
        skeleton.start_run(out, cfg, TASKS, at.rows)
        return _learn(learner, out, at, progress, title or out.name)


def planned(label: str, cfg: dict[str, Any], folder: Path, resume: bool) -> Planned:
    """The run of ``cfg`` in ``folder`` for the progress: its epochs over every task, each of
    ``mc_samples`` gradient evaluations per step, and with ``resume`` those of its finished
    tasks and whether it finished."""
    epochs = cfg["train"]["epochs"]
    return Planned(
        label,
        epochs * cfg["stream"]["tasks"],
        cfg["method"]["optimizer"].get("mc_samples", 1),
        epochs * len(runfiles.read_jsonl(folder / TASKS)) if resume else 0,
        resume and skeleton.run_state(folder) == "finished",
    )


def check_runs(configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Raise what any run of ``configs`` would raise when it starts (its device, a batch size
    that fits every task, every value its optimizer checks), by building each method's first
    seed; the error names the method. Global RNGs move; :func:`build` seeds them again."""
    for label, by_seed in configs.items():
        try:
            build(next(iter(by_seed.values())))
        except ValueError as err:
            raise ConfigError(f"[methods.{label}]: {err}") from None


RUNNER = skeleton.Runner(run, planned, lambda cfg: str(cfg["method"]["strategy"]), check_runs)
"""How the drivers learn the stream of one method and seed (:func:`run`)."""


def run_or_diverge(
    cfg: dict[str, Any], out: Path, resume: bool = False, **options: Any
) -> dict[str, Any]:
    """:func:`run`, but a run that diverges is a result: ``{"diverged": message}``, kept in
    ``out/diverged.json`` (a resume returns it without training again)."""
    record = out / DIVERGED
    if resume and record.exists():
        return runfiles.read_json(record)
    try:
        return run(cfg, out, resume, **options)
    except DivergedError as err:
        print(f"== {out}: {err}", flush=True)
        runfiles.write_json(record, {"diverged": str(err)})
        return {"diverged": str(err)}


STREAM_RUNNER = dataclasses.replace(RUNNER, train=run_or_diverge)
"""The driver's runner: every method and seed, a diverged run reported rather than fatal."""


def _learn(
    learner: Learner, out: Path, at: Position, progress: ProgressHook | None, title: str
) -> dict[str, Any]:
    """The stream from ``at`` on, then the final files."""
    ckpt, epochs, count = out / CHECKPOINT, learner.cfg["train"]["epochs"], len(learner.tasks)
    while at.task < count:
        t = at.task
        train = partial(train_epoch, learner, _training_set(learner, t), t)
        told = None if progress is None else (lambda done, t=t: progress(t * epochs + done))
        for epoch in learner.epochs(at.epoch, epochs, train, told, partial(_diverged, t)):
            at.epoch, at.seconds = epoch.done, at.seconds + epoch.seconds
            learner.save(ckpt, vars(at))
            tqdm.write(
                f"{title}: task {t + 1}/{count} epoch {at.epoch}/{epochs}: objective "
                f"{epoch.loss:.4f}, {epoch.seconds:.1f}s"
                + (f" | {epoch.note}" if epoch.note else "")
            )
        tic = time.perf_counter()
        row = evaluate(learner, t)
        row["train_seconds"], row["eval_seconds"] = at.seconds, time.perf_counter() - tic
        _report_task(row)
        if runfiles.nonfinite(row):
            raise DivergedError(
                f"non-finite metrics {runfiles.nonfinite(row)} after task {t + 1} in "
                f"{out}; lower the method's lr and train into a new folder"
            )
        if t + 1 < count:
            _next_task(learner, t)
        at = Position(t + 1, 0, 0.0, [*at.rows, row])
        learner.save(ckpt, vars(at))
        runfiles.write_jsonl(out / TASKS, at.rows)
    if learner.strategy == "posterior":
        _posterior(learner.optimizer, learner.model).save(out / POSTERIOR)
    if learner.memory is not None:
        learner.memory.save(out / MEMORY)
    results = continual_report.run_summary(at.rows)
    results["eval_set"] = learner.eval_set
    results["train_sizes"] = [len(task.train_y) for task in learner.tasks]
    results["test_sizes"] = [len(task.test_y) for task in learner.tasks]
    if runfiles.nonfinite(results):
        raise DivergedError(f"non-finite metrics {runfiles.nonfinite(results)} in {out}")
    runfiles.write_json(out / RESULTS, results)
    return results


def _report_task(row: dict[str, Any]) -> None:
    t = row["task"]
    for estimate in continual_report.ESTIMATES:
        if estimate in row:
            m = row[estimate]
            accs = " ".join(f"{100 * a:.1f}" for a in m["accuracy"][:t])
            tqdm.write(
                f"after task {t} ({continual_report.ESTIMATES[estimate]}): accuracy per task "
                f"[{accs}], average {100 * np.mean(m['accuracy'][:t]):.2f}%, NLL "
                f"{m['seen']['nll']:.4f}, ECE {m['seen']['ece']:.4f}"
            )


# ----------------------------------------------------------------------------- the driver
def continual(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Learn the stream with every method for every seed into ``out/LABEL/seedS`` and write
    the report. Returns label → ``{"seeds", "summary", "per_seed"}``."""
    out = Path(out)
    configs = run_configs(raw, seeds)
    RUNNER.check(configs)
    with runfiles.locked(out):
        skeleton.prepare_folder(out, skeleton.written(configs), resume)
        per_seed = skeleton.run_all(configs, out, resume, STREAM_RUNNER)
        results = {label: _over_seeds(list(configs[label]), per_seed[label]) for label in configs}
        if not any(r["summary"] for r in results.values()):
            raise DivergedError(f"every run in {out} diverged; lower the step sizes")
        summary = {label: r["summary"] for label, r in results.items()}
        first = next(iter(next(iter(configs.values())).values()))
        figure = out / "average_accuracy.png"
        seeds = list(next(iter(configs.values())))
        title = continual_report.figure_title(first, seeds)
        samples = first["eval"]["samples"]
        lost = {label: r["diverged_seeds"] for label, r in results.items()}
        continual_report.average_accuracy_figure(summary, samples, figure, title, seeds, lost)
        final = out / "final_accuracy.png"
        continual_report.final_accuracy_figure(summary, samples, final, title, seeds, lost)
        skeleton.write_report(out, results, continual_report.report(configs, results))
    return results


def _over_seeds(seeds: list[int], per_seed: dict[str, Any]) -> dict[str, Any]:
    """A method's results: its seeds, those that diverged, and the summary over the others
    (empty when every seed diverged)."""
    trained = [r for r in per_seed.values() if "diverged" not in r]
    return {
        "seeds": seeds,
        "diverged_seeds": [int(s) for s, r in per_seed.items() if "diverged" in r],
        "summary": continual_report.over_seeds(trained) if trained else {},
        "per_seed": per_seed,
    }


def _show(results: dict[str, Any], out: Path) -> None:
    print((out / "report.md").read_text())
    print(f"report in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, continual, _show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
