"""Run configurations: TOML files validated against a schema and resolved with defaults.

A run config has top-level ``seed`` and ``device`` and the tables ``[data]``, ``[model]``,
``[optimizer]``, ``[schedule]`` and ``[eval]``. Which keys ``[data]``, ``[model]`` and
``[optimizer]`` accept depends on their ``name``. A comparison config adds ``[runs.LABEL]``
tables, each merged over the shared tables to give one run config.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments.common.data import DATASETS, dataset_options
from experiments.common.distributed import PARALLEL
from experiments.common.models import MODELS, model_options
from experiments.common.optimizers import GROUPS, OPTIMIZERS
from experiments.common.schema import COUNT, NAME, Required, Unset
from liegroup_blr.distributions import from_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# parallel: how torchrun's processes share the work (experiments/common/distributed.py);
# threads: torch's intra-op threads (0: torch's default)
TOP_LEVEL: dict[str, Any] = {"seed": 0, "device": "auto", "parallel": "data", "threads": 0}

SECTIONS: dict[str, dict[str, Any]] = {
    # augment: None = the dataset's reference setting (crop + flip for CIFAR, TinyImageNet)
    "data": {
        "name": NAME,
        "root": "data",
        "augment": None,
        "da_factor": 1.0,
        "batch_size": 128,
        "test_batch_size": 500,
        "validation": 0,  # > 0: hold out that many training examples, evaluate on them
        "validation_seed": 0,
    },
    "model": {"name": NAME},
    "optimizer": {"name": NAME},
    "schedule": {"epochs": COUNT, "warmup": 0},
    "eval": {"samples": 32, "bins": 20, "sparsity_samples": 32},
}

DEVICES = ("auto", "cpu", "cuda")

FLOAT_MAX = torch.finfo(torch.float32).max
"""The largest number a config may hold: the parameters are float32."""

LABEL = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")
"""A run label of a comparison: a plain folder name inside the comparison folder."""


class ConfigError(ValueError):
    """An invalid configuration."""


def fill(where: str, given: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` completed with the defaults of ``schema``; unknown or missing keys raise."""
    refuse_unknown(where, given, schema)
    out = {}
    for key, default in schema.items():
        if key not in given and isinstance(default, Required):
            raise ConfigError(f"missing required key {key!r} in {where}")
        value = copy.deepcopy(given.get(key, None if isinstance(default, Unset) else default))
        value = list(value) if isinstance(value, tuple) else value
        _check_type(f"{where}.{key}", value, default)
        _check_finite(f"{where}.{key}", value)
        out[key] = value
    return out


def refuse_unknown(where: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """Keys of ``given`` outside ``valid`` raise, naming ``where`` and the closest valid keys."""
    unknown, valid = sorted(set(given) - set(valid)), sorted(valid)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {unknown} in {where}{_did_you_mean(unknown, valid)}; "
            f"valid keys: {valid}"
        )


def _did_you_mean(unknown: Sequence[str], valid: Iterable[str]) -> str:
    """`` (did you mean 'epochs'?)``: the closest valid key of each unknown key that has one
    (several: ``'epochs' for 'epocs', ...``), or nothing."""
    valid = list(valid)
    close = {key: difflib.get_close_matches(key, valid, n=1) for key in unknown}
    hints = [
        repr(match[0]) + (f" for {key!r}" if len(unknown) > 1 else "")
        for key, match in close.items()
        if match
    ]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _check_finite(where: str, value: Any) -> None:
    """Every number, in tables and lists too, must be finite and within float32's range, so
    that torch never meets one it cannot convert."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_finite(f"{where}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite(f"{where}[{i}]", item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if not abs(value) <= FLOAT_MAX:  # also NaN
            raise ConfigError(
                f"{where} must be a finite number within float32's range "
                f"(|x| <= {FLOAT_MAX:.4g}), got {value!r}"
            )


def _check_type(where: str, value: Any, default: Any) -> None:
    """A value must have the type of its default (an int where a float is expected is fine)."""
    if default is None or value is None:
        return
    kind = default.kind if isinstance(default, (Required, Unset)) else type(default)
    expected: tuple[type, ...] = (kind,)
    if kind is float:
        expected = (float, int)
    elif isinstance(default, (list, tuple)):
        expected = (list, tuple)
    if isinstance(value, bool) and kind is not bool:
        expected = ()
    if not isinstance(value, expected):
        raise ConfigError(f"{where} must be {_type_words(default, kind)}, got {value!r}")
    if isinstance(default, (list, tuple)) and default and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):  # entries typed as the default's
            _check_type(f"{where}[{i}]", item, default[0])


def _type_words(default: Any, kind: type) -> str:
    """What TOML value a default's type asks for, in words ("a list of integers")."""
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if isinstance(default, (list, tuple)):
        item = words.get(type(default[0]), "values") if default else "values"
        plural = {"an integer": "integers", "a number": "numbers", "a string": "strings"}
        return f"a list of {plural.get(item, item)}"
    return words.get(kind, f"of type {kind.__name__}")


def _choice(where: str, name: Any, valid: Mapping[str, Any] | tuple[str, ...]) -> None:
    if name not in valid:
        raise ConfigError(
            f"unknown {where} {name!r}{_did_you_mean([str(name)], valid)}; valid choices: "
            f"{sorted(valid)}"
        )


def check_keys(raw: Mapping[str, Any], keys: set[str]) -> None:
    """The top level of a config holds only ``keys``."""
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise ConfigError(
            f"unknown top-level key(s) {unknown}{_did_you_mean(unknown, keys)}; "
            f"valid keys: {sorted(keys)}"
        )


def top_level(raw: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``schema`` (``seed``, ``device``, ``threads`` and a driver's own) filled
    from ``raw``'s top level, the seed, device and threads checked."""
    cfg = fill("the top level", {k: raw[k] for k in schema if k in raw}, schema)
    _choice("device", cfg["device"], DEVICES)
    if not 0 <= cfg["seed"] < 2**32:
        raise ConfigError(f"seed must be in [0, 2**32 - 1], got {cfg['seed']}")
    if cfg["threads"] < 0:
        raise ConfigError(f"threads must be >= 0 (0: torch's default), got {cfg['threads']}")
    return cfg


def table(raw: Mapping[str, Any], name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The table ``[name]`` of ``raw`` (empty if absent) completed with ``schema``'s defaults."""
    given = raw.get(name, {})
    if not isinstance(given, Mapping):
        raise ConfigError(f"[{name}] must be a table, got {given!r}")
    return fill(f"[{name}]", given, schema)


def check_least(cfg: Mapping[str, Any], least: Sequence[tuple[str, str, int]]) -> None:
    """Each (table, key, least value) of ``least`` holds where the table has the key (a list:
    in every entry)."""
    for section, key, low in least:
        value = cfg[section].get(key)
        items = value if isinstance(value, list) else [value]
        if value is not None and any(item < low for item in items):
            every = " in every entry" if isinstance(value, list) else ""
            raise ConfigError(f"[{section}].{key} must be >= {low}{every}, got {value}")


def check_label(label: str, what: str = "run") -> None:
    """A label names a folder: a plain name inside the driver's folder."""
    if not LABEL.fullmatch(label):
        raise ConfigError(
            f"{what} label {label!r} is not a plain folder name: use letters, digits, "
            f"'_', '-', '+', '.', not starting with '.' (each {what} trains into OUT/LABEL)"
        )


def _schema(section: str, given: Any) -> dict[str, Any]:
    """The keys of ``[section]`` of a run config: its own and those of its ``name``."""
    schema = SECTIONS[section]
    if section not in OPTIONS or not isinstance(given, Mapping):
        return schema  # a value that is not a table is refused by table()
    if "name" not in given:
        raise ConfigError(f"missing required key 'name' in [{section}]")
    valid, options = OPTIONS[section]
    _choice(section.replace("data", "dataset"), given["name"], valid)
    return {**schema, **options(str(given["name"]))}


OPTIONS: dict[str, tuple[Mapping[str, Any], Callable[[str], Mapping[str, Any]]]] = {
    "data": (DATASETS, dataset_options),
    "model": (MODELS, model_options),
    "optimizer": (OPTIMIZERS, lambda name: OPTIMIZERS[name].keys),
}
"""The tables whose keys depend on their ``name``: the valid names and their keys."""


def resolve(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a run config and fill in every default (the resolved config)."""
    if "runs" in raw:
        raise ConfigError(
            "this is a comparison config ([runs] tables): use experiments.runs.compare"
        )
    check_keys(raw, set(TOP_LEVEL) | set(SECTIONS))
    cfg = top_level(raw, TOP_LEVEL)
    _choice("parallel", cfg["parallel"], PARALLEL)
    for section in SECTIONS:
        cfg[section] = table(raw, section, _schema(section, raw.get(section, {})))
    _check_ranges(cfg)
    return cfg


# (table, key, least value) of the counts the drivers use, where the table has the key;
# lists: every entry; the library checks its own hyperparameters
_LEAST = [
    ("data", "batch_size", 1),
    ("data", "test_batch_size", 1),
    ("data", "train_size", 1),
    ("data", "test_size", 1),
    ("data", "classes", 2),
    ("data", "shape", 1),
    ("data", "noise", 0),
    ("data", "validation", 0),
    ("data", "validation_seed", 0),
    ("model", "widths", 1),
    ("model", "width", 1),
    ("schedule", "epochs", 1),
    ("eval", "samples", 1),
    ("eval", "sparsity_samples", 1),
    ("eval", "bins", 1),
]


def _check_ranges(cfg: dict[str, Any]) -> None:
    """Counts and sizes the drivers use must be in range, the base must take its options."""
    check_least(cfg, _LEAST)
    shape = cfg["data"].get("shape")
    if shape is not None and len(shape) != 3:
        raise ConfigError(f"[data].shape must be [channels, height, width], got {shape}")
    if cfg["data"]["da_factor"] <= 0:
        raise ConfigError(f"[data].da_factor must be > 0, got {cfg['data']['da_factor']}")
    check_base(cfg["optimizer"])
    _check_ivon(cfg["optimizer"])
    _check_vi(cfg["optimizer"])
    group = cfg["optimizer"].get("group")
    if group is not None and group not in GROUPS and ":" not in group:
        raise ConfigError(
            f"unknown group {group!r}; valid: {sorted(GROUPS)} or 'package.module:ClassName'"
        )
    if not 0 <= cfg["schedule"]["warmup"] < cfg["schedule"]["epochs"]:
        raise ConfigError("[schedule].warmup must satisfy 0 <= warmup < epochs")


def _check_ivon(opt: dict[str, Any]) -> None:
    """IVON's hyperparameters, checked here so that the error names the config key."""
    if opt["name"] != "ivon":
        return
    for key in ("lr", "ess", "hess_init", "clip_radius"):
        if opt[key] is not None and not opt[key] > 0:
            raise ConfigError(f"[optimizer].{key} of ivon must be > 0, got {opt[key]}")
    for key in ("beta1", "beta2"):
        if not 0 <= opt[key] < 1:
            raise ConfigError(f"[optimizer].{key} of ivon must be in [0, 1), got {opt[key]}")
    if opt["prior_precision"] < 0:
        raise ConfigError(f"[optimizer].prior_precision must be >= 0, got {opt['prior_precision']}")
    if opt["mc_samples"] < 1:
        raise ConfigError(f"[optimizer].mc_samples must be >= 1, got {opt['mc_samples']}")
    _choice("[optimizer].hess_approx of ivon", opt["hess_approx"], ("price", "gradsq"))


def _check_vi(opt: dict[str, Any]) -> None:
    """Mean-field VI's hyperparameters (posteriors checks none of them)."""
    if opt["name"] != "vi":
        return
    if not opt["lr"] > 0:
        raise ConfigError(f"[optimizer].lr of vi must be > 0, got {opt['lr']}")
    if opt["prior_precision"] < 0:
        raise ConfigError(f"[optimizer].prior_precision must be >= 0, got {opt['prior_precision']}")
    if opt["mc_samples"] < 1:
        raise ConfigError(f"[optimizer].mc_samples must be >= 1, got {opt['mc_samples']}")
    if len(opt["betas"]) != 2 or not all(0 <= b < 1 for b in opt["betas"]):
        raise ConfigError(
            f"[optimizer].betas of vi must be two numbers in [0, 1), got {opt['betas']}"
        )


def check_base(opt: dict[str, Any]) -> None:
    """The base distribution q0 must accept ``base_scale`` and ``base_options``."""
    if "base" not in opt:
        return
    try:
        from_name(opt["base"], scale=opt["base_scale"], **opt["base_options"])
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"[optimizer] base {opt['base']!r}, base_scale {opt['base_scale']}, "
            f"base_options {opt['base_options']}: {err}"
        ) from None


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge: tables of ``override`` update those of ``base``, other values replace."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def split_runs(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The resolved run config of every ``[runs.LABEL]`` table of a comparison config (an
    error names the run: ``[runs.LABEL]: ...``).

    A config without ``[runs]`` is a single run labelled by its optimizer name.
    """
    runs = raw.get("runs")
    shared = {k: v for k, v in raw.items() if k != "runs"}
    if runs is None:
        cfg = resolve(shared)
        return {cfg["optimizer"]["name"]: cfg}
    if not isinstance(runs, Mapping) or not runs:
        raise ConfigError("[runs] must hold at least one [runs.LABEL] table")
    for label in runs:
        check_label(label)
    _check_shared(shared)
    resolved = {}
    for label, run in runs.items():
        try:
            resolved[label] = resolve(merge(shared, run))
        except ConfigError as err:
            raise ConfigError(f"[runs.{label}]: {err}") from None
    return resolved


def _check_shared(shared: Mapping[str, Any]) -> None:
    """The keys every run takes alike, its top level, ``[schedule]`` and ``[eval]``: an unknown
    one in the shared tables is refused as theirs, not as the first run's."""
    check_keys(shared, set(TOP_LEVEL) | set(SECTIONS))
    for section, schema in SECTIONS.items():
        given = shared.get(section)
        if section not in OPTIONS and isinstance(given, Mapping):
            refuse_unknown(f"the shared [{section}]", given, schema)


def seed_list(raw: Mapping[str, Any], seeds: Sequence[int] | None = None) -> list[int]:
    """The seeds of a config: ``seeds`` if given, else the config's ``seeds`` list, else its
    single ``seed`` (default 0)."""
    if seeds is None:
        if "seeds" in raw and "seed" in raw:
            raise ConfigError("give either 'seed' or 'seeds', not both")
        seeds = raw.get("seeds", [raw.get("seed", 0)])
    if (
        not isinstance(seeds, (list, tuple))
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ConfigError(f"seeds must be a non-empty list of distinct integers, got {seeds!r}")
    return list(seeds)


def run_configs(
    raw: Mapping[str, Any], seeds: Sequence[int] | None = None
) -> dict[str, dict[int, dict[str, Any]]]:
    """The resolved config of every run label and seed of a run or comparison config: label →
    seed → run config (the seeds: :func:`seed_list`)."""
    seeds = seed_list(raw, seeds)
    shared = {k: v for k, v in raw.items() if k not in ("seed", "seeds")}
    per_seed = {s: split_runs({**shared, "seed": s}) for s in seeds}
    return {label: {s: per_seed[s][label] for s in seeds} for label in per_seed[seeds[0]]}


@dataclass(frozen=True)
class Table:
    """A driver's own top-level table beside its runs (``[memory]``, ``[laplace]``): its keys
    with their defaults, and ``check(table, configs)`` of the filled table against the runs
    (label → seed → run config), which may complete the table in place."""

    name: str
    schema: Mapping[str, Any]
    check: Callable[[dict[str, Any], dict[str, dict[int, dict[str, Any]]]], None]
    required: bool = False


def driver_configs(
    raw: Mapping[str, Any], tables: Sequence[Table], seeds: Sequence[int] | None = None
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, dict[str, Any]]]:
    """The runs of a driver's config (:func:`run_configs` of the rest) and each of its
    ``tables`` filled and checked: (label → seed → run config, name → table)."""
    for t in tables:
        if t.required and t.name not in raw:
            raise ConfigError(f"a config of this driver needs a [{t.name}] table")
    filled = {t.name: table(raw, t.name, t.schema) for t in tables}
    configs = run_configs({k: v for k, v in raw.items() if k not in filled}, seeds)
    for t in tables:
        t.check(filled[t.name], configs)
    return configs, filled


def load(path: str | Path) -> dict[str, Any]:
    """Parse a TOML config file, or a run's resolved ``config.json`` (unresolved)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = json.load(f) if path.suffix == ".json" else tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ConfigError(f"{path} is not valid {kind}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a table of settings, got {type(raw).__name__}")
    return raw
