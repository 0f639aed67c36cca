"""Why a few multiplicative weights grow large: the multiplicative rule under three noises.

    python -m experiments.rules.log_g_walk [--widths 128] [--passes 26] [--samples 4] [--seed 0]
        [--noise fresh one-draw per-sample]

The multiplicative rule moves log g± by −α M± per step, M± a moving average of
X̂± = ±(1/S) Σ_s ∇ℓ̄(θ_s) ⊙ g±ξ±_s − τ/N. The noise ξ enters three ways here:

* ``fresh``: new ξ at every sample of every step (this library). X̂ then has a zero-mean
  part from the noise alone, so log g also takes random steps of size about
  α·|∇ℓ̄|·g·sd(ξ): a random walk whose steps grow with g.
* ``one-draw``: one ξ for the first layer at every sample and step (a noise table of exactly
  twice the first layer's size, so its (2, …) noise is always the table's one window; the
  other layers read random windows, nearly fresh noise).
* ``per-sample``: the reference code's noise. It draws S noise tensors per part once (when
  its update is traced) and the s-th sample of every step reuses the s-th, in every layer;
  the model average at test time draws fresh noise.

Experiment: a tanh-MLP (hidden ``--widths``) on the mnist5k training digits, trained by the
multiplicative rule with the reference MNIST hyperparameters (α = 50, β = 0.9, τ = 0.006,
Rayleigh(1) base, batch 50, cosine schedule) under each noise. Prints, after some passes,
the spread of the change of log g⁺ over the first layer's weights, its max|θ|, median|θ| and
the share of |θ| above 10 median|θ|; then the test accuracy, NLL and ECE at g and for the
average over 32 fresh samples, with the first layer's Hoyer measure and share below
10⁻³·max|θ| (the reference code's sparsity numbers).
"""

from __future__ import annotations

import argparse

from experiments.common import cli

NOISES = ("fresh", "one-draw", "per-sample")


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--widths", type=int, nargs="*", default=[128], help="hidden widths")
    parser.add_argument("--passes", type=int, default=26)
    parser.add_argument("--samples", type=int, default=4, help="MC samples per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", nargs="+", choices=NOISES, default=list(NOISES))


PROG = "python -m experiments.rules.log_g_walk"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, options=_options)

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

import liegroup_blr as lgb
from experiments.common import loop, skeleton
from experiments.common.data import load_dataset, test_batches, train_batches
from experiments.common.models import build_model
from experiments.common.sparsity import first_layer, sparsity
from experiments.common.tables import LEFT, RIGHT, markdown
from liegroup_blr import predictive
from liegroup_blr.noise import FreshNoise, TableNoise


class PerSampleNoise(FreshNoise):
    """The reference code's noise: the s-th training sample of every step reads the same ξ,
    drawn fresh on first use (S draws per tensor in all); other samples draw fresh noise."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen: dict[tuple[int, int], list[Tensor]] = {}
        self.index = -1  # of the current training sample within its step; -1: not training

    def start_sample(self, train: bool) -> None:
        super().start_sample(train)
        self.index = self.index + 1 if train else -1

    def end_step(self) -> None:
        super().end_step()
        self.index = -1

    def draw(
        self,
        outs: list[Tensor],
        base: Distribution,
        keys: list[Tensor],
        index: int,
        *,
        predict: bool,
    ) -> list[Tensor]:
        if self.index < 0:
            return super().draw(outs, base, keys, index, predict=predict)
        key = (self.index, index)
        if key not in self.frozen:
            drawn = super().draw(outs, base, keys, index, predict=predict)
            self.frozen[key] = [xi.clone() for xi in drawn]
        return self.frozen[key]


def _optimizer(
    model: torch.nn.Module, noise: str, samples: int, data_size: int, seed: int
) -> lgb.MultiplicativeBLR:
    weight = first_layer(model)
    sources = {
        "fresh": FreshNoise,
        "one-draw": lambda: TableNoise(2 * weight.numel()),
        "per-sample": PerSampleNoise,
    }
    return lgb.MultiplicativeBLR(
        model.parameters(),
        lr=50.0,
        momentum=0.9,
        temperature=0.006,
        data_size=data_size,
        mc_samples=samples,
        seed=seed,
        noise=sources[noise](),
        init="auto",  # the reference initialisation: rewrites the weights on purpose
        max_consecutive_skips=None,  # the walk runs on through skips: what it shows
    )


@dataclass
class Walk(loop.Trainee):
    """The network trained under one noise: model, optimizer, schedule, data order."""

    model: torch.nn.Module
    optimizer: lgb.MultiplicativeBLR
    scheduler: LambdaLR
    data_rng: torch.Generator


def run(
    noise: str, widths: list[int], passes: int, samples: int, seed: int
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Train the network; one row of first-layer log-g⁺ and |θ| statistics per pass, and the
    final test metrics and sparsity. Nothing checks for divergence: the weights that blow up
    are what the walk shows."""
    skeleton.seed_everything(seed)
    data = load_dataset("mnist5k", "data")
    model = build_model("mlp", (1, 28, 28), 10, widths=widths, activation="tanh")
    weight = first_layer(model)
    opt = _optimizer(model, noise, samples, len(data.train_y), seed)
    schedule = LambdaLR(opt, lambda e: 0.5 * (1 + math.cos(math.pi * e / passes)))
    log_g0 = opt.group_element(weight)["g+"].log()
    walk_of, rows = Walk(model, opt, schedule, torch.Generator().manual_seed(seed)), []

    def train_pass(epoch: int) -> float:
        batches = train_batches(data, 50, walk_of.data_rng, torch.device("cpu"))
        steps = (partial(opt.step, loop.closure(opt, model, x, y)) for x, y in batches)
        return walk_of.steps(epoch, steps, f"pass {epoch + 1}/{passes}", diverged=None)

    epochs = walk_of.epochs(0, passes, train_pass, diverged=None)
    for epoch in tqdm(epochs, total=passes, desc=f"{noise} noise", leave=False):
        walk = opt.group_element(weight)["g+"].log() - log_g0
        theta = weight.detach().abs()
        median = theta.median().item()
        rows.append(
            {
                "pass": epoch.done,
                "sd of log g+ change": walk.std().item(),
                "max abs theta": theta.max().item(),
                "median abs theta": median,
                "share above 10 median": (theta > 10 * median).double().mean().item(),
            }
        )
    return rows, _final(model, opt, data)


def _final(model: torch.nn.Module, opt: lgb.MultiplicativeBLR, data: Any) -> dict[str, float]:
    """Test accuracy / NLL / ECE at g and for 32 fresh samples; first-layer sparsity."""
    test = test_batches(data, 500, torch.device("cpu"))
    inputs, labels = [x for x, _ in test], torch.cat([y for _, y in test])
    final: dict[str, float] = {}
    for name, optimizer in (("g", None), ("avg", opt)):
        log_probs = predictive.predictive_log_probs(model, inputs, optimizer, 32)
        for metric, value in predictive.metrics(log_probs, labels).items():
            final[f"{metric} {name}"] = value
    measures = sparsity(first_layer(model))
    final["hoyer"], final["below 1e-3 max"] = measures["hoyer"], measures["near_zero_max"]
    return final


def _table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    keys = [k for k in rows[0][1] if k != "pass"]
    lead = ["noise", "pass"] if "pass" in rows[0][1] else ["noise"]
    cells = [
        [noise, *([str(row["pass"])] if "pass" in row else []), *(f"{row[k]:.4g}" for k in keys)]
        for noise, row in rows
    ]
    return markdown(lead + keys, cells, [LEFT] + [RIGHT] * (len(lead) - 1 + len(keys)))


def walk(
    widths: list[int], passes: int, samples: int, seed: int, noise: Sequence[str]
) -> dict[str, Any]:
    """:func:`run` under each noise: noise → (a row per pass, the final metrics)."""
    if passes < 1 or samples < 1:
        raise ValueError("--passes and --samples must be >= 1")
    return {n: run(n, widths, passes, samples, seed) for n in noise}


def show(results: dict[str, Any]) -> None:
    """Print the walk after the first pass, a quarter, half and all of them, then the final
    metrics."""
    passes = len(next(iter(results.values()))[0])
    shown = sorted({1, passes // 4, passes // 2, passes} - {0})
    walks = [(n, row) for n, (rows, _) in results.items() for row in rows if row["pass"] in shown]
    print("\n".join(_table(walks)) + "\n")
    print("\n".join(_table([(n, final) for n, (_, final) in results.items()])))


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, walk, show, argv, options=_options)


if __name__ == "__main__":
    sys.exit(main())
