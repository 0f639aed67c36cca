"""The command line shared by the drivers (``experiments.runs.train``, ``compare``, ``tune``,
...), and the one-release aliases of their old names."""

from __future__ import annotations

import argparse
import os
import runpy
import shlex
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

Runner = Callable[..., dict[str, Any]]  # (raw config, out, resume[, seeds=]), or (**options)
Options = Callable[[argparse.ArgumentParser], None]
INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT), as a shell reports it."""


def parser(
    prog: str, doc: str | None, seeds: object = None, options: Options | None = None
) -> argparse.ArgumentParser:
    """The parser of :func:`run`: ``options``' own, else ``CONFIG [--out DIR] [--resume]``
    and, with ``seeds``, ``--seeds``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if options is not None:
        options(parser)
        return parser
    parser.add_argument("config", type=Path, help="TOML config (or a run's config.json)")
    parser.add_argument("--out", type=Path, help="output folder (default: results/CONFIG_NAME)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints")
    if seeds is not None:
        parser.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: config's)")
    return parser


def answer_help(
    prog: str,
    doc: str | None,
    seeds: object = None,
    options: Options | None = None,
    argv: list[str] | None = None,
) -> None:
    """Print the help of :func:`run` and exit 0 if ``argv`` (default: the command line's) asks
    for it, else return: a driver calls it above its imports of torch, so that ``--help``
    takes no time."""
    if asks_help(argv):
        parser(prog, doc, seeds, options).parse_args(argv)


def asks_help(argv: list[str] | None = None) -> bool:
    """Whether ``argv`` (default: the command line's) holds ``-h`` or ``--help``."""
    return bool({"-h", "--help"} & set(sys.argv[1:] if argv is None else argv))


def run(
    prog: str,
    doc: str | None,
    runner: Runner,
    show: Callable[..., None],
    argv: list[str] | None,
    seeds: Callable[[str], list[int]] | None = None,
    options: Options | None = None,
) -> int:
    """Parse ``CONFIG [--out DIR] [--resume]``, run ``runner`` and ``show(results, out)``.

    With ``seeds`` (the parser of its value), ``--seeds`` is an option too, passed on to
    ``runner`` as ``seeds=``. A driver that reads no config and writes no folder passes
    ``options`` instead, which adds its own options to the parser in place of those:
    ``runner`` takes their values as keywords, and ``show`` the results alone.

    Config errors, file-system errors, a folder in use, corrupt run files and divergence
    print one line and exit with 2; Ctrl-C prints one line (what the folder keeps, the
    command that resumes) and exits with 130; a torchrun process other than rank 0 shows
    nothing. The output folder defaults to ``results/CONFIG_NAME``.
    """
    args = parser(prog, doc, seeds, options).parse_args(argv)
    out = None if options is not None else args.out or Path("results") / args.config.stem
    try:
        return _run(args, out, runner, show, seeds)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print(_interrupted(prog, args, out), file=sys.stderr)
        return INTERRUPTED


def _run(
    args: argparse.Namespace,
    out: Path | None,
    runner: Runner,
    show: Callable[..., None],
    seeds: Callable[[str], list[int]] | None,
) -> int:
    """:func:`run` once its arguments are parsed."""
    # imported here, not at the top: they import torch, which would make --help slow
    from experiments.common import config as config_module
    from experiments.common import distributed
    from experiments.common.runfiles import RunError

    try:
        if out is None:
            results = runner(**vars(args))
        else:
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
        from experiments.common.config import ConfigError

        raise ConfigError(
            f"--seeds takes comma-separated integers such as 0,1,2, got {text!r}"
        ) from None


def _interrupted(prog: str, args: argparse.Namespace, out: Path | None) -> str:
    """The line after Ctrl-C: what folder ``out`` keeps and the command that goes on."""
    if out is None:
        return "interrupted; nothing was written"
    words = [str(args.config), "--out", str(out)]
    words += ["--seeds", args.seeds] if getattr(args, "seeds", None) is not None else []
    command = f"{prog} {shlex.join(words)}"
    kept = _kept(out) if out.is_dir() else None  # no folder: its modules may not be imported
    if kept is None:
        return f"interrupted; nothing was written to {out}; start again with: {command}"
    return f"interrupted: {out} keeps {kept}; resume with: {command} --resume"


def _kept(out: Path) -> str | None:
    """What run folder ``out`` keeps: its runs' checkpoints and their passes (None: nothing)."""
    from experiments.common import runfiles

    runs = sorted({path.parent for path in out.rglob("checkpoint*.pt")})
    if runs == [out]:
        return f"its checkpoint{_reached(out)}"
    if runs:
        shown = ", ".join(f"{run.relative_to(out).as_posix()}{_reached(run)}" for run in runs[:5])
        more = f" and {len(runs) - 5} more" if len(runs) > 5 else ""
        return f"the checkpoints of {shown}{more}"
    return "no checkpoint yet" if runfiles.contents(out) else None


def _reached(run: Path) -> str:
    """`` after pass N``, the passes done that the checkpoint of ``run`` holds, or nothing."""
    from experiments.common import runfiles

    try:
        state = runfiles.load_torch(min(run.glob("checkpoint*.pt")))
    except (OSError, runfiles.RunError):
        return ""
    done = state.get("epoch") if isinstance(state, dict) else None
    return "" if done is None else f" after pass {done}"


def _message(err: Exception) -> str:
    """One line: the file and the reason for a file-system error, else the message."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"cannot use {err.filename}: {err.strerror}"
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def alias(old: str, new: str) -> None:
    """``python -m OLD ARGS``, a name kept for one release: says the new name on stderr, then
    runs ``python -m NEW ARGS``."""
    print(f"note: {old} is now {new}; the old name goes in the next release", file=sys.stderr)
    runpy.run_module(new, run_name="__main__", alter_sys=True)
