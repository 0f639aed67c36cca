"""Help-time benchmark: ``python -m experiments.MODULE --help`` against ``python -c pass``.

Every driver and benchmark of experiments/ answers ``--help`` before it
imports torch or matplotlib (issue 50: it took 3.6–4 s). Each module's ``--help`` is run in
a fresh process, interleaved with ``python -c pass``; the ratio of the median times is
printed per module, and the worst against the target (at most 3).

Run: ``python -m experiments.benchmarks.help_time [--rounds 5] [--modules train cli ...]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALIAS = re.compile(r"^\s+cli\.alias\(", re.M)
"""The call that makes a module the one-release alias of an old command."""
TARGET = 3.0
"""The most a module's ``--help`` may take, in times ``python -c pass``."""


def modules() -> list[str]:
    """Every command of experiments/ (a module with a ``__main__`` block, the one-release
    aliases of old names left out), by its name after ``experiments.``."""
    found = []
    for path in (ROOT / "experiments").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if 'if __name__ == "__main__"' in text and not ALIAS.search(text):
            found.append(".".join(path.relative_to(ROOT / "experiments").with_suffix("").parts))
    return sorted(found)


def seconds(command: list[str]) -> float:
    """The wall-clock time of ``command``, which must exit with 0."""
    begun = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - begun
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command[1:])} exited with {done.returncode}: {done.stderr}")
    return took


def measure(names: list[str], rounds: int) -> tuple[float, dict[str, float]]:
    """The median seconds of ``python -c pass`` and each module's median ÷ it; every
    module's run follows one of ``python -c pass``, round after round."""
    base: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in names}
    for done in range(rounds):
        for name in names:
            base.append(seconds([sys.executable, "-c", "pass"]))
            times[name].append(seconds([sys.executable, "-m", f"experiments.{name}", "--help"]))
        print(f"round {done + 1} of {rounds} done", file=sys.stderr)
    floor = statistics.median(base)
    return floor, {name: statistics.median(t) / floor for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.help_time", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--modules", nargs="+", choices=modules(), help="default: all")
    args = parser.parse_args(argv)
    floor, ratios = measure(args.modules or modules(), args.rounds)
    print(f"python -c pass: {floor * 1e3:.0f} ms (median of {len(ratios) * args.rounds})\n")
    print(f"{'module':<28}{'--help ÷ pass':>14}")
    for name, ratio in ratios.items():
        print(f"{name:<28}{ratio:>14.2f}")
    worst = max(ratios, key=ratios.__getitem__)
    verdict = "within" if ratios[worst] <= TARGET else "OVER"
    print(
        f"\nworst: {worst} {ratios[worst]:.2f} × python -c pass ({verdict} the target ≤ {TARGET:g})"
    )


if __name__ == "__main__":
    main()
