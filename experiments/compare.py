"""Train several runs on the same data and seed and write a report folder.

    python -m experiments.compare CONFIG.toml [--out DIR] [--resume]

CONFIG holds the shared tables and one ``[runs.LABEL]`` table per run (merged over the
shared ones). Each run trains into ``DIR/LABEL``; ``DIR/report.md`` holds the Table-1-style
comparison, ``DIR/results.json`` all numbers, ``DIR/config.json`` every resolved run config
and ``DIR/learning_curves.png`` the test curves.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from experiments import cli, distributed, figures
from experiments import config as config_module
from experiments.train import METRICS, train

# key, column header, format of the table cell
_METRICS = [("accuracy", "accuracy (%)", "{:.2%}"), ("nll", "NLL", "{:.4f}")]
_METRICS += [("ece", "ECE", "{:.4f}"), ("brier", "Brier", "{:.4f}")]


def _hyperparameters(opt: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in opt.items() if k != "name" and v != {})


def _estimate_label(estimate: str, res: dict[str, Any], samples: int) -> str:
    if estimate == "point":
        return "at g"
    return f"average ({samples} samples)" if res["has_posterior"] else "average †"


def report(
    configs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]], out: Path
) -> str:
    """The Markdown report: metrics and first-layer sparsity at g and averaged, run details.

    Figures are linked relative to the report folder ``out``.
    """
    first = next(iter(configs.values()))
    first_res = next(iter(results.values()))
    data, model = first["data"], first["model"]
    model_desc = ", ".join(f"{k}={v}" for k, v in model.items() if k != "name")
    differ = [
        key
        for key in first
        if key != "optimizer" and any(cfg[key] != first[key] for cfg in configs.values())
    ]
    shared = f"runs differ in {differ}" if differ else "same data order and initialisation"
    lines = [
        "# Comparison of learning rules",
        "",
        f"Dataset `{data['name']}` ({first_res['train_size']} train / {first_res['test_size']} "
        f"test, N = {first_res['data_size']:g}), model `{model['name']}` ({model_desc}), "
        f"seed {first['seed']}; {shared}.",
        "",
        "| run | estimate | "
        + " | ".join(h for _, h, _ in _METRICS)
        + " | near-zero (%) | Hoyer |",
        "|---|---|" + "---:|" * (len(_METRICS) + 2),
    ]
    for label, res in results.items():
        for estimate in ("point", "average"):
            est = _estimate_label(estimate, res, configs[label]["eval"]["samples"])
            cells = [fmt.format(res[estimate][key]).rstrip("%") for key, _, fmt in _METRICS]
            sp = res["sparsity"][estimate]
            cells += [f"{100 * sp['near_zero']:.2f}", f"{sp['hoyer']:.3f}"]
            lines.append(f"| {label} | {est} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"ECE uses {first['eval']['bins']} equal-width confidence bins. Sparsity is of the "
        "first-layer weights: "
        "near-zero is the share of entries with |w| < 10⁻³·max|w|, Hoyer the measure "
        "(√n − ‖w‖₁/‖w‖₂)/(√n − 1) averaged over filters; in the average rows both are means "
        "over posterior samples θ = g·ξ.",
    ]
    if not all(r["has_posterior"] for r in results.values()):
        lines += [
            "",
            "† deterministic baseline without a posterior: its average row repeats the point "
            "estimate.",
        ]
    lines += [
        "",
        "## Runs",
        "",
        "| run | optimizer | hyperparameters | epochs | train (s) | eval (s) | wall time (s) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for label, res in results.items():
        opt = configs[label]["optimizer"]
        wall = res["train_seconds"] + res["eval_seconds"]
        lines.append(
            f"| {label} | {opt['name']} | {_hyperparameters(opt)} | {res['epochs']} | "
            f"{res['train_seconds']:.1f} | {res['eval_seconds']:.1f} | {wall:.1f} |"
        )
    lines += ["", "## Figures", "", "![learning curves](learning_curves.png)", ""]
    for label in results:
        pngs = sorted(p.name for p in (out / label).glob("*.png"))
        lines += [f"### {label}", ""] + [f"![{label} {p[:-4]}]({label}/{p})" for p in pngs] + [""]
    return "\n".join(lines)


def compare(raw: dict[str, Any], out: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train every run of a comparison config into ``out/LABEL`` and write the report
    (rank 0 of a torchrun writes; the other processes train alongside and return ``{}``)."""
    out = Path(out)
    configs = config_module.split_runs(raw)
    main = distributed.from_environment().main
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(configs, indent=2) + "\n")
    results: dict[str, dict[str, Any]] = {}
    for label, cfg in configs.items():
        print(f"== run {label!r} ({cfg['optimizer']['name']})", flush=True)
        tic = time.perf_counter()
        results[label] = train(cfg, out / label, resume)
        print(f"== run {label!r} done in {time.perf_counter() - tic:.1f}s", flush=True)
    if not main:
        return {}
    histories = {
        label: [json.loads(line) for line in (out / label / METRICS).read_text().splitlines()]
        for label in configs
    }
    figures.learning_curves(histories, out / "learning_curves.png")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(report(configs, results, out) + "\n")
    return results


def _show(results: dict[str, Any], out: Path) -> None:
    print((out / "report.md").read_text())
    print(f"report in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run("python -m experiments.compare", __doc__, compare, _show, argv)


if __name__ == "__main__":
    sys.exit(main())
