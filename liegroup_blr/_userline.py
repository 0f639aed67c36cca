"""Warnings that point at the user's line, as torch's do, whatever the depth of the call."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

__all__ = ["warn"]

INSIDE = (
    os.path.dirname(__file__) + os.sep,
    os.path.dirname(torch.__file__) + os.sep,  # no_grad, the step hooks, GradScaler.step
    contextlib.__file__,  # the exit of a @contextmanager block
)
"""Files whose frames are the library's or its framework's, not the user's."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first calling frame outside liegroup_blr, torch
    and contextlib: the user's line."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
