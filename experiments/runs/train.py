"""Train and evaluate one run from a config file.

    python -m experiments.runs.train CONFIG.toml [--out DIR] [--resume]

The output folder receives ``config.json`` (the resolved config), ``metrics.jsonl`` (one
line per epoch), ``checkpoint.pt`` (model, optimizer, RNG states and the metrics history,
replaced atomically each epoch), ``results.json`` (final metrics) and the figures.
``--resume`` continues from the checkpoint and reaches the same final state as an
uninterrupted run; on a finished run it only re-evaluates. The run holds a lock on its
folder; docs/runs.md says what is on disk at each instant. Under ``torchrun`` the same
command trains over processes (experiments/common/distributed.py).
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.runs.train"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__)

import sys
from pathlib import Path
from typing import Any

from experiments.common.training import train


def _show(results: dict[str, Any], out: Path) -> None:
    for estimate in ("point", "mean", "average"):
        if estimate not in results:
            continue
        m = results[estimate]
        print(
            f"{estimate:>8}: accuracy {100 * m['accuracy']:.2f}%, NLL {m['nll']:.4f}, "
            f"ECE {m['ece']:.4f}, Brier {m['brier']:.4f}"
        )
    print(f"results in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, train, _show, argv)


if __name__ == "__main__":
    sys.exit(main())
