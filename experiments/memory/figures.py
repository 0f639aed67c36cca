"""The figures of experiments/memory/maps.py: the gallery of the most and least sensitive
examples, the two-axis map (prediction error against prediction variance), and the
estimated against the true changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from experiments.common import figures
from experiments.memory.scores import ERROR_THRESHOLD, VARIANCE_QUANTILE
from experiments.memory.stats import SPACES, changes


def maps(
    images: Tensor,
    score: dict[str, Any],
    folder: Path,
    prefix: str,
    title: str,
    marked: dict[int, int] | None = None,
) -> None:
    """The gallery (``memory_map.png``) and the two-axis map (``error_variance.png``) of the
    default scores, names prefixed with ``prefix``; ``marked``: index → original label."""
    name = f"default scores ({score['auto']} form)"
    figures.memory_map(
        images,
        score["labels"],
        score["default"],
        folder / f"{prefix}memory_map.png",
        f"{title}: {name}",
        marked=marked,
    )
    error, variance, default = (score[k].double() for k in ("residual", "variance", "default"))
    figures.error_variance_map(
        error.numpy(),
        variance.numpy(),
        default.numpy(),
        score["regions"].numpy(),
        (ERROR_THRESHOLD, float(torch.quantile(variance, VARIANCE_QUANTILE))),
        folder / f"{prefix}error_variance.png",
        f"{title}: {name}",
        marked=sorted(marked or {}),
    )


def scatter(
    score: dict[str, Any],
    rows: list[dict[str, Any]],
    top: list[int],
    epoch: str,
    path: Path,
    title: str,
) -> None:
    """Estimated against true changes after ``epoch`` epochs: the paper's score against the
    change of the probabilities, the logit score against the change of the logits (the
    form the library picks)."""
    c = changes(rows, score["labels"], epoch)
    examples = c["examples"]
    form = score["auto"]
    panels = {
        f"{form}:{space} score ({epoch} epochs)": {
            "truth": c[f"truth{x}"],
            "estimate": score[f"{form}:{space}"][examples].double().numpy(),
            "floor": c[f"drift{x}"],
            "top": np.isin(np.array(examples), top),
            "xlabel": f"true change ‖{symbol}(without i) − {symbol}‖₁ (retraining)",
        }
        for (space, x), symbol in zip(SPACES.items(), "pf", strict=True)
    }
    figures.sensitivity_scatter(panels, path, title)
