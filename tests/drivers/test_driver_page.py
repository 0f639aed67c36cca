"""The driver that ``experiments/README.md`` ("Writing a driver") gives whole runs as printed:
it trains, writes its files, and resumes a finished folder without training again."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
seeds = [0, 1]
device = "cpu"
threads = 1

[data]
name = "synthetic"
shape = [3, 8, 8]
train_size = 32
test_size = 16
batch_size = 16
test_batch_size = 8

[model]
name = "mlp"
widths = [8]

[schedule]
epochs = 2
warmup = 1

[runs.sgd.optimizer]
name = "sgd"
lr = 0.05

[runs.affine.optimizer]
name = "affine"
lr = 0.5
scale_lr = 0.05
prior_precision = 1.0
"""


def _page_driver(tmp_path: Path, monkeypatch):
    page = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    section = page[page.index("## Writing a driver") :]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    path = tmp_path / "losses_driver.py"
    path.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("losses_driver", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "losses_driver", module)  # its dataclass looks it up
    spec.loader.exec_module(module)
    return module


def test_the_driver_of_the_page_trains_writes_and_resumes(tmp_path, monkeypatch):
    driver = _page_driver(tmp_path, monkeypatch)
    cfg, out = tmp_path / "losses.toml", tmp_path / "out"
    cfg.write_text(CONFIG, encoding="utf-8")
    assert driver.main([str(cfg), "--out", str(out)]) == 0
    rows = {}
    for label in ("sgd", "affine"):
        for seed in (0, 1):
            folder = out / label / f"seed{seed}"
            lines = (folder / driver.ROWS).read_text(encoding="utf-8").splitlines()
            rows[label, seed] = [json.loads(line) for line in lines]
            assert [r["epoch"] for r in rows[label, seed]] == [1, 2]
            assert all(math.isfinite(r["loss"]) for r in rows[label, seed])
    assert rows["sgd", 0] != rows["sgd", 1]  # the seeds train apart
    assert (out / "report.md").read_text(encoding="utf-8").startswith("# Losses")
    written = {p: p.stat().st_mtime_ns for p in out.rglob(driver.ROWS)}
    assert driver.main([str(cfg), "--out", str(out), "--resume"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob(driver.ROWS)} == written
