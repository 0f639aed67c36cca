"""The report of experiments/memory/maps.py: per run, the agreement of every ranking with
leave-one-out retraining, the floors, and the flipped labels found (mean ± sd over seeds)."""

from __future__ import annotations

from typing import Any

from experiments.common.tables import LEFT, RIGHT, markdown
from experiments.memory.scores import BASELINES, RANKINGS
from experiments.memory.stats import FLOORS, SPACES


def mean_sd(leaf: dict[str, Any] | None, digits: int = 2, style: str = "f") -> str:
    if not isinstance(leaf, dict):
        return "n/a"
    if leaf["sd"] is None:
        return f"{leaf['mean']:.{digits}{style}}"
    return f"{leaf['mean']:.{digits}{style}} ± {leaf['sd']:.{digits}{style}}"


def _conditions(cfg: dict[str, Any], res: dict[str, Any], memory: dict[str, Any]) -> str:
    """The settings every number of a run's section was measured under."""
    s, one = res["summary"], next(iter(res["per_seed"].values()))
    opt, seeds = cfg["optimizer"], res["per_seed"]
    at_mean = ""
    if "mean" in s["test"]:
        at_mean = f"{mean_sd(s['test']['mean']['accuracy'], 4)} at the posterior mean, "
    return (
        f"{cfg['model']['name']} {cfg['model'].get('widths', '')} on {cfg['data']['name']} "
        f"({one['train_size']} train / {one['test_size']} test), {cfg['schedule']['epochs']} "
        f"passes, batch {cfg['data']['batch_size']}, {opt.get('mc_samples', 1)} samples per "
        f"step; {len(seeds)} seed{'s' if len(seeds) > 1 else ''}; test accuracy "
        f"{mean_sd(s['test']['point']['accuracy'], 4)} at the point estimate, {at_mean}"
        f"{mean_sd(s['test']['average']['accuracy'], 4)} averaged over {memory['samples']} "
        f"posterior samples."
    )


def report(
    results: dict[str, Any],
    configs: dict[str, dict[int, dict[str, Any]]],
    memory: dict[str, Any],
) -> str:
    """Markdown: per run, the agreement of every ranking with leave-one-out retraining on the
    random examples, the floors, and the flipped labels found; mean ± sd over seeds."""
    head = ["epochs", "ranking", "Spearman, ‖Δp‖₁", "Spearman, ‖Δf‖₁", "Spearman, drift of p"]
    head += ["Spearman, drift of f", "median estimate ÷ truth"]
    lines = ["# Memory maps against leave-one-out retraining", ""]
    for label, res in results.items():
        s = res["summary"]
        cfg = next(iter(configs[label].values()))
        lines += [
            f"## {label} (seeds {', '.join(res['per_seed'])}; {s['method']} form by default)",
            "",
            _conditions(cfg, res, memory),
            f"{memory['random']} random examples retrained (common random numbers) at "
            f"{memory['retrain_lr']}× the initial step size. Spearman correlation over the "
            "random examples of each ranking with the true change of the probabilities "
            "(‖Δp‖₁) and of the logits (‖Δf‖₁), and with the drift (the change retraining "
            "alone makes); median estimate ÷ the true change it estimates.",
            "",
        ]
        rows = []
        for epoch, entry in s["retraining"].items():
            for name in [*RANKINGS, "default", *BASELINES]:
                p, f = entry[name]["probabilities"], entry[name]["logits"]
                own = f if name.split(":")[-1].startswith("logits") else p
                ratio = mean_sd(own["median_ratio"], 3) if ":" in name else "—"
                cells = [mean_sd(p["spearman"]), mean_sd(f["spearman"])]
                cells += [mean_sd(p["drift"]), mean_sd(f["drift"])]
                rows.append([str(epoch), name, *cells, ratio])
        lines += markdown(head, rows, [RIGHT, LEFT] + [RIGHT] * 5)
        lines.append("")
        for epoch, entry in s["retraining"].items():
            for space in SPACES:
                e = entry[space]
                floors = ", ".join(
                    f"{name} {mean_sd(e[f'{key}_median'], 2, 'e')} (truth ÷ it "
                    f"{mean_sd(e[f'truth_over_{key}'])}, truth above it for "
                    f"{mean_sd(e[f'above_{key}'])})"
                    for key, name in FLOORS.items()
                )
                paired = "; ".join(
                    f"minus the {b} alone's: {_paired(res, epoch, space, b)}" for b in BASELINES[:2]
                )
                lines.append(
                    f"- {space}, after {epoch} epochs, random examples: median true change "
                    f"{mean_sd(e['truth_median'], 2, 'e')}; floors: {floors}; Spearman of "
                    f"truth and drift {mean_sd(e['truth_drift_spearman'])}; the "
                    f"{memory['top']} highest-scored change {mean_sd(e['top_over_random'], 1)}× "
                    f"as much (medians); per seed, the default's Spearman {paired}."
                )
            lines.append(
                f"- after {epoch} epochs the own label's probability drops for "
                f"{mean_sd(entry['label_drops'])} of the removed random examples."
            )
        lines.append(
            "- over the whole training set the default score ranks with Spearman "
            + ", ".join(f"{mean_sd(v)} against the {k}" for k, v in s["baselines"].items())
            + " alone."
        )
        if "flips" in s:
            f = s["flips"]
            found = ", ".join(f"{k}: {mean_sd(v, 1)}" for k, v in f["found"].items())
            lines += [
                "",
                f"Flipped labels among each ranking's {memory['flip']} highest, of "
                f"{memory['flip']}: {found} (at random: {mean_sd(f['random'], 2)}).",
            ]
        lines.append("")
    return "\n".join(lines)


def _paired(res: dict[str, Any], epoch: str, space: str, baseline: str) -> str:
    """Per seed, the default's Spearman correlation with the true change minus the
    ``baseline``'s (a paired difference: both ranked the same retrained examples)."""
    out = []
    for summary in res["per_seed"].values():
        entry = summary["retraining"][epoch]
        a, b = (entry[k][space]["spearman"] for k in ("default", baseline))
        out.append("n/a" if a is None or b is None else f"{a - b:+.3f}")
    return ", ".join(out)
