"""The command line shared by ``experiments.train`` and ``experiments.compare``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import config as config_module
from experiments import distributed

Runner = Callable[[dict[str, Any], Path, bool], dict[str, Any]]


def run(
    prog: str,
    doc: str | None,
    runner: Runner,
    show: Callable[[dict[str, Any], Path], None],
    argv: list[str] | None,
) -> int:
    """Parse ``CONFIG [--out DIR] [--resume]``, run ``runner`` and ``show`` its results.

    Config and file errors print one line and exit with 2; a torchrun process other than
    rank 0 shows nothing. The output folder defaults to ``results/CONFIG_NAME``.
    """
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", type=Path, help="TOML config (or a run's config.json)")
    parser.add_argument("--out", type=Path, help="output folder (default: results/CONFIG_NAME)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints")
    args = parser.parse_args(argv)
    out = args.out or Path("results") / args.config.stem
    try:
        results = runner(config_module.load(args.config), out, args.resume)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        distributed.leave()
    if results:  # empty on torchrun processes other than rank 0
        show(results, out)
    return 0
