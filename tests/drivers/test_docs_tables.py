"""The numbers the pages quote are the numbers in the committed result summaries
(docs/results/*.json): the summaries of results folders, the tables and numbers generated
between markers, and the check that the pages are up to date (issue 32)."""

from __future__ import annotations

import copy
import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from experiments.reporting import docs_tables
from experiments.reporting.docs_tables import Metric, Table
from experiments.runs import compare
from tests.shared import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_page_quotes_the_committed_summaries() -> None:
    """README.md and every page under docs/ equal what ``python -m experiments.reporting.docs_tables
    write`` makes of them: every marked table and number is the committed one."""
    assert ROOT / "README.md" in list(docs_tables.pages(ROOT))
    assert docs_tables.stale(ROOT) == {}


def test_flatten_keeps_every_number_by_its_dotted_key() -> None:
    leaf = {"mean": 2.0, "sd": 1.0, "values": [1.0, 3.0]}
    obj = {"point": {"nll": leaf, "note": "x"}, "ood": [{"auroc": 0.5}], "flag": True, "n": 3}
    assert docs_tables.flatten(obj) == {
        "point.nll": leaf,
        "ood.0.auroc": {"mean": 0.5, "sd": None, "values": [0.5]},
        "n": {"mean": 3.0, "sd": None, "values": [3.0]},
    }


def test_numbers_as_the_format_says() -> None:
    leaf = {"mean": 0.93333, "sd": 0.00577, "values": [0.934, 0.933, 0.933]}
    assert docs_tables.number(leaf, "100:1") == "93.3"
    assert docs_tables.number(leaf, "100:1±") == "93.3 ± 0.6"
    assert docs_tables.number(leaf, "100:1,") == "93.4, 93.3, 93.3"
    assert docs_tables.number({**leaf, "sd": None}, "1:3±") == "0.933"  # one seed
    blown = {"mean": 1.04e30, "sd": 1.46e30, "values": [0.66, 2.07e30]}  # a run that blew up
    assert docs_tables.number(blown, "1:3±") == "1.0e+30 ± 1.5e+30"
    assert docs_tables.number(blown, "1:3,") == "0.660, 2.1e+30"
    with pytest.raises(ValueError, match="FACTOR:DECIMALS"):
        docs_tables.number(leaf, "%.1f")


SUMMARY = {
    "config": "tiny",
    "source": "results.json",
    "labels": {
        "a": {
            "seeds": [0, 1],
            "metrics": {
                "point.accuracy": {"mean": 0.9, "sd": 0.01, "values": [0.89, 0.91]},
                "average.accuracy": {"mean": 0.92, "sd": 0.02, "values": [0.9, 0.94]},
            },
        }
    },
}
SPEC = Table(
    "tiny",
    (("rule", "---"),),
    (("a", "point", ("a at g",)), ("a", "average", ("a averaged",))),
    (Metric("accuracy (%)", "{est}.accuracy", 100.0, 1),),
)
PAGE = """# Results

<!-- table tiny/accuracy -->
| stale |
<!-- end table -->

Averaging gives <!-- n tiny a average.accuracy 100:1± -->0<!-- /n --> % (per
seed <!-- n tiny a average.accuracy 100:1, -->0<!-- /n -->). An example, left as it is:
`<!-- n tiny a point.accuracy 100:1 -->0<!-- /n -->`.
"""
FILLED = """# Results

<!-- table tiny/accuracy -->
| rule | accuracy (%) |
|---|---:|
| a at g | 90.0 ± 1.0 |
| a averaged | 92.0 ± 2.0 |
<!-- end table -->

Averaging gives <!-- n tiny a average.accuracy 100:1± -->92.0 ± 2.0<!-- /n --> % (per
seed <!-- n tiny a average.accuracy 100:1, -->90.0, 94.0<!-- /n -->). An example, left as it is:
`<!-- n tiny a point.accuracy 100:1 -->0<!-- /n -->`.
"""


def test_marked_tables_and_numbers_are_generated_from_the_summaries() -> None:
    summaries, tables = {"tiny": SUMMARY}, {"tiny/accuracy": SPEC}
    assert docs_tables.render(PAGE, summaries, tables) == FILLED
    assert docs_tables.render(FILLED, summaries, tables) == FILLED  # a fixed point
    unmarked = "93.3 ± 0.1 stays as it is\n"
    assert docs_tables.render(unmarked, summaries, tables) == unmarked


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("<!-- table nowhere -->\n<!-- end table -->", "no table 'nowhere'"),
        ("a <!-- n other a point.accuracy 1:3 -->x<!-- /n -->", "no summary 'other'"),
        ("a <!-- n tiny b point.accuracy 1:3 -->x<!-- /n -->", "has no run 'b'"),
        ("a <!-- n tiny a point.nll 1:3 -->x<!-- /n -->", "has no number 'point.nll'"),
        ("<!-- n tiny a point.accuracy 1:3 -->x<!-- /n -->", "begins a line"),
        ("a\n   <!-- n tiny a point.accuracy 1:3 -->x<!-- /n -->", "begins a line"),
    ],
)
def test_a_marker_without_its_number_is_an_error(marker: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        docs_tables.render(marker, {"tiny": SUMMARY}, {"tiny/accuracy": SPEC})


def test_a_number_after_a_table_filled_for_the_first_time_is_found_mid_line() -> None:
    """The line-start check reads the page with its tables filled (an empty table above a
    number moves it)."""
    number = "<!-- n tiny a point.accuracy 1:3 -->x<!-- /n -->"
    page = f"<!-- table tiny/accuracy -->\n<!-- end table -->\nsee\n  x {number}\n"
    filled = docs_tables.render(page, {"tiny": SUMMARY}, {"tiny/accuracy": SPEC})
    assert filled.endswith("-->0.900<!-- /n -->\n") and "| a at g | 90.0 ± 1.0 |" in filled


def page_tree(root: Path, page: str, summaries: dict[str, Any]) -> None:
    (root / "docs" / "results").mkdir(parents=True)
    (root / "README.md").write_text("# readme\n")
    (root / "docs" / "page.md").write_text(page)
    for name, summary in summaries.items():
        (root / "docs" / "results" / f"{name}.json").write_text(json.dumps(summary))


def test_check_names_stale_pages_and_write_updates_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(docs_tables.TABLES, "tiny/accuracy", SPEC)
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    page_tree(tmp_path, PAGE, {"tiny": SUMMARY})
    assert docs_tables.main(["check"]) == 1
    assert capsys.readouterr().out == "stale: docs/page.md\n"
    assert docs_tables.main(["write"]) == 0
    assert (tmp_path / "docs" / "page.md").read_text() == FILLED
    assert docs_tables.main(["check"]) == 0
    changed = copy.deepcopy(SUMMARY)  # new results: the page is stale again
    changed["labels"]["a"]["metrics"]["point.accuracy"]["mean"] = 0.95
    (tmp_path / "docs" / "results" / "tiny.json").write_text(json.dumps(changed))
    capsys.readouterr()
    assert docs_tables.main(["check"]) == 1
    assert "| a at g | 95.0 ± 1.0 |" in docs_tables.stale(tmp_path)[tmp_path / "docs" / "page.md"]


TINY = tiny_config(
    seeds=[0, 1],
    threads=1,
    eval={"sparsity_samples": 1, "bins": 5},
    runs={
        "sgd": {"optimizer": {"name": "sgd", "lr": 0.05}},
        "add": {"optimizer": {"name": "additive", "lr": 0.05}},
    },
)


def test_a_comparison_folder_becomes_a_summary_the_pages_can_quote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "tiny_cmp"
    results = compare.compare(copy.deepcopy(TINY), out)
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert docs_tables.main(["summarise", str(out)]) == 0
    summary = json.loads((tmp_path / "docs" / "results" / "tiny_cmp.json").read_text())
    assert summary["config"] == "tiny_cmp" and set(summary["labels"]) == {"sgd", "add"}
    add = summary["labels"]["add"]
    assert add["seeds"] == [0, 1]
    for key, get in (
        ("point.nll", lambda r: r["point"]["nll"]),
        ("average.ece", lambda r: r["average"]["ece"]),
        ("sparsity.point.hoyer", lambda r: r["sparsity"]["point"]["hoyer"]),
        ("ood.noise.average", lambda r: r["ood"]["noise"]["average"]),
    ):
        values = [get(results["add"]["per_seed"][s]) for s in ("0", "1")]
        assert add["metrics"][key]["values"] == values
        assert add["metrics"][key]["mean"] == pytest.approx(statistics.fmean(values))
        assert add["metrics"][key]["sd"] == pytest.approx(statistics.stdev(values))
    spec = Table(
        "tiny_cmp",
        (("rule", "---"),),
        (("add", "average", ("add",)),),
        (Metric("NLL", "{est}.nll", 1.0, 4),),
    )
    text = docs_tables.table(spec, {"tiny_cmp": summary})
    nll = results["add"]["summary"]["average"]["nll"]
    assert text.splitlines()[2] == f"| add | {nll['mean']:.4f} ± {nll['sd']:.4f} |"


def test_a_tuning_folder_becomes_a_summary(tmp_path: Path) -> None:
    """Constructed tuned.json and config.json of one label with two grid points, the second
    diverged."""
    run = {"point": {"nll": 0.5}, "average": {"nll": 0.4}}
    tuned = {
        "sgd": {
            "chosen": 0,
            "optimizer": {"name": "sgd", "lr": 0.1},
            "points": [
                {
                    "values": {"lr": 0.1},
                    "score": 0.45,
                    "runs": [run, {**run, "average": {"nll": 0.5}}],
                },
                {"values": {"lr": 1.0}, "score": None, "runs": [None, run]},
            ],
        }
    }
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    (tmp_path / "config.json").write_text(json.dumps({"sgd.0": {"3": {}, "4": {}}, "sgd.1": {}}))
    summary = docs_tables.summarise_folder(tmp_path)
    metrics = summary["labels"]["sgd"]["metrics"]
    assert summary["source"] == "tuned.json" and summary["labels"]["sgd"]["seeds"] == [3, 4]
    assert metrics["chosen"]["mean"] == 0 and metrics["1.values.lr"]["mean"] == 1.0
    assert metrics["0.average.nll"]["values"] == [0.4, 0.5]
    assert metrics["0.average.nll"]["mean"] == pytest.approx(0.45)
    assert metrics["1.diverged"]["mean"] == 1 and "1.average.nll" not in metrics


def test_continual_and_memory_map_results_become_summaries(tmp_path: Path) -> None:
    """Their results.json: per label a ``summary`` of mean/sd/values leaves (continual:
    with ``seeds``; memory maps: seeds as the keys of ``per_seed``)."""
    leaf = {"mean": 0.8, "sd": 0.1, "values": [0.7, 0.9]}
    results = {
        "ewc": {
            "seeds": [0, 1],
            "summary": {"point": {"average_accuracy": [leaf]}},
            "per_seed": {},
        },
        "affine": {"summary": {"spearman": {"random": leaf}}, "per_seed": {"0": {}, "1": {}}},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    labels = docs_tables.summarise_folder(tmp_path)["labels"]
    assert labels["ewc"] == {"seeds": [0, 1], "metrics": {"point.average_accuracy.0": leaf}}
    assert labels["affine"] == {"seeds": [0, 1], "metrics": {"spearman.random": leaf}}


def test_a_folder_without_results_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert docs_tables.main(["summarise", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {tmp_path} holds no results.json or tuned.json of a driver\n"
    )


def _table_of(page: str, spec: Table) -> dict[str, Any]:
    """A summary whose means and sds are the numbers of ``page``'s table of ``spec`` (the
    one under the header line of ``spec``)."""
    head = "| " + " | ".join([h for h, _ in spec.text] + [m.header for m in spec.metrics]) + " |"
    lines = page.splitlines()
    start = lines.index(head)
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = lines[start + 2 : end]  # up to a blank line or the table's end marker
    assert len(rows) == len(spec.rows)
    labels: dict[str, Any] = {}
    for (label, estimate, cells), line in zip(spec.rows, rows, strict=True):
        prefix = "| " + " | ".join(cells) + " | "
        assert line.startswith(prefix), line
        numbers = line[len(prefix) : -2].split(" | ")
        for metric, shown in zip(spec.metrics, numbers, strict=True):
            mean, sd = (float(x) / metric.factor for x in shown.split(" ± "))
            leaf = {"mean": mean, "sd": sd, "values": []}
            entry = labels.setdefault(label, {"seeds": [], "metrics": {}})
            entry["metrics"][metric.key.format(est=estimate)] = leaf
    return {spec.summary: {"labels": labels}}


@pytest.mark.parametrize(
    ("name", "page"),
    [
        ("cpu_default/predictive", "docs/experiments.md"),
        ("cpu_default/sparsity", "docs/experiments.md"),
        ("cpu_default/ood", "docs/experiments.md"),
        ("readme/cpu_default", "README.md"),
    ],
)
def test_the_table_specs_lay_out_the_pages_tables_as_they_are(name: str, page: str) -> None:
    """Filled with the numbers a page shows today, a spec of :data:`TABLES` gives that
    page's table character for character: marked and regenerated, the table keeps its form."""
    text = (ROOT / page).read_text(encoding="utf-8")
    spec = docs_tables.TABLES[name]
    generated = docs_tables.table(spec, _table_of(text, spec))
    assert generated in text
    assert re.search(r"^\|---", generated, re.M)


def test_a_continual_method_with_diverged_seeds_is_marked_in_its_table(tmp_path: Path) -> None:
    """A method that diverged on some seeds shows the others' numbers and names the diverged
    seeds; one that diverged on every seed says so in place of its numbers."""
    leaf = {"mean": 0.8, "sd": None, "values": [0.8]}
    results = {
        "a": {
            "seeds": [0, 1],
            "diverged_seeds": [1],
            "summary": {"point": {"final_accuracy": leaf, "nll": leaf}},
            "per_seed": {},
        },
        "b": {"seeds": [0, 1], "diverged_seeds": [0, 1], "summary": {}, "per_seed": {}},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    summary = docs_tables.summarise_folder(tmp_path)
    assert summary["labels"]["a"]["diverged"] == [1]
    assert summary["labels"]["b"] == {"seeds": [0, 1], "metrics": {}, "diverged": [0, 1]}
    spec = Table(
        "s",
        (("method", "---"), ("estimate", "---")),
        (("a", "point", ("a", "at g")), ("b", "point", ("b", "at g"))),
        (Metric("accuracy (%)", "{est}.final_accuracy", 100.0, 1), Metric("NLL", "{est}.nll")),
    )
    lines = docs_tables.table(spec, {"s": summary}).splitlines()
    assert lines[2:] == [
        "| a (seed 1 diverged) | at g | 80.0 | 0.800 |",
        "| b | at g | diverged on every seed |  |",
    ]
