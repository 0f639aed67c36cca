"""The numbers on the documentation pages, generated from committed result summaries.

    python -m experiments.reporting.docs_tables summarise RESULTS_FOLDER [--name NAME]
    python -m experiments.reporting.docs_tables write
    python -m experiments.reporting.docs_tables check

``summarise`` turns the results folder of a driver (compare's, continual's and memory_map's
``results.json``, tune's ``tuned.json``) into ``docs/results/NAME.json`` (NAME: the folder's
name): per run label its seeds and every number of its results as ``{"mean", "sd",
"values"}`` (the sample standard deviation over the seeds, None for one seed) under a dotted
key such as ``point.accuracy``, ``sparsity.average.hoyer`` or ``ood.noise.point`` (tune: per
grid point ``I.average.nll``, ``I.values.lr``, and ``chosen``).

``write`` regenerates what README.md and the pages under docs/ quote from those summaries
between markers; ``check`` exits with 1 and names every page whose quotes are stale. A table
of :data:`TABLES` sits between

    <!-- table NAME -->
    ...
    <!-- end table -->

and one number in a sentence between ``<!-- n SUMMARY LABEL KEY FORMAT -->`` and
``<!-- /n -->``, FORMAT ``FACTOR:DECIMALS`` (the mean), ``FACTOR:DECIMALS±`` (mean ± sd) or
``FACTOR:DECIMALS,`` (the per-seed values): ``<!-- n cpu_default sgd point.accuracy 100:1± -->``
gives ``91.6 ± 0.2``. The markers are HTML comments, which neither Sphinx nor GitHub shows; a
number's marker must not begin a line (Markdown would read the line as HTML), and a marker
right after a backtick (in a code span) is an example, left alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.common import cli


def _parser() -> argparse.ArgumentParser:
    """The command line: ``summarise FOLDER``, ``write`` or ``check``."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.reporting.docs_tables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summarise = commands.add_parser("summarise", help="a results folder → docs/results/NAME.json")
    summarise.add_argument("folder", type=Path, help="a driver's output folder")
    summarise.add_argument("--name", help="the summary's name (default: the folder's)")
    commands.add_parser("write", help="regenerate the quotes of README.md and docs/")
    commands.add_parser("check", help="exit 1 if a page's quotes are stale")
    return parser


if __name__ == "__main__" and cli.asks_help():  # before the imports of torch: --help is quick
    _parser().parse_args()

import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from experiments.common import runfiles
from experiments.common.tables import LEFT, RIGHT, markdown
from experiments.continual.report import diverged_note
from experiments.runs.compare import summarise

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: its README.md, docs/ and docs/results/."""
STAT = {"mean", "sd", "values"}

TABLE = re.compile(r"(?<!`)<!-- table (?P<name>\S+) -->\n(?P<body>.*?)<!-- end table -->", re.S)
NUMBER = re.compile(  # a marker in a code span (after a backtick) is an example, left alone
    r"(?<!`)<!-- n (?P<summary>\S+) (?P<label>\S+) (?P<key>\S+) (?P<format>\S+) -->"
    r"(?P<text>.*?)<!-- /n -->",
    re.S,
)
FORMAT = re.compile(r"(?P<factor>[0-9.e+-]+):(?P<decimals>[0-9]+)(?P<kind>[±,]?)")


# --------------------------------------------------------------------------- summaries
def flatten(obj: Any, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every number of ``obj`` by dotted key: a ``{"mean", "sd", "values"}`` leaf as it is, a
    bare number as the summary of one value; strings, booleans and None are left out."""
    if isinstance(obj, dict) and set(obj) == STAT:
        return {prefix: obj}
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return {prefix: {"mean": float(obj), "sd": None, "values": [float(obj)]}}
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    out: dict[str, dict[str, Any]] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _tuned(folder: Path) -> dict[str, Any]:
    """Per label of a tuning: the chosen point and each point's values and summarised runs."""
    config = runfiles.read_json(folder / "config.json")
    labels = {}
    for label, res in runfiles.read_json(folder / "tuned.json").items():
        numbers: dict[str, Any] = {"chosen": res["chosen"]}
        for i, point in enumerate(res["points"]):
            runs = point["runs"]
            numbers[str(i)] = {"values": point["values"]}
            if all(r is not None for r in runs):
                numbers[str(i)].update(summarise(runs))
            else:
                numbers[str(i)]["diverged"] = 1
        seeds = [int(s) for s in config[f"{label}.0"]]
        labels[label] = {"seeds": seeds, "metrics": flatten(numbers)}
    return labels


def summarise_folder(folder: Path) -> dict[str, Any]:
    """The summary of a results folder (see the module's docstring)."""
    if (folder / "tuned.json").exists():
        return {"config": folder.name, "source": "tuned.json", "labels": _tuned(folder)}
    if not (folder / "results.json").exists():
        raise runfiles.RunError(f"{folder} holds no results.json or tuned.json of a driver")
    labels = {}
    for label, res in runfiles.read_json(folder / "results.json").items():
        seeds = res.get("seeds") or [int(s) for s in res["per_seed"]]
        labels[label] = {"seeds": seeds, "metrics": flatten(res["summary"])}
        if res.get("diverged_seeds"):
            labels[label]["diverged"] = res["diverged_seeds"]
    return {"config": folder.name, "source": "results.json", "labels": labels}


def load_summaries(folder: Path) -> dict[str, dict[str, Any]]:
    """The summaries in ``folder``: name → summary (none if the folder does not exist)."""
    paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
    return {path.stem: runfiles.read_json(path) for path in paths}


def stat(summaries: Mapping[str, Any], name: str, label: str, key: str) -> dict[str, Any]:
    """One number of a summary, or a ValueError naming what is missing."""
    if name not in summaries:
        raise ValueError(f"no summary {name!r} in docs/results/ (have {sorted(summaries)})")
    labels = summaries[name]["labels"]
    if label not in labels:
        raise ValueError(f"summary {name!r} has no run {label!r} (have {sorted(labels)})")
    metrics = labels[label]["metrics"]
    if key not in metrics:
        raise ValueError(f"summary {name!r}, run {label!r} has no number {key!r}")
    return metrics[key]


# ----------------------------------------------------------------------------- quoting
def number(leaf: Mapping[str, Any], spec: str) -> str:
    """A summary leaf as ``spec`` says (see the module's docstring)."""
    match = FORMAT.fullmatch(spec)
    if match is None:
        raise ValueError(f"number format {spec!r}: write FACTOR:DECIMALS, then ± or , or nothing")
    factor, decimals = float(match["factor"]), int(match["decimals"])

    def show(value: float) -> str:  # a blown-up value (an NLL of 1e30) in powers of ten
        return f"{value:.1e}" if abs(value) >= 1e6 else f"{value:.{decimals}f}"

    if match["kind"] == ",":
        return ", ".join(show(factor * v) for v in leaf["values"])
    mean = show(factor * leaf["mean"])
    if match["kind"] == "±" and leaf["sd"] is not None:
        return f"{mean} ± {show(factor * leaf['sd'])}"
    return mean


@dataclass(frozen=True)
class Metric:
    """A column of numbers: ``key`` in a summary (``{est}``: the row's estimate), shown as
    :func:`number` with ``FACTOR:DECIMALS±``."""

    header: str
    key: str
    factor: float = 1.0
    decimals: int = 3


@dataclass(frozen=True)
class Table:
    """A Markdown table of the summary ``summary``: text columns (header, alignment
    :data:`~experiments.common.tables.LEFT` or :data:`~experiments.common.tables.RIGHT`),
    then ``metrics``;
    one row per (label, estimate, text cells)."""

    summary: str
    text: tuple[tuple[str, str], ...]
    rows: tuple[tuple[str, str, tuple[str, ...]], ...]
    metrics: tuple[Metric, ...]


def table(spec: Table, summaries: Mapping[str, Any]) -> str:
    """The Markdown of ``spec`` with the numbers of ``summaries``; a run with diverged seeds (of
    a continual stream) names them after its first cell, and one that diverged on every seed
    says so in place of its numbers."""
    head = [h for h, _ in spec.text] + [m.header for m in spec.metrics]
    align = [a for _, a in spec.text] + [RIGHT] * len(spec.metrics)
    rows = []
    for label, estimate, cells in spec.rows:
        run = summaries.get(spec.summary, {}).get("labels", {}).get(label, {})
        seeds, diverged = run.get("seeds", []), run.get("diverged", [])
        note = diverged_note(seeds, diverged)
        if diverged and len(diverged) == len(seeds):
            rows.append([*cells, note, *[""] * (len(spec.metrics) - 1)])
            continue
        values = [
            number(
                stat(summaries, spec.summary, label, m.key.format(est=estimate)),
                f"{m.factor:g}:{m.decimals}±",
            )
            for m in spec.metrics
        ]
        rows.append([f"{cells[0]} ({note})" if note else cells[0], *cells[1:], *values])
    return "\n".join(markdown(head, rows, align)) + "\n"


def render(text: str, summaries: Mapping[str, Any], tables: Mapping[str, Table]) -> str:
    """``text`` with every marked table and number regenerated from ``summaries``."""

    def fill_table(m: re.Match[str]) -> str:
        if m["name"] not in tables:
            raise ValueError(f"no table {m['name']!r} in experiments.reporting.docs_tables.TABLES")
        return (
            f"<!-- table {m['name']} -->\n{table(tables[m['name']], summaries)}<!-- end table -->"
        )

    filled = TABLE.sub(fill_table, text)

    def fill_number(m: re.Match[str]) -> str:
        if not filled[filled.rfind("\n", 0, m.start()) + 1 : m.start()].strip():
            raise ValueError(
                f"{m[0][:60]!r} begins a line, where Markdown reads it as a block of HTML: "
                "move it after a word"
            )
        value = number(stat(summaries, m["summary"], m["label"], m["key"]), m["format"])
        return m[0][: m.start("text") - m.start()] + value + "<!-- /n -->"

    return NUMBER.sub(fill_number, filled)


# ------------------------------------------------------------------- the pages' tables
PREDICTIVE = (
    Metric("accuracy (%)", "{est}.accuracy", 100.0, 1),
    Metric("NLL", "{est}.nll"),
    Metric("ECE", "{est}.ece"),
    Metric("Brier", "{est}.brier"),
)
SPARSITY = (
    Metric("max abs w", "sparsity.{est}.max_abs", 1.0, 2),
    Metric("median abs w", "sparsity.{est}.median_abs", 1.0, 4),
    Metric("near 0 (%)", "sparsity.{est}.near_zero", 100.0, 2),
    Metric("below 1e-3 max (%)", "sparsity.{est}.near_zero_max", 100.0, 1),
    Metric("Hoyer", "sparsity.{est}.hoyer"),
)
OOD = tuple(Metric(s, f"ood.{s}.{{est}}") for s in ("rotated", "permuted", "noise"))
RULE_ESTIMATE = (("rule", LEFT), ("estimate", LEFT))
ESTIMATE_NAMES = {"point": "at g", "mean": "at the mean", "average": "average of 32"}
CPU_DEFAULT_ROWS = tuple(
    (rule, est, (rule, ESTIMATE_NAMES[est]))
    for rule in ("sgd", "additive", "multiplicative", "affine", "ivon")
    for est in ("point", "mean", "average")
    if (rule != "sgd" or est == "point") and (rule == "multiplicative" or est != "mean")
)
"""Rows of the CPU default's tables: every rule at g and averaged (SGD at g alone), the
multiplicative rule also at its posterior mean E[θ] (where the other rules' estimates
coincide with g)."""
CPU_DEFAULT_SPARSITY_ROWS = tuple(row for row in CPU_DEFAULT_ROWS if row[1] != "mean")
README_RULES = {
    "sgd": ("SGD", "1"),
    "additive": ("additive (σ = 10⁻³)", "4"),
    "multiplicative": ("multiplicative", "4"),
    "affine": ("affine (Gaussian)", "1"),
    "ivon": ("IVON", "1"),
}

REFERENCE_ROWS = tuple(
    (rule, est, (rule, ESTIMATE_NAMES[est]))
    for rule, estimates in (
        ("sgd", ("point",)),
        ("additive", ("point", "average")),
        ("multiplicative", ("point", "mean", "average")),
    )
    for est in estimates
)
"""Rows of the reference network's tables: SGD at g, the additive rule at g and averaged, the
multiplicative rule also at its posterior mean."""

CNN_ROWS = tuple(
    (rule, est, (rule, ESTIMATE_NAMES[est].replace("32", "8"))) for rule, est, _ in REFERENCE_ROWS
)
"""Rows of the CNN's tables: the reference network's, with model averages of 8 samples."""

TAILS_ROWS = tuple(
    (base, est, (base, ESTIMATE_NAMES[est]))
    for base in ("gaussian", "laplace", "student_t")
    for est in ("point", "average")
)
"""Rows of the heavy-tailed bases' table: each base at g and averaged."""

CONTINUAL = (
    Metric("final avg. accuracy (%)", "{est}.final_accuracy", 100.0, 1),
    Metric("task 1 after task 1 (%)", "{est}.first_task", 100.0, 1),
    Metric("forgetting (%)", "{est}.forgetting", 100.0, 1),
    Metric("NLL", "{est}.nll"),
    Metric("ECE", "{est}.ece"),
)
CONTINUAL_TEXT = (
    ("method", LEFT),
    ("prior of each new task", LEFT),
    ("memory (40 per task)", LEFT),
    ("tuned over", LEFT),
)
CONTINUAL_BASELINES = (
    ("finetune", "point", ("Adam, fine-tuning", "—", "—", "9: step × δ")),
    ("ewc", "point", ("Adam, online EWC", "—", "—", "9: step × λ")),
    ("ewc_replay_random", "point", ("Adam, online EWC", "—", "replay, random", "9: step × weight")),
    ("joint", "point", ("Adam, joint (all data so far)", "—", "every example", "not tuned")),
)
POSTERIOR = "the posterior so far"
TWICE = "the posterior so far (the past counted twice)"
DELTA = "δ-prior at the previous mean"
VARIANTS = {
    "": (POSTERIOR, "—", "9: step × w"),
    "_no_prior": ("the first task's (prior removed)", "—", "9: step × δ or τ"),
    "_delta": (DELTA, "—", "9: step × δ"),
    "_kprior_lambda": (DELTA, "K-prior, λ", "9: step × weight"),
    "_kprior_random": (DELTA, "K-prior, random", "9: step × weight"),
    "_posterior_kprior_lambda": (TWICE, "K-prior, λ", "9: step × weight"),
    "_posterior_kprior_random": (TWICE, "K-prior, random", "9: step × weight"),
    "_posterior_kprior_score": (TWICE, "K-prior, memory-map score", "9: step × weight"),
    "_posterior_fromp_logits_lambda": (TWICE, "FROMP on the logits, λ", "9: step × weight"),
    "_replay_random": (POSTERIOR, "replay, random", "9: step × weight"),
}
"""A rule's row by its label's suffix: (the prior of each new task, the memory, the budget)."""
RULES = ("affine", "additive", "multiplicative")
COMPOSED = (*(key for key in VARIANTS if key.startswith("_posterior_")), "_replay_random")
"""The memory rows with the posterior as prior."""
OTHER_COMPOSED = ("_posterior_kprior_lambda", "_replay_random")
"""The additive and multiplicative rules' memory rows with the posterior as prior."""


def continual_rows(memories: dict[str, tuple[str, ...]], budget: bool = True) -> tuple[Any, ...]:
    """Rows of a continual stream's table: Adam's methods at their point estimate, then each
    rule's model average with its posterior as prior, without it, and its other rows (rule →
    the suffixes of :data:`VARIANTS` it has beside those two); without the equal ``budget``,
    each tuned row says it had a grid of its own."""
    rows = CONTINUAL_BASELINES + tuple(
        (rule + suffix, "average", (f"{rule} rule, average of 32", *VARIANTS[suffix]))
        for rule, kept in memories.items()
        for suffix in ("", "_no_prior", *kept)
    )
    if budget:
        return rows
    own = ("its own grid", "same point as with the prior")
    return tuple(
        (label, est, (*cells[:-1], own["no_prior" in label] if cells[-1][0] == "9" else cells[-1]))
        for label, est, cells in rows
        if any(memories.values()) or label != "ewc_replay_random"
    )


PERMUTED_TUNING = {
    "finetune": "17: step × δ 9, step 8 before; interior (δ = 0: no prior)",
    "ewc": "21: step × λ 12 in two rounds, λ 9 before; interior",
    "ewc_replay_random": "34: step × weight × λ in three rounds; interior",
    "joint": "not tuned",
    "affine": "36: step × w 10 in two rounds, τ 26 before; interior",
    "affine_no_prior": "46: step × δ 20 in four rounds, τ 26 before; interior",
    "affine_delta": "35: step × δ 9, τ 26 before; interior",
    "affine_kprior_lambda": "38: step × weight 12, τ 26 before; the next step diverged",
    "affine_kprior_random": "35: step × weight 9, τ 26 before; interior",
    "affine_posterior_kprior_lambda": "36: step × weight 10 in two rounds, τ 26 before; the "
    "next step diverged",
    "affine_posterior_kprior_random": "35: step × weight 9, τ 26 before; interior",
    "affine_posterior_fromp_logits_lambda": "38: step × weight 12 in two rounds, τ 26 before; "
    "the next step diverged",
    "affine_replay_random": "39: step × weight 13 in two rounds, τ 26 before; the next step "
    "diverged",
    "additive": "40: step × w 11 in three rounds, τ 29 before; interior",
    "additive_no_prior": "43: step × τ 14 (8 distinct: τ has no effect) in five rounds, τ 29 "
    "before; interior",
    "additive_posterior_kprior_lambda": "39: step × weight 10 in two rounds, τ 29 before; interior",
    "additive_replay_random": "40: step × weight 11 in three rounds, τ 29 before; interior",
    "multiplicative": "33: step × w 10 in two rounds, τ 23 before; interior",
    "multiplicative_no_prior": "33: step × τ 10 in two rounds, τ 23 before; interior",
    "multiplicative_posterior_kprior_lambda": "35: step × weight 12 in two rounds, τ 23 before; "
    "the next step diverged",
    "multiplicative_replay_random": "33: step × weight 10 in two rounds, τ 23 before; the next "
    "step diverged",
}
"""Each permuted row's whole tuning budget (the distinct points of every grid it had, and the
temperature × step grids before them whose temperature a rule keeps), the grids' knobs, and
where its choice sits in its last grid."""
SINGLE_TUNING = {
    "finetune": "17: step × δ 9, step 8 before; interior (δ = 0: no prior)",
    "ewc": "23: step × λ 14 in three rounds, λ 9 before; interior",
    "ewc_replay_random": "11: step × weight 9, then λ; interior",
    "joint": "not tuned",
    "affine": "65: step × w 14 in three rounds, τ 51 before; interior",
    "affine_no_prior": "61: step × δ 10 in two rounds, τ 51 before; the next step diverged",
    "affine_delta": "60: step × δ 9, τ 51 before; interior (all ≈ 19 %)",
    "affine_kprior_lambda": "63: step × weight 12, τ 51 before; the next step diverged",
    "affine_kprior_random": "67: step × weight 16, τ 51 before; interior",
    "affine_posterior_kprior_lambda": "60: step × weight 9, τ 51 before; interior",
    "affine_posterior_kprior_random": "63: step × weight 12 in two rounds, τ 51 before; interior",
    "affine_posterior_kprior_score": "60: step × weight 9, τ 51 before; interior",
    "affine_posterior_fromp_logits_lambda": "60: step × weight 9, τ 51 before; interior",
    "affine_replay_random": "62: step × weight 11 in three rounds, τ 51 before; interior",
    "additive": "69: step × w 10 in two rounds, τ 59 before; the next w diverged",
    "additive_no_prior": "69: step × τ 10 in two rounds, τ 59 before; τ has no effect",
    "additive_posterior_kprior_lambda": "69: step × weight 10 in two rounds, τ 59 before; interior",
    "additive_replay_random": "68: step × weight 9, τ 59 before; interior",
    "multiplicative": "55: step × w 12 in two rounds, τ 43 before; the next step diverged, "
    "w 1000 level",
    "multiplicative_no_prior": "53: step × τ 10 in two rounds, τ 43 before; the next τ diverged",
    "multiplicative_posterior_kprior_lambda": "53: step × weight 10 in two rounds, τ 43 before; "
    "the next step diverged",
    "multiplicative_replay_random": "53: step × weight 10 in two rounds, τ 43 before; the next "
    "step diverged",
}
"""The same for each single-head Split row."""


def with_tuning(rows: tuple[Any, ...], tuning: dict[str, str]) -> tuple[Any, ...]:
    """``rows`` with each one's last cell (how it was tuned) taken from ``tuning``."""
    return tuple((label, est, (*cells[:-1], tuning[label])) for label, est, cells in rows)


CONTINUAL_ROWS = {
    "continual_permuted": with_tuning(
        continual_rows(
            {
                "affine": (
                    "_delta",
                    "_kprior_lambda",
                    "_kprior_random",
                    *(m for m in COMPOSED if m != "_posterior_kprior_score"),
                ),
                "additive": OTHER_COMPOSED,
                "multiplicative": OTHER_COMPOSED,
            }
        ),
        PERMUTED_TUNING,
    ),
    "continual_split": continual_rows(dict.fromkeys(RULES, ()), budget=False),
    "continual_split_single": with_tuning(
        continual_rows(
            {
                "affine": ("_delta", "_kprior_lambda", "_kprior_random", *COMPOSED),
                "additive": OTHER_COMPOSED,
                "multiplicative": OTHER_COMPOSED,
            }
        ),
        SINGLE_TUNING,
    ),
}
"""Rows of each stream's table (the multi-head Split stream: no memory rows; the permuted
stream: the affine rule's rows but the memory-map score's)."""
CONTINUAL_RULES = {
    stream: {label for label, estimate, _ in rows if estimate == "average"}
    for stream, rows in CONTINUAL_ROWS.items()
}
"""The labels of each stream's rule rows."""
CONTINUAL_ESTIMATE_ROWS = tuple(
    (rule, est, (rule, ESTIMATE_NAMES[est]))
    for rule in ("additive", "affine", "multiplicative")
    for est in ("point", "mean", "average")
    if rule == "multiplicative" or est != "mean"
)
"""The rules' estimates on a continual stream: at g, at the posterior mean (multiplicative;
the other rules' coincide with g) and the model average."""
SCALE_CASES = {"readme": "README example", "digits": "digits 0–4", "mnist5k": "MNIST-5k"}
SCALE_LAYERS = ("0.weight", "0.bias", "2.weight", "2.bias")
SCALE_ROWS = tuple(
    (f"{case}_{kind}", layer, (name, words, layer))
    for case, name in SCALE_CASES.items()
    for kind, words in (("old", "lr=1, scale_lr=0.05"), ("new", "defaults"))
    for layer in SCALE_LAYERS
)
SCALE_TEXT = (("case", LEFT), ("values", LEFT), ("tensor", LEFT))
SCALE_PASSES = tuple(Metric(f"pass {k}", f"pass{k}.{{est}}", decimals=2) for k in (1, 3, 10, 30))
SCALE_CHECKS = (
    Metric("σ*: drift", "drift.{est}", decimals=3),
    Metric("σ* (long) ÷ σ* (Hessian)", "long_over_hessian.{est}", decimals=2),
)
STREAMS = ("continual_permuted", "continual_split", "continual_split_single")

TABLES: dict[str, Table] = {
    "cpu_default/predictive": Table("cpu_default", RULE_ESTIMATE, CPU_DEFAULT_ROWS, PREDICTIVE),
    "cpu_default/sparsity": Table(
        "cpu_default", RULE_ESTIMATE, CPU_DEFAULT_SPARSITY_ROWS, SPARSITY
    ),
    "cpu_default/ood": Table("cpu_default", RULE_ESTIMATE, CPU_DEFAULT_ROWS, OOD),
    "mnist5k_reference/predictive": Table(
        "mnist5k_reference", RULE_ESTIMATE, REFERENCE_ROWS, PREDICTIVE
    ),
    "mnist5k_reference/sparsity": Table(
        "mnist5k_reference",
        RULE_ESTIMATE,
        tuple(row for row in REFERENCE_ROWS if row[1] != "mean"),
        SPARSITY,
    ),
    "mnist5k_cnn/predictive": Table("mnist5k_cnn", RULE_ESTIMATE, CNN_ROWS, PREDICTIVE),
    "mnist5k_cnn/sparsity": Table(
        "mnist5k_cnn", RULE_ESTIMATE, tuple(row for row in CNN_ROWS if row[1] != "mean"), SPARSITY
    ),
    "mnist5k_cnn/ood": Table("mnist5k_cnn", RULE_ESTIMATE, CNN_ROWS, OOD),
    "mnist5k_affine_tails/predictive": Table(
        "mnist5k_affine_tails", RULE_ESTIMATE, TAILS_ROWS, PREDICTIVE
    ),
    "readme/cpu_default": Table(
        "cpu_default",
        (("rule", LEFT), ("samples per step", RIGHT), ("estimate", LEFT)),
        tuple(
            (rule, est, (*README_RULES[rule], ESTIMATE_NAMES[est].removesuffix(" of 32")))
            for rule, est, _ in CPU_DEFAULT_ROWS
        ),
        PREDICTIVE[:3],
    ),
    "scale_fixed_point/passes": Table("scale_fixed_point", SCALE_TEXT, SCALE_ROWS, SCALE_PASSES),
    "scale_fixed_point/checks": Table(
        "scale_fixed_point",
        SCALE_TEXT,
        tuple(row for row in SCALE_ROWS if row[0] in ("readme_new", "digits_new")),
        SCALE_CHECKS,
    ),
    **{
        f"{stream}/methods": Table(stream, CONTINUAL_TEXT, CONTINUAL_ROWS[stream], CONTINUAL)
        for stream in STREAMS
    },
    **{
        f"{stream}/estimates": Table(
            stream,
            RULE_ESTIMATE,
            tuple(row for row in CONTINUAL_ESTIMATE_ROWS if row[0] in CONTINUAL_RULES[stream]),
            CONTINUAL,
        )
        for stream in STREAMS
    },
}
"""The tables the pages can quote, by the name their markers give."""


# ------------------------------------------------------------------------ the command
def pages(root: Path) -> Iterator[Path]:
    """README.md and the Markdown pages under docs/ of the checkout ``root``."""
    yield root / "README.md"
    yield from sorted(p for p in (root / "docs").rglob("*.md") if "_build" not in p.parts)


def stale(root: Path) -> dict[Path, str]:
    """The pages of the checkout ``root`` whose quotes differ from its summaries
    (docs/results/), with their regenerated text."""
    summaries = load_summaries(root / "docs" / "results")
    out = {}
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new = render(text, summaries, TABLES)
        if new != text:
            out[page] = new
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "summarise":
            folder = ROOT / "docs" / "results"
            path = folder / f"{args.name or args.folder.resolve().name}.json"
            summary = summarise_folder(args.folder)
            folder.mkdir(parents=True, exist_ok=True)
            runfiles.write_json(path, summary)
            print(f"wrote {path.relative_to(ROOT)}")
            return 0
        changed = stale(ROOT)
    except (ValueError, OSError, runfiles.RunError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for page, text in changed.items():
        if args.command == "write":
            runfiles.write_text(page, text)
        print(f"{'wrote' if args.command == 'write' else 'stale'}: {page.relative_to(ROOT)}")
    return 1 if changed and args.command == "check" else 0


if __name__ == "__main__":
    sys.exit(main())
