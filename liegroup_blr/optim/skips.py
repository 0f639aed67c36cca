"""What a skipped step says: the value that was not finite, the parameter it belongs to, and
the likely fix of a diverged run (the engine's warning and ``FloatingPointError``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .tensors import Proposal, Work

__all__ = ["non_finite", "param_name", "skip_fix"]


def non_finite(
    param_groups: list[dict[str, Any]],
    loss_finite: bool,
    found_inf: bool,
    finite: bool,
    work: list[Work],
    proposals: list[Proposal],
) -> str:
    """What was not finite in a skipped step (for its warning or error): the loss, a
    gradient (an inf a GradScaler found, or a new momentum: the algebra gradient of the
    loss and the prior), an updated element (or one that is not in its group, a rule's
    proposal refused), or a value on another process (``finite``: after the processes'
    verdicts) or another shard's rank."""
    if not loss_finite:
        return "loss"
    if found_inf:
        return "gradient (the GradScaler found an inf)"
    if not finite:
        return "loss or gradient on another process"
    for (index, _, t), proposal in zip(work, proposals, strict=False):
        count = len(t.keys)
        for i, checked in enumerate(proposal.checked):
            if not bool(checked.isfinite().all()):
                kind = "gradient" if i < count else "updated element"
                return f"{kind} of {param_name(param_groups, index, t.keys[i % count])}"
    if len(proposals) < len(work):  # the rule refused the next group's proposal
        index, _, t = work[len(proposals)]
        for p, acc in zip(t.keys, t.accs, strict=True):
            if not bool(acc.isfinite().all()):
                return f"gradient of {param_name(param_groups, index, p)}"
        names = ", ".join(param_name(param_groups, index, p) for p in t.keys)
        return f"updated element (or one not in its group) of {names}"
    return "value on another rank of the sharded parameters"


def param_name(param_groups: list[dict[str, Any]], index: int, p: Tensor) -> str:
    """``p`` as a message names it: by the name the optimizer was given
    (``named_parameters()``), else by its position in param group ``index``."""
    group = param_groups[index]
    position = next(i for i, q in enumerate(group["params"]) if q is p)
    names = group.get("param_names")
    if names is not None and position < len(names):
        return f"parameter {names[position]!r}"
    return f"parameter {position} of param group {index}"


def skip_fix(param_groups: list[dict[str, Any]]) -> str:
    """The likely fixes of a diverged run, as its error names them."""
    scale = any("scale_lr" in group for group in param_groups)
    rates = "lr or the scale's step (scale_step or scale_lr)" if scale else "lr"
    return (
        f"Lower {rates}, or widen the prior: one much narrower than the data allows (a "
        "large prior_precision, or a posterior from next_task/set_prior: lower its "
        "strength) makes the updates overflow"
    )
