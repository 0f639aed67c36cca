"""End-to-end tests of the experiment drivers on tiny synthetic data (seconds on a CPU)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from matplotlib import image as mpimg

from experiments.common import figures
from experiments.common import training as train
from experiments.common.config import ConfigError, load, merge, resolve, run_configs, split_runs
from experiments.memory import maps as memory_map
from experiments.runs import compare, peers, tune
from experiments.runs import train as train_command
from tests import shared

MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"name": "mlp", "widths": [16]},
    "cnn": {"name": "cnn", "width": 1},
    "resnet": {"name": "resnet", "depth": 8, "width": 4},
}

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "lr": 0.05, "prior_precision": 1.0},
    "adam": {"name": "adam", "lr": 1e-3},
    "ivon": {
        "name": "ivon",
        "lr": 0.01,
        "hess_init": 10.0,
        "mc_samples": 2,
        "prior_precision": 1.0,
    },
    "additive": {"name": "additive", "lr": 0.05, "mc_samples": 2, "prior_precision": 1.0},
    "multiplicative": {"name": "multiplicative", "lr": 5.0, "temperature": 0.01, "mc_samples": 2},
    "affine": {"name": "affine", "lr": 0.5, "scale_lr": 0.05, "prior_precision": 1.0},
    "lie-additive": {"name": "lie", "group": "additive", "lr": 0.05},
    "lie-multiplicative": {
        "name": "lie",
        "group": "multiplicative",
        "base": "rayleigh",
        "base_scale": 1.0,
        "lr": 1.0,
        "temperature": 0.01,
    },
    "lie-affine": {"name": "lie", "group": "liegroup_blr.groups:DiagonalAffineGroup", "lr": 0.05},
    # the library's options: vmap over samples, a slice of the batch per sample, noise table
    "additive-options": {
        "name": "additive",
        "lr": 0.05,
        "mc_samples": 2,
        "vectorize": True,
        "batch_split": 2,
        "noise": "table",
        "antithetic": True,
    },
}


def tiny_config(model: str = "mlp", optimizer: str = "additive", **sections: Any) -> dict:
    """A run on 3-class 3×16×16 synthetic images: 2 epochs of 2 batches."""
    cfg = shared.tiny_config(
        data={"shape": [3, 16, 16], "test_batch_size": 8},
        model=MODELS[model],
        optimizer=OPTIMIZERS[optimizer],
        schedule={"epochs": 2, "warmup": 1},
        eval={"samples": 3},
    )
    for name, table in sections.items():
        cfg[name] = {**cfg.get(name, {}), **table}
    return cfg


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_png(path: Path, figsize: tuple[float, float]) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert mpimg.imread(path).shape[:2] == figures.pixel_size(figsize), path


def without_times(obj: Any) -> Any:
    """``obj`` with every wall-time entry dropped (they differ between runs)."""
    if isinstance(obj, dict):
        return {k: without_times(v) for k, v in obj.items() if not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [without_times(v) for v in obj]
    return obj


# every model with every optimizer ("lie" with the additive group); the generic rule with
# the other groups, and the library's options, on the MLP only (the model does not matter)
MLP_ONLY = ("lie-multiplicative", "lie-affine", "additive-options")
CASES = [(m, o) for m in MODELS for o in OPTIMIZERS if o not in MLP_ONLY]
CASES += [("mlp", o) for o in MLP_ONLY]


@pytest.mark.parametrize(("model", "optimizer"), CASES)
def test_end_to_end(model: str, optimizer: str, tmp_path: Path) -> None:
    cfg = tiny_config(model, optimizer)
    results = train.train(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    for estimate in ("point", "average"):
        m = results[estimate]
        assert 0 <= m["accuracy"] <= 1 and m["nll"] > 0 and 0 <= m["ece"] <= 1
        assert 0 <= m["brier"] <= 2
        sp = results["sparsity"][estimate]
        assert 0 <= sp["near_zero"] <= 1 and 0 <= sp["hoyer"] <= 1
    stochastic = optimizer not in ("sgd", "adam")
    assert results["has_posterior"] is stochastic
    if stochastic:  # 3 posterior samples average differently from the point estimate
        assert results["average"]["nll"] != results["point"]["nll"]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert resolve(load(tmp_path / "config.json")) == json.loads(
        (tmp_path / "config.json").read_text()
    )
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 2
    assert_png(tmp_path / "reliability.png", figures.RELIABILITY_SIZE)
    assert_png(tmp_path / "filters.png", figures.FILTERS_SIZE)
    if "multiplicative" in optimizer:
        assert_png(tmp_path / "filters_excitatory.png", figures.FILTERS_SIZE)
        assert_png(tmp_path / "filters_inhibitory.png", figures.FILTERS_SIZE)


def test_training_learns_the_synthetic_task(tmp_path: Path) -> None:
    cfg = tiny_config(schedule={"epochs": 6, "warmup": 0}, data={"train_size": 96})
    cfg["optimizer"]["lr"] = 0.2
    results = train.train(cfg, tmp_path)
    assert results["point"]["accuracy"] >= 0.9  # chance is 1/3
    assert results["average"]["accuracy"] >= 0.9
    losses = [r["train_loss"] for r in read_metrics(tmp_path)]
    assert losses[-1] < losses[0]


class Interrupt(Exception):
    pass


def train_interrupted(cfg: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train ``cfg`` into ``out`` and crash after the second epoch has trained but before its
    checkpoint is written."""
    real_epoch = train.train_epoch

    def crashing_epoch(run: train.Run, epoch: int) -> float:
        loss = real_epoch(run, epoch)
        if epoch == 1:
            raise Interrupt
        return loss

    monkeypatch.setattr(train, "train_epoch", crashing_epoch)
    with pytest.raises(Interrupt):
        train.train(cfg, out)
    monkeypatch.setattr(train, "train_epoch", real_epoch)


@pytest.mark.parametrize("optimizer", ["multiplicative", "affine", "ivon"])
def test_resume_reaches_the_uninterrupted_result(
    optimizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config("mlp", optimizer, data={"augment": True}, schedule={"epochs": 3})
    full = train.train(cfg, tmp_path / "full")
    train_interrupted(cfg, tmp_path / "resumed", monkeypatch)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["epoch"] == 1
    with pytest.raises(FileExistsError, match="--resume"):
        train.train(cfg, tmp_path / "resumed")
    resumed = train.train(cfg, tmp_path / "resumed", resume=True)

    assert without_times(resumed) == without_times(full)
    assert without_times(read_metrics(tmp_path / "resumed")) == without_times(
        read_metrics(tmp_path / "full")
    )
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert_same(a["model"], b["model"])
    assert_same(a["optimizer"], b["optimizer"])  # IVON: its Hessian, momentum and step count


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts, lists and tensors equal entry by entry, tensors bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_resume_of_a_finished_run_only_evaluates(tmp_path: Path) -> None:
    cfg = tiny_config()
    first = train.train(cfg, tmp_path)
    again = train.train(cfg, tmp_path, resume=True)
    assert len(read_metrics(tmp_path)) == 2
    assert without_times(again) == without_times(first)
    with pytest.raises(ConfigError, match=r"config differs.*: seed: 0 then, 1 now; resume"):
        train.train({**cfg, "seed": 1}, tmp_path, resume=True)
    changed = {**cfg, "optimizer": {**cfg["optimizer"], "lr": 0.123}}
    with pytest.raises(ConfigError, match=r"optimizer\.lr: .* then, 0\.123 now"):
        train.train(changed, tmp_path, resume=True)


def test_compare_writes_report_folder(tmp_path: Path) -> None:
    raw = tiny_config()
    del raw["optimizer"]
    raw["runs"] = {
        label: {"optimizer": OPTIMIZERS[label]} for label in OPTIMIZERS if "-" not in label
    }
    results = compare.compare(raw, tmp_path)
    assert set(results) == {"sgd", "adam", "ivon", "additive", "multiplicative", "affine"}
    report = (tmp_path / "report.md").read_text()
    for label in results:
        assert f"| {label} | at g |" in report
        assert f"| {label} | average" in report
        assert_png(tmp_path / label / "seed0" / "reliability.png", figures.RELIABILITY_SIZE)
        assert f"]({label}/seed0/reliability.png)" in report
    assert "average †" in report  # the deterministic baselines are flagged
    assert "](multiplicative/seed0/filters_excitatory.png)" in report
    assert_png(tmp_path / "learning_curves.png", figures.curves_size(3))  # with training loss
    assert json.loads((tmp_path / "results.json").read_text()).keys() == results.keys()
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == {label: {"0": cfg} for label, cfg in split_runs(raw).items()}
    # runs are reproducible from the config alone: SGD again gives identical results
    again = compare.compare({**raw, "runs": {"sgd": raw["runs"]["sgd"]}}, tmp_path / "again")
    assert without_times(again["sgd"]) == without_times(results["sgd"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": 1}, r"unknown top-level key\(s\) \['colour'\]; valid keys: \['data'"),
        (
            {"optimizer": {"name": "nadam", "lr": 1}},
            r"unknown optimizer 'nadam' \(did you mean 'adam'\?\); valid .*'sgd'",
        ),
        ({"optimizer": {"name": "sgd", "lr": 1, "mc_samples": 2}}, r"unknown key.*mc_samples.*"),
        (
            {"optimizer": {"name": "adam", "lr": 1, "momentum": 0.9}},
            r"unknown key.*'momentum'.*'betas'",
        ),
        (
            {"optimizer": {"name": "ivon", "lr": 1, "hessinit": 1}},
            r"unknown key.*'hessinit'.*'hess_init'",
        ),
        (
            {"optimizer": {"name": "ivon", "lr": 1, "ess": "N"}},
            r"\[optimizer\].ess must be a number, got 'N'",
        ),
        (
            {"optimizer": {"name": "ivon", "lr": 1, "ess": 0}},
            r"\[optimizer\].ess of ivon must be > 0",
        ),
        ({"optimizer": {"name": "ivon", "lr": 1, "beta2": 1.5}}, r"\[optimizer\].beta2 of ivon"),
        ({"optimizer": {"name": "ivon", "lr": 1, "hess_approx": "x"}}, r"hess_approx.*'gradsq'"),
        ({"data": {"name": "synthetic", "validation": -1}}, r"\[data\].validation must be >= 0"),
        ({"optimizer": {"name": "affine", "lr": 1}}, r"missing required key 'scale_lr'"),
        ({"optimizer": {"name": "sgd", "lr": "fast"}}, r"\[optimizer\].lr must be a number"),
        ({"optimizer": {"name": "afine", "lr": 1}}, r"'afine' \(did you mean 'affine'\?\)"),
        ({"model": {"name": "mlp", "widths": 64}}, r"widths must be a list of integers, got 64"),
        (
            {"data": {"name": "imagenet"}},
            r"unknown dataset 'imagenet' \(did you mean 'tinyimagenet'\?\); valid .*'cifar10'",
        ),
        ({"data": {"name": "mnist5k", "shape": [1]}}, r"unknown key.*'shape'"),
        ({"model": {"name": "vit"}}, r"unknown model 'vit'; valid choices: \['cnn', 'mlp'"),
        ({"model": {"name": "mlp", "depth": 3}}, r"unknown key.*'depth'.*'widths'"),
        ({"device": "tpu"}, r"unknown device 'tpu' \(did you mean 'cpu'\?\); valid choices"),
        ({"threads": -1}, r"threads must be >= 0"),
        ({"threads": 1.5}, r"threads must be an integer"),
        ({"schedule": {"epochs": 2, "warmup": 2}}, r"warmup"),
        ({"runs": {"a": {}}}, r"experiments.runs.compare"),
    ],
)
def test_bad_config_is_a_clear_error(change: dict, message: str) -> None:
    cfg = tiny_config()
    for key, value in change.items():
        cfg[key] = value
    with pytest.raises(ConfigError, match=message):
        resolve(cfg)


def test_threads_sets_torchs_thread_count(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = tiny_config(schedule={"epochs": 1, "warmup": 0})
        train.train({**cfg, "threads": 1}, tmp_path / "a")
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        train.train(cfg, tmp_path / "b")
        assert torch.get_num_threads() == 2  # threads = 0 leaves torch's setting alone
    finally:
        torch.set_num_threads(before)


def test_ivon_gets_n_and_the_prior_from_the_config() -> None:
    """ess defaults to N, the prior precision δ becomes weight decay δ/N (IVON's prior
    precision is weight_decay × ess), and the documented hyperparameters reach IVON."""
    from experiments.common.optimizers import IVON, build_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    table = resolve(tiny_config(optimizer="ivon"))["optimizer"]
    opt = build_optimizer(table, params, data_size=400.0)
    assert isinstance(opt, IVON)
    group = opt.param_groups[0]
    assert group["ess"] == 400.0 and group["weight_decay"] == pytest.approx(1.0 / 400.0)
    assert group["hess_init"] == 10.0 and group["clip_radius"] == math.inf
    assert opt.mc_samples == 2 and opt.hess_approx == "price"
    table.update(ess=50.0, clip_radius=1e-3, beta2=0.999, hess_approx="gradsq")
    group = build_optimizer(table, params, data_size=400.0).param_groups[0]
    assert (group["ess"], group["clip_radius"], group["beta2"]) == (50.0, 1e-3, 0.999)


def test_bad_groups_and_devices_are_clear_errors(tmp_path: Path) -> None:
    cfg = tiny_config(optimizer="lie-additive")
    cfg["optimizer"]["group"] = "heisenberg"
    with pytest.raises(ValueError, match=r"unknown group 'heisenberg'; valid: \['additive'"):
        train.train(cfg, tmp_path / "a")
    cfg["optimizer"]["group"] = "math:pi"
    with pytest.raises(ValueError, match=r"not a subclass of liegroup_blr\.groups\.LieGroup"):
        train.train(cfg, tmp_path / "b")
    cfg["optimizer"]["group"] = "no_such_module:Group"
    with pytest.raises(ValueError, match="cannot import group"):
        train.train(cfg, tmp_path / "c")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            train.train({**tiny_config(), "device": "cuda"}, tmp_path / "d")


def test_cli_reports_errors_and_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[data]\nname = "synthetic"\n[model]\nname = "mlp"\n[optimizer]\nname = "x"\n')
    assert train_command.main([str(bad), "--out", str(tmp_path / "bad")]) == 2
    assert "unknown optimizer 'x'" in capsys.readouterr().err
    assert compare.main([str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err
    good = tmp_path / "good.toml"
    good.write_text(
        'seed = 1\ndevice = "cpu"\n[data]\nname = "synthetic"\nbatch_size = 16\n'
        '[model]\nname = "mlp"\nwidths = [8]\n[optimizer]\nname = "sgd"\nlr = 0.1\n'
        "[schedule]\nepochs = 1\n[eval]\nsparsity_samples = 1\n"
    )
    assert train_command.main([str(good), "--out", str(tmp_path / "run")]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seed"] == 1


def test_split_runs_merges_shared_tables() -> None:
    raw = tiny_config()
    raw["runs"] = {"wide": {"model": {"widths": [32]}}, "plain": {}}
    runs = split_runs(raw)
    assert runs["wide"]["model"]["widths"] == [32]
    assert runs["plain"]["model"]["widths"] == [16]
    assert runs["wide"]["optimizer"] == runs["plain"]["optimizer"]
    with pytest.raises(ConfigError, match=r"\[runs\]"):
        split_runs({**raw, "runs": {}})


def comparison(**shared: Any) -> dict[str, Any]:
    """:func:`tiny_config` as a comparison of one SGD run ``a``, ``shared`` merged over its
    shared tables."""
    raw = tiny_config(**shared)
    del raw["optimizer"]
    raw["runs"] = {"a": {"optimizer": copy.deepcopy(OPTIMIZERS["sgd"])}}
    return raw


@pytest.mark.parametrize(
    ("shared", "run", "message"),
    [
        (
            {"schedule": {"epocs": 2}},
            {},
            r"unknown key\(s\) \['epocs'\] in the shared \[schedule\] \(did you mean 'epochs'\?\); "
            r"valid keys: \['epochs', 'warmup'\]",
        ),
        (
            {"eval": {"sampels": 2, "binz": 3}},
            {},
            r"unknown key\(s\) \['binz', 'sampels'\] in the shared \[eval\] "
            r"\(did you mean 'bins' for 'binz', 'samples' for 'sampels'\?\); valid keys",
        ),
        ({"seeed": 1}, {}, r"unknown top-level key\(s\) \['seeed'\] \(did you mean 'seed'\?\)"),
        (
            {},
            {"schedule": {"epocs": 2}},
            r"\[runs\.a\]: unknown key\(s\) \['epocs'\] in \[schedule\] "
            r"\(did you mean 'epochs'\?\)",
        ),
        (
            {},
            {"optimizer": {"momentun": 0.5}},
            r"\[runs\.a\]: unknown key\(s\) \['momentun'\] in \[optimizer\] "
            r"\(did you mean 'momentum'\?\)",
        ),
    ],
)
def test_an_unknown_key_names_its_table_and_the_closest_valid_key(
    shared: dict, run: dict, message: str
) -> None:
    """A key that every run refuses alike is the shared table's, not the first run's."""
    raw = merge(comparison(), shared)
    raw["runs"]["a"] = merge(raw["runs"]["a"], run)
    with pytest.raises(ConfigError, match=f"^{message}"):
        split_runs(raw)


def test_a_typo_in_a_shared_table_is_one_line_of_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(
        '[data]\nname = "synthetic"\n[model]\nname = "mlp"\n[schedule]\nepocs = 1\n'
        '[runs.sgd.optimizer]\nname = "sgd"\nlr = 0.1\n'
    )
    assert compare.main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        "error: unknown key(s) ['epocs'] in the shared [schedule] (did you mean 'epochs'?); "
        "valid keys: ['epochs', 'warmup']\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("optimizer", "where"),
    [
        ({"name": "sgd", "lr": 1e300}, r"\[optimizer\]\.lr"),
        ({"name": "sgd", "lr": 0.1, "momentum": -math.inf}, r"\[optimizer\]\.momentum"),
        ({"name": "adam", "lr": 1e-3, "betas": [0.9, math.nan]}, r"\[optimizer\]\.betas\[1\]"),
        (
            {"name": "lie", "group": "additive", "lr": 0.1, "group_options": {"scale": 1e39}},
            r"\[optimizer\]\.group_options\.scale",
        ),
    ],
)
def test_a_number_beyond_float32_is_a_clear_error(optimizer: dict, where: str) -> None:
    """Also in lists and in the tables a library class takes, before torch meets it."""
    with pytest.raises(ConfigError, match=rf"^{where} must be a finite number within float32's"):
        resolve({**tiny_config(), "optimizer": optimizer})


@pytest.mark.parametrize("lr", ["1e300", "inf", "nan"])
def test_an_overflowing_lr_is_one_line_before_training(
    lr: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "big.toml"
    path.write_text(
        '[data]\nname = "synthetic"\ntrain_size = 16\ntest_size = 8\n[model]\nname = "mlp"\n'
        f'[optimizer]\nname = "sgd"\nlr = {lr}\n[schedule]\nepochs = 1\n'
    )
    assert train_command.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: [optimizer].lr must be a finite number within float32's range "
        f"(|x| <= {torch.finfo(torch.float32).max:.4g}), got {float(lr)!r}\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for p in (Path(__file__).parents[2] / "experiments" / "configs").glob("*.toml")
        if not p.stem.startswith("continual_")  # tests/drivers/test_continual.py resolves those
    ),
    ids=lambda p: p.stem,
)
def test_shipped_configs_resolve(path: Path) -> None:
    raw = load(path)
    if "tune" in raw:  # a tuning config: one run per grid point, on a validation split
        raw, points = tune.grid_points(raw)
        assert all(points.values()) and raw["data"]["validation"] > 0
    if "memory" in raw:  # a memory-map validation: comparison runs and a [memory] table
        runs, memory = memory_map.resolve(raw)
        assert memory["retrain_epochs"]
    elif "laplace" in raw:  # the peers: comparison runs and Laplace fits on some of them
        runs, laplace = peers.resolve(raw)
        assert laplace["fits"]
    else:
        runs = run_configs(raw)
    assert runs
    for by_seed in runs.values():
        assert 0 in by_seed
        for cfg in by_seed.values():
            assert not Path(cfg["data"]["root"]).is_absolute()
