"""The rankings of the training set that experiments/memory/maps.py checks against
retraining: the memory map's scores in every form and variant, the library's default, and
the baselines without the estimate; the examples chosen for retraining."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import liegroup_blr as lgb
from liegroup_blr import predictive
from liegroup_blr.memory_maps import REGIONS

if TYPE_CHECKING:
    from experiments.common.training import Run

SCORES: dict[str, dict[str, Any]] = {
    "probabilities": {"change": "probabilities"},
    "probabilities+cross": {"change": "probabilities", "cross_class": True},
    "logits": {"change": "logits"},
    "logits+cross": {"change": "logits", "cross_class": True},
}
"""The score variants, as options of :func:`liegroup_blr.memory_map`: the change of the
probabilities (Σₖ|eₖλₖvₖ|) or of the logits (Σₖ|vₖeₖ|), and both with the cross-class terms."""

FORMS = ("jacobian", "samples")
RANKINGS = [f"{form}:{score}" for form in FORMS for score in SCORES]
"""Every score computed, named ``FORM:SCORE`` (the form of the prediction variance)."""

BASELINES = ("loss", "residual", "variance")
"""Rankings without the estimate: the example's own loss at the point estimate (what a
network without a posterior gives), the residual size ‖eᵢ‖₁ alone (the score with the
variance removed) and the total prediction variance alone (with the residual removed)."""

ERROR_THRESHOLD, VARIANCE_QUANTILE = 1.0, 0.9
"""The region boundaries of the two-axis maps
(:meth:`liegroup_blr.memory_maps.MemoryMap.regions`)."""


def train_inputs(run: Run) -> tuple[Tensor, Tensor]:
    """The run's training inputs (normalised) and labels, on its device."""
    data = run.data
    return data.normalize(data.to_unit(data.train_x)).to(run.device), data.train_y.to(run.device)


def memory_map(
    run: Run, x: Tensor, y: Tensor, samples: int, batch_size: int, seed: int, **options: Any
) -> lgb.MemoryMap:
    """The memory map of the examples (``x``, ``y``) under the run's posterior
    (:func:`liegroup_blr.memory_map` with ``options``), its draws seeded with ``seed``."""
    return lgb.memory_map(
        run.model,
        run.optimizer,
        x,
        y,
        samples=samples,
        batch_size=batch_size,
        generator=torch.Generator(run.device).manual_seed(seed),
        **options,
    )


def default_scores(mm: lgb.MemoryMap, y: Tensor) -> dict[str, Any]:
    """The labels and the library's default ranking: its form (``"auto"``), the scores, the
    residual size and the total prediction variance alone, and the regions of the map."""
    return {
        "labels": y.cpu(),
        "auto": mm.method,
        "default": mm.scores.cpu(),
        "residual": mm.prediction_error.cpu(),
        "variance": mm.total_variance.cpu(),
        "regions": mm.regions(ERROR_THRESHOLD, VARIANCE_QUANTILE).cpu(),
    }


def scores(run: Run, memory: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every ranking of the training set: the scores of :data:`RANKINGS`, the library's
    default (:func:`default_scores`), and the baselines of :data:`BASELINES`; and the
    labels."""
    x, y = train_inputs(run)
    of = {"samples": memory["samples"], "batch_size": memory["batch_size"], "seed": seed}
    out = default_scores(memory_map(run, x, y, **of), y)
    for form in FORMS:
        for name, options in SCORES.items():
            out[f"{form}:{name}"] = memory_map(run, x, y, **of, method=form, **options).scores.cpu()
    log_p = predictive.predictive_log_probs(run.model, [x])
    out["loss"] = -log_p.gather(1, y[:, None])[:, 0].cpu()
    return out


def chosen(score: Tensor, top: int, random: int, seed: int) -> tuple[list[int], list[int]]:
    """The ``top`` highest-scored examples and ``random`` others drawn at random."""
    order = score.argsort(descending=True)
    rest = order[top:]
    picks = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(seed))]
    return order[:top].tolist(), picks[:random].tolist()


def region_counts(regions: Tensor) -> dict[str, int]:
    counts = torch.bincount(regions, minlength=len(REGIONS)).tolist()
    return dict(zip(REGIONS, counts, strict=True))
