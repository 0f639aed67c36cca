"""The command line shared by the drivers (``experiments.train``, ``compare``, ``tune``, ...),
and the one of the helper modules, which say what they are and which driver to run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from experiments import config as config_module
from experiments import distributed
from experiments.runfiles import RunError

Runner = Callable[..., dict[str, Any]]  # (raw config, out, resume[, seeds=]), or (**options)


def run(
    prog: str,
    doc: str | None,
    runner: Runner,
    show: Callable[..., None],
    argv: list[str] | None,
    seeds: Callable[[str], list[int]] | None = None,
    options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse ``CONFIG [--out DIR] [--resume]``, run ``runner`` and ``show(results, out)``.

    With ``seeds`` (the parser of its value), ``--seeds`` is an option too, passed on to
    ``runner`` as ``seeds=``. A driver that reads no config and writes no folder passes
    ``options`` instead, which adds its own options to the parser in place of those:
    ``runner`` takes their values as keywords, and ``show`` the results alone.

    Config errors, file-system errors, a folder in use, corrupt run files and divergence
    print one line and exit with 2; a torchrun process other than
    rank 0 shows nothing. The output folder defaults to ``results/CONFIG_NAME``.
    """
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if options is not None:
        options(parser)
    else:
        parser.add_argument("config", type=Path, help="TOML config (or a run's config.json)")
        parser.add_argument("--out", type=Path, help="output folder (default: results/CONFIG_NAME)")
        parser.add_argument("--resume", action="store_true", help="continue from the checkpoints")
        if seeds is not None:
            parser.add_argument(
                "--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: config's)"
            )
    args = parser.parse_args(argv)
    out: Path | None = None
    try:
        if options is not None:
            results = runner(**vars(args))
        else:
            out = args.out or Path("results") / args.config.stem
            if seeds is not None and args.seeds is not None:
                runner = partial(runner, seeds=seeds(args.seeds))
            results = runner(config_module.load(args.config), out, args.resume)
    except (ValueError, OSError, RunError) as err:
        print(f"error: {_message(err)}", file=sys.stderr)
        return 2
    finally:
        distributed.leave()
    if results and out is None:
        show(results)
    elif results:  # empty on torchrun processes other than rank 0
        show(results, out)
    return 0


def parse_seeds(text: str) -> list[int]:
    """The value of ``--seeds``: comma-separated integers."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise config_module.ConfigError(
            f"--seeds takes comma-separated integers such as 0,1,2, got {text!r}"
        ) from None


def _message(err: Exception) -> str:
    """One line: the file and the reason for a file-system error, else the message."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"cannot use {err.filename}: {err.strerror}"
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


if __name__ == "__main__":
    from experiments import usage

    raise SystemExit(usage.helper("experiments.cli", __doc__, list(usage.DRIVERS)))
