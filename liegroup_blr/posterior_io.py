"""The file format of a :class:`~liegroup_blr.Posterior`: a state dict of tensors, strings,
numbers, lists and dicts (loadable with ``torch.load(weights_only=True)``), each distinct group
and base stored once by class name and constructor parameters; built-in groups and the
library's bases are restored by name, custom ones are passed by the caller.

Version 2 (this one) records the temperature τ and the data size N the posterior was trained
at. Version 1 recorded neither: it still loads, read as τ = 1 (or the ``temperature`` its
reader passes) with a warning that says so."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor
from torch.distributions import Distribution

from ._userline import warn
from .distributions import base_family, registered
from .groups import LieGroup
from .groups.base import registered_group

__all__ = ["FORMAT", "VERSION", "Entry", "describe_base", "entries", "load", "save", "state_dict"]


class Entry(Protocol):
    """What a file holds of one parameter's posterior (a
    :class:`~liegroup_blr.posterior.PosteriorEntry`)."""

    @property
    def element(self) -> Tensor: ...
    @property
    def group(self) -> LieGroup: ...
    @property
    def base(self) -> Distribution: ...
    @property
    def shape(self) -> torch.Size: ...


E = TypeVar("E")

FORMAT = "liegroup_blr.Posterior"
"""The ``"format"`` entry of a posterior's state dict and file."""
VERSION = 2
"""The version of the state-dict layout this module writes; version 2 added the keys
``"temperature"`` and ``"data_size"`` to version 1's."""
READS = (1, 2)
"""The versions this module reads."""


def state_dict(
    items: Iterable[tuple[str | int, Entry]],
    *,
    point_at: str,
    size: int | None,
    missing: Iterable[str | int],
    temperature: float | None,
    data_size: float | None,
) -> dict[str, Any]:
    """:meth:`Posterior.state_dict <liegroup_blr.Posterior.state_dict>` of the entries
    ``items`` (key, entry) and the posterior's ``point_at``, size, missing keys, temperature
    and data size."""
    groups: dict[int, int] = {}
    bases: dict[int, int] = {}
    group_specs: list[dict[str, Any]] = []
    base_specs: list[dict[str, Any]] = []
    rows = []
    for key, e in items:
        if id(e.group) not in groups:
            groups[id(e.group)] = len(group_specs)
            group_specs.append(_group_spec(e.group))
        if id(e.base) not in bases:
            bases[id(e.base)] = len(base_specs)
            base_specs.append(_base_spec(e.base))
        rows.append(
            {
                "key": key,
                "shape": list(e.shape),
                "group": groups[id(e.group)],
                "base": bases[id(e.base)],
                "element": e.element.detach().clone(),
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "point_estimate": point_at,  # the key of every version: files stay as they were
        "size": size,
        "missing": list(missing),
        "temperature": temperature,
        "data_size": data_size,
        "groups": group_specs,
        "bases": base_specs,
        "entries": rows,
    }


def entries(
    state_dict: Mapping[str, Any],
    groups: LieGroup | Mapping[str | int, LieGroup] | None,
    bases: Distribution | Mapping[str | int, Distribution] | None,
    entry: Callable[..., E],
    *,
    temperature: float | None = None,
) -> tuple[dict[str | int, E], dict[str, Any]]:
    """The entries of a posterior's state dict and the keywords of its constructor; the
    custom groups and bases from ``groups`` and ``bases``; ``temperature``, if given, in
    place of the recorded τ (a version-1 dict records none: τ = 1 with a warning unless
    given). ValueError in one line for a dict that is not a posterior's, of an unknown
    version, or malformed."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        raise ValueError(
            f"state_dict: not a liegroup_blr Posterior (no 'format': {FORMAT!r} entry)"
        )
    version = state_dict.get("version")
    if isinstance(version, bool) or version not in READS:
        raise ValueError(
            f"state_dict: Posterior format version {version!r}; this liegroup_blr reads "
            f"versions {', '.join(map(str, READS))}"
        )
    try:
        found = {}
        for row in state_dict["entries"]:
            key = row["key"]
            found[key] = entry(
                _as_tensor(row["element"], key),
                _restore(state_dict["groups"][row["group"]], key, groups, "groups"),
                _restore(state_dict["bases"][row["base"]], key, bases, "bases"),
                torch.Size(row["shape"]),
            )
        options = {k: state_dict[k] for k in ("missing", "size")}
        options["point_at"] = state_dict["point_estimate"]
        if version >= 2:
            options["temperature"] = state_dict["temperature"]
            options["data_size"] = state_dict["data_size"]
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise ValueError(
            f"state_dict: a malformed Posterior state dict ({type(err).__name__}: {err})"
        ) from None
    if temperature is not None:
        options["temperature"] = temperature
    elif version == 1:
        warn(
            "Posterior: a version-1 file records no temperature τ; read as τ = 1. If it was "
            "trained at another τ, pass it: Posterior.load(path, temperature=τ) (or "
            "from_state_dict(..., temperature=τ)); save it again to record it"
        )
        options["temperature"] = 1.0
    return found, options


def save(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file beside ``path``, then moved into place (atomic)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        torch.save(state_dict, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: str | os.PathLike[str], map_location: str | torch.device | None) -> Any:
    """``torch.load(weights_only=True)``; ValueError in one line for a file it cannot read."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ValueError(
            f"path: {os.fspath(path)!r} is not a readable Posterior file (truncated, corrupt "
            f"or not weights-only; torch.load: {type(err).__name__}: {reason})"
        ) from None


def _group_spec(group: LieGroup) -> dict[str, Any]:
    """The group's class name and :meth:`~liegroup_blr.groups.LieGroup.options`."""
    return {"name": type(group).__name__, **group.options()}


def _base_spec(base: Distribution) -> dict[str, Any]:
    """The base's class name and, for a registered class
    (:func:`~liegroup_blr.distributions.register_base`), its parameters."""
    name, family = type(base).__name__, base_family(base, exact=True)
    if family is None:
        return {"name": name}
    return {"name": name, "params": {k: getattr(base, k).detach().clone() for k in family.params}}


def describe_base(base: Distribution) -> str:
    """A base as its class name and parameters, e.g. ``Normal(loc=0, scale=0.1)``."""
    spec = _base_spec(base)
    params = ", ".join(f"{k}={float(v):g}" for k, v in spec.get("params", {}).items())
    return f"{spec['name']}({params})"


def _as_tensor(value: Any, key: str | int) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"entry {key!r}: element is a {type(value).__name__}, not a tensor")
    return value


def _restore(spec: Mapping[str, Any], key: str | int, passed: Any, kind: str) -> Any:
    """The group or base of entry ``key``: passed by the caller (by key, by class name, or
    one object for all), else rebuilt from a registered class of that name
    (:func:`~liegroup_blr.groups.register_group`,
    :func:`~liegroup_blr.distributions.register_base`); ValueError naming what to pass."""
    name = spec["name"]
    if isinstance(passed, Mapping):
        obj = passed.get(key, passed.get(name))
    else:  # one object for every entry saved with its class
        obj = passed if type(passed).__name__ == name else None
    if obj is None:
        group, base = registered_group(name), registered(name)
        if kind == "groups" and group is not None:
            return group(**{k: v for k, v in spec.items() if k != "name"})
        if kind == "bases" and "params" in spec and base is not None:
            return base(**spec["params"])
        raise ValueError(
            f"{kind}: entry {key!r} was saved with the custom {name!r}, which is not "
            f"registered here; pass it: Posterior.load(path, {kind}={{{name!r}: ...}})"
        )
    if type(obj).__name__ != name:
        raise ValueError(
            f"{kind}: entry {key!r} was saved with a {name!r}, got a {type(obj).__name__!r}"
        )
    return obj
