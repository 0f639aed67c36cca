"""The usage text of the helper modules: ``python -m experiments.MODULE`` of a module that is
a part of the drivers, not a command, says what it is and which driver to run. A leaf: it
imports nothing of the project, so any module may import it late."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence

DRIVERS = {
    "train": ("CONFIG.toml", "one run"),
    "compare": ("CONFIG.toml", "several runs and seeds side by side, and their report"),
    "tune": ("CONFIG.toml", "grids of the runs on a validation split"),
    "continual": ("CONFIG.toml", "task streams (continual learning)"),
    "memory_map": ("CONFIG.toml | RUN_FOLDER", "memory maps, checked against retraining"),
    "memory_converged": ("CONFIG.toml", "memory maps against retraining to convergence"),
    "memory_loo": ("CONFIG.toml", "the estimated leave-one-out NLL across prior precisions"),
    "peers": ("CONFIG.toml", "the runs and post-hoc Laplace fits (the peers' environment)"),
}
"""The drivers a helper module can name: their arguments and what they do."""


def helper(
    module: str, doc: str | None, drivers: Sequence[str], argv: list[str] | None = None
) -> int:
    """The command line of a helper module (``python -m experiments.MODULE``): it prints what
    the module is and which drivers to run; exit status 0 for ``--help``/``-h``, else 2 (the
    same text on stderr)."""
    commands = [f"python -m experiments.{name} {DRIVERS[name][0]}" for name in drivers]
    width = max(len(c) for c in commands) + 2
    lines = [f"{module}: a part of the experiment drivers, not a command.", ""]
    lines += [inspect.cleandoc(doc or ""), "", "Run a driver instead:"]
    lines += [f"    {c:<{width}}{DRIVERS[n][1]}" for c, n in zip(commands, drivers, strict=True)]
    lines += ["", "experiments/README.md lists every command and config key."]
    text = "\n".join(lines)
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):
        print(text)
        return 0
    print(f"error: {text}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(helper("experiments.usage", __doc__, list(DRIVERS)))
