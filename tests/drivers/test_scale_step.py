"""The shipped configs keep the affine rule's step exactly, and the scale-fixed-point driver."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib
from torch import nn

import liegroup_blr as lgb
from experiments.common.config import fill
from experiments.common.optimizers import OPTIMIZERS, build_optimizer
from experiments.reporting import docs_tables
from experiments.rules import scale_fixed_point

CONFIGS = Path(__file__).parents[2] / "experiments" / "configs"


def affine_tables(obj: Any) -> Iterator[dict[str, Any]]:
    """Every ``[optimizer]`` table of a raw config whose name is ``affine``."""
    if isinstance(obj, dict):
        if obj.get("name") == "affine":
            yield obj
        for value in obj.values():
            yield from affine_tables(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from affine_tables(value)


SHIPPED = sorted(
    (path.stem, i, table)
    for path in CONFIGS.glob("*.toml")
    for i, table in enumerate(affine_tables(tomllib.loads(path.read_text())))
)


def test_the_shipped_configs_have_affine_runs():
    assert len({name for name, _, _ in SHIPPED}) >= 10


@pytest.mark.parametrize(("name", "i", "table"), SHIPPED, ids=lambda v: str(v)[:40])
def test_shipped_affine_config_keeps_its_step(name, i, table):
    """A shipped affine table builds the reference's parametrisation with its own values: the
    raw α₂ (no growth bound), β₂ 0.999 unless given, base scale and A₀ as written, so its run
    is the one it made before ``scale_step`` existed; ``scale_step = 2τα₂/N`` is that step."""
    cfg = fill(
        "optimizer", {k: v for k, v in table.items() if k != "name"}, OPTIMIZERS["affine"].keys
    )
    cfg["name"] = "affine"
    n = 1000
    opt = build_optimizer(cfg, nn.Linear(3, 2).parameters(), data_size=n)
    group = opt.param_groups[0]
    assert group["scale_lr"] == table["scale_lr"] and group["scale_step"] is None
    assert opt._rule.scale_steps(group)[1] == math.inf
    # bit for bit the α₂ the rule used before: lr · (α₂ / lr₀)
    assert opt._rule.scale_steps(group)[0] == cfg["lr"] * (table["scale_lr"] / cfg["lr"])
    assert group["scale_momentum"] == table.get("scale_momentum", 0.999)
    assert float(group["base"].scale) == pytest.approx(table.get("base_scale", 0.005))
    assert opt.group_element(opt.param_groups[0]["params"][0])["A"].unique().tolist() == [
        table.get("init_scale", 1.0)
    ]
    same = lgb.AffineBLR(
        nn.Linear(3, 2).parameters(), cfg["lr"],
        scale_step=2 * cfg["temperature"] * table["scale_lr"] / n,
        data_size=n, temperature=cfg["temperature"],
    )  # fmt: skip
    alpha2 = same._rule.scale_steps(same.param_groups[0])[0]
    assert alpha2 == pytest.approx(table["scale_lr"], rel=1e-12)


def test_scale_fixed_point_driver(tmp_path, monkeypatch):
    """The driver on the README's case with short runs: its config, σ/σ* per pass and tensor,
    the checks, and a summary the docs tables read."""
    monkeypatch.setattr(scale_fixed_point, "LONG_PASSES", 8)
    monkeypatch.setattr(scale_fixed_point, "PASSES", (1, 3))
    monkeypatch.setattr(scale_fixed_point, "HESSIAN_DRAWS", 1)
    out = tmp_path / "scale"
    assert scale_fixed_point.main(["--cases", "readme", "--seeds", "0,1", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["cases"] == ["readme"] and config["seeds"] == [0, 1]
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"readme_new", "readme_old"}
    new, old = results["readme_new"]["summary"], results["readme_old"]["summary"]
    for tensor in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert len(new["pass3"][tensor]["values"]) == 2
        # the old values leave σ at the base's 0.005, far below σ*; the new ones move it
        assert old["pass3"][tensor]["mean"] < 0.2 < new["pass3"][tensor]["mean"]
        assert 0.5 < new["long_over_hessian"][tensor]["mean"] < 2
    summary = docs_tables.summarise_folder(out)
    assert docs_tables.stat({"s": summary}, "s", "readme_new", "pass1.0.weight")["values"]
    with pytest.raises(ValueError, match="unknown"):
        scale_fixed_point.measure("readme,nope", "0", tmp_path / "x")


def test_the_entropy_moves_the_other_rules_by_alpha_tau_over_n_per_step():
    """The multiplicative rule's log g± and the generic rule's log A (identity
    preconditioner) move under the entropy by about ατ/N per step: the 1/N of the scale."""
    found = scale_fixed_point.entropy_push(passes=1)
    for res in found.values():
        assert 0.5 * res["bound"] < res["median_change"] <= 1.05 * res["bound"], res
