"""Why a few multiplicative weights grow large: log g under fresh and under frozen noise.

    python -m experiments.log_g_walk [--widths 128] [--passes 26] [--samples 4] [--seed 0]

The multiplicative rule moves log g± by −α M± per step, M± a moving average of
X̂± = ±(1/S) Σ_s ∇ℓ̄(θ_s) ⊙ g±ξ±_s − τ/N. With fresh noise ξ at every sample (this library)
X̂ has a zero-mean part from the noise alone, so log g also takes random steps of size
about α·|∇ℓ̄|·g·sd(ξ): a random walk whose spread grows with the number of steps, and
whose steps grow with g, so the weights that wander up move faster. With the noise
frozen (the reference code draws it once, at trace time) the same ξ enters every step,
X̂ is a deterministic function of g and the minibatch, and there is no such walk.

Experiment: a tanh-MLP (hidden ``--widths``; none: softmax regression) on the mnist5k
training digits, trained by the multiplicative rule with the reference MNIST
hyperparameters (α = 50, β = 0.9, τ = 0.006, Rayleigh(1) base, batch 50, cosine schedule),
once with fresh noise and once with the first layer's noise frozen: a noise table of twice
the first layer's size, so the first layer's (2, …) noise is always the table's one window
and every sample and step reads the same ξ there (the smaller tensors get random windows
of the table, nearly fresh noise). Prints, after some passes, the spread of the change of
log g⁺ over the first layer's weights, its max|θ|, median|θ| and the share of |θ| above
10 median|θ|.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch.nn.functional import cross_entropy
from tqdm import tqdm

import liegroup_blr as lgb
from experiments.data import load_dataset, train_batches
from experiments.models import build_model
from experiments.sparsity import first_layer


def run(
    frozen: bool, widths: list[int], passes: int, samples: int, seed: int
) -> list[dict[str, float]]:
    """Train the network; one row of first-layer log-g⁺ and |θ| statistics per pass."""
    torch.manual_seed(seed)
    data = load_dataset("mnist5k", "data")
    model = build_model("mlp", (1, 28, 28), 10, widths=widths, activation="tanh")
    weight = first_layer(model)
    noise = {"noise": "table", "table_size": 2 * weight.numel()} if frozen else {}
    opt = lgb.MultiplicativeBLR(
        model.parameters(),
        lr=50.0,
        momentum=0.9,
        temperature=0.006,
        data_size=len(data.train_y),
        mc_samples=samples,
        seed=seed,
        **noise,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda e: 0.5 * (1 + math.cos(math.pi * e / passes))
    )
    log_g0 = opt.group_element(weight)["g+"].log()
    rng, rows = torch.Generator().manual_seed(seed), []
    label = "frozen" if frozen else "fresh"
    for epoch in tqdm(range(passes), desc=f"{label} noise", leave=False):
        for x, y in train_batches(data, 50, rng, torch.device("cpu")):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = cross_entropy(model(x), y)
                loss.backward()
                return loss.detach()

            opt.step(closure)
        schedule.step()
        walk = opt.group_element(weight)["g+"].log() - log_g0
        theta = weight.detach().abs()
        median = theta.median().item()
        rows.append(
            {
                "pass": epoch + 1,
                "sd of log g+ change": walk.std().item(),
                "max abs theta": theta.max().item(),
                "median abs theta": median,
                "share above 10 median": (theta > 10 * median).double().mean().item(),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.log_g_walk",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--widths", type=int, nargs="*", default=[128], help="hidden widths")
    parser.add_argument("--passes", type=int, default=26)
    parser.add_argument("--samples", type=int, default=4, help="MC samples per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.passes < 1 or args.samples < 1:
        parser.error("--passes and --samples must be >= 1")
    results = {
        frozen: run(frozen, args.widths, args.passes, args.samples, args.seed)
        for frozen in (False, True)
    }
    keys = list(results[False][0])[1:]
    print("| noise | pass | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    shown = sorted({1, args.passes // 4, args.passes // 2, args.passes} - {0})
    for frozen, rows in results.items():
        for row in rows:
            if row["pass"] in shown:
                cells = " | ".join(f"{row[k]:.4g}" for k in keys)
                print(f"| {'frozen' if frozen else 'fresh'} | {row['pass']} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
