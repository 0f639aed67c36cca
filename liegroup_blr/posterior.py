r"""The posterior as an object: group elements detached from the optimizer that learned them.

A :class:`Posterior` holds, for every trained parameter, its group element :math:`g`, its Lie
group and its base distribution :math:`q_0`, so :math:`q_g = g\cdot q_0` can be sampled,
read as a point estimate, saved and loaded in a process that never saw the optimizer. It
records the temperature τ it was trained at (and the data size N), so the memory maps, the
leave-one-out NLL and a memory's kernel read them from it as they do from the optimizer::

    post = lgb.Posterior.from_optimizer(optimizer, model)
    post.save("posterior.pt")
    ...
    post = lgb.Posterior.load("posterior.pt")
    with post.sampled(model):        # θ = readout(g·ξ), ξ ~ q0, in the model's parameters
        logits = model(x)
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

from . import posterior_io
from ._userline import warn
from .distributions import check_base, sample_into
from .groups import LieGroup

__all__ = ["POINT_AT", "Posterior", "PosteriorEntry", "holder", "unwrap", "wrapped"]


POINT_AT = ("g", "mean")
"""Where a point estimate is read (``point_at=`` of a :class:`~liegroup_blr.Posterior` and of
the optimizers): ``"g"``, θ = readout(g·ξ₀) at the group's reference point ξ₀, or ``"mean"``,
θ = readout(g·E[ξ]) at the base's mean in every coordinate."""


def unwrap(optimizer: Any, kind: type | None = None) -> Any:
    """The optimizer holding a posterior that ``optimizer`` is or wraps, or ``None`` when it
    holds none (a deterministic optimizer such as ``torch.optim.SGD``).

    Wrappers are followed through ``.optimizer`` and ``._optimizer``, wrappers of wrappers
    included, outermost first (a cycle ends the chain): Lightning's ``LightningOptimizer``,
    accelerate's ``AcceleratedOptimizer``. The first object of the chain that holds a
    posterior (has a ``posterior()`` method), or with ``kind`` the first instance of it
    (:class:`~liegroup_blr.optim.BLROptimizer`, for what only the Lie-group optimizers do),
    is returned. The one function of its kind, also :func:`liegroup_blr.optim.unwrap`."""
    if kind is not None:
        return next((o for o in _chain(optimizer) if isinstance(o, kind)), None)
    return next((o for o in _chain(optimizer) if callable(getattr(o, "posterior", None))), None)


def _chain(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and each optimizer it wraps, outermost first (:func:`unwrap`)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        yield optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)


def wrapped(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and each optimizer it wraps, outermost first: Lightning's
    ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``, anything holding the next as
    ``.optimizer`` or ``._optimizer`` (a cycle ends the chain).

    Deprecated: use :func:`unwrap`, which returns the Lie-group optimizer of the chain.
    """
    warn("posterior.wrapped is deprecated; use liegroup_blr.posterior.unwrap", DeprecationWarning)
    return _chain(optimizer)


def holder(optimizer: Any) -> Any:
    """The optimizer of a chain of wrappers that holds a posterior, or ``None``.

    Deprecated: use :func:`unwrap`, the same function under its one name.
    """
    warn("posterior.holder is deprecated; use liegroup_blr.posterior.unwrap", DeprecationWarning)
    return unwrap(optimizer)


@dataclass(frozen=True, eq=False)
class PosteriorEntry:
    """One parameter's posterior :math:`q_g = g\\cdot q_0`, an entry of a
    :class:`~liegroup_blr.Posterior`.

    Attributes:
        element: the group element g (detached; the optimizer's state dtype).
        group: its Lie group.
        base: the scalar base distribution q0, drawn i.i.d. per coordinate of the base space.
        shape: the parameter's shape.
    """

    element: Tensor
    group: LieGroup
    base: Distribution
    shape: torch.Size

    def check(self, key: str | int) -> None:
        """ValueError naming ``key`` if the element does not fit the group and shape."""
        if not isinstance(self.group, LieGroup):
            raise ValueError(f"group: entry {key!r} has {self.group!r}, not a LieGroup")
        check_base(self.base, self.group.positive_base, f"base of entry {key!r}")
        expected = self.group.element_shape(self.shape)
        if self.element.shape != expected:
            raise ValueError(
                f"element: entry {key!r} has shape {tuple(self.element.shape)}, a "
                f"{type(self.group).__name__} element of a {tuple(self.shape)} parameter has "
                f"{tuple(expected)}"
            )


class Posterior(Mapping[str | int, PosteriorEntry]):
    r"""A detached snapshot of a trained posterior: per parameter its group element, Lie group
    and base distribution, keyed by parameter name or by position.

    A read-only mapping from keys to :class:`~liegroup_blr.posterior.PosteriorEntry`
    (``len``, iteration over the keys, ``post[key]``), in the order of the optimizer's param
    groups. Keys are parameter names (``str``) or positions (``int``).

    It records what its consumers need besides the elements: the temperature τ of the rule
    that learned it (a rule at τ learns about τ times the posterior covariance, which
    :func:`~liegroup_blr.memory_maps.sensitivity`,
    :func:`~liegroup_blr.memory_maps.loo_nll`, :func:`~liegroup_blr.memory_maps.memory_map`
    and :meth:`~liegroup_blr.MemorablePast.add_task` divide by) and the data size N it was
    trained at. The likelihood is not recorded: the optimizer
    never sees it (the closure's loss is it), so those functions take it as an argument, from
    a posterior as from an optimizer.

    Args:
        entries: the entries, by key.
        point_at: where the point estimate is read (:data:`~liegroup_blr.posterior.POINT_AT`):
            ``"g"`` (θ read at the group's reference point ξ₀) or ``"mean"`` (θ read at
            E[ξ]), as the optimizer's ``point_at``. ``point_estimate=`` is its deprecated
            name.
        missing: keys of the optimizer's parameters that had no state (never trained).
        size: the number of positions of a posterior keyed by position (entries and
            missing ones): the length of ``model.parameters()`` it applies to.
        temperature: τ ≥ 0 it was trained at (default 1, the optimizers' default); ``None``
            where the optimizer's param groups had different temperatures (its consumers
            then need ``temperature=``).
        data_size: N > 0 it was trained at, or ``None`` (not known, or different per param
            group).

    Attributes:
        point_at: ``"g"`` or ``"mean"`` (:attr:`point_estimate` is its deprecated name).
        missing: keys left out for want of optimizer state.
        size: positions of a posterior keyed by position, else ``None``.
        by_position: whether keys are positions.
        temperature: τ, or ``None``.
        data_size: N, or ``None``.

    Raises:
        ValueError: naming the argument, for an invalid convention or entry.
    """

    def __init__(
        self,
        entries: Mapping[str | int, PosteriorEntry],
        *,
        point_at: str = "g",
        missing: Sequence[str | int] = (),
        size: int | None = None,
        temperature: float | None = 1.0,
        data_size: float | None = None,
        point_estimate: str | None = None,
    ) -> None:
        if point_estimate is not None:
            warn(
                "Posterior: point_estimate= is deprecated; pass point_at= (the same values)",
                DeprecationWarning,
            )
            point_at = point_estimate
        if point_at not in POINT_AT:
            raise ValueError(f"point_at: must be one of {POINT_AT}")
        keys = [*entries, *missing]
        kinds = {type(k) for k in keys}
        if not kinds <= {str} and not kinds <= {int}:
            raise ValueError("entries: keys must be all parameter names or all positions")
        if len(set(keys)) != len(keys):
            raise ValueError("missing: a key is both an entry and missing")
        positions = [k for k in keys if isinstance(k, int)]
        self.by_position = bool(keys) and len(positions) == len(keys)
        if self.by_position:
            size = len(keys) if size is None else size
            if any(not 0 <= k < size for k in positions):
                raise ValueError(f"size: {size} positions do not hold every key")
        for key, entry in entries.items():
            entry.check(key)
            if point_at == "mean" and not torch.isfinite(entry.base.mean).all():
                raise ValueError(f"point_at: 'mean' needs a finite E[ξ] (entry {key!r})")
        self._entries = dict(entries)
        self.point_at = point_at
        self.missing: list[str | int] = list(missing)
        self.size = size if self.by_position else None
        self.temperature = _recorded("temperature", temperature, positive=False)
        self.data_size = _recorded("data_size", data_size, positive=True)

    # ------------------------------------------------------------- mapping
    def __getitem__(self, key: str | int) -> PosteriorEntry:
        return self._entries[key]

    def __iter__(self) -> Iterator[str | int]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        keyed = "position" if self.by_position else "name"
        head = (
            f"Posterior({len(self)} entries by {keyed}, point_at={self.point_at!r}"
            + f", temperature={self.temperature!r}, data_size={self.data_size!r}"
            + (f", missing={self.missing}" if self.missing else "")
            + ")"
        )
        rows = [
            f"  {key!s}: {tuple(e.shape)} {type(e.group).__name__}({e.group.extra_repr()}) "
            f"{posterior_io.describe_base(e.base)}"
            for key, e in self.items()
        ]
        return "\n".join([head, *rows])

    # --------------------------------------------------------- construction
    @classmethod
    def from_optimizer(cls, optimizer: Any, model: nn.Module | None = None) -> Posterior:
        """Snapshot a Lie-group BLR optimizer's posterior: ``optimizer.posterior(model)`` of
        the optimizer or of the one a wrapper holds (Lightning's, accelerate's, as
        ``.optimizer``).

        Keys are ``model.named_parameters()`` names when ``model`` is given, else positions
        in the order of the optimizer's param groups (the order of ``model.parameters()``
        for an optimizer built from it). Sharded (FSDP2) parameters' elements are gathered
        whole (a collective: call it on every rank). Parameters without state yet (never
        trained, e.g. frozen) are left out, recorded in :attr:`missing` and named in a warning.

        Raises:
            TypeError: ``optimizer`` holds no Lie-group optimizer.
            ValueError: ``model`` lacks one of the optimizer's parameters.
        """
        source = unwrap(optimizer)
        if source is None:
            raise TypeError(
                f"optimizer: a Lie-group BLR optimizer (or a wrapper holding one as .optimizer) "
                f"has a posterior, {type(optimizer).__name__} has none"
            )
        return source.posterior(model)

    def with_point_at(self, point_at: str) -> Posterior:
        """The same posterior with its point estimate read at ``point_at`` (``"g"`` or
        ``"mean"``, :data:`~liegroup_blr.posterior.POINT_AT`): the point estimates (and what a
        posterior as prior means) change, the samples do not."""
        return self._like(self._entries, point_at)

    def with_point_estimate(self, point_estimate: str) -> Posterior:
        """Deprecated name of :meth:`with_point_at`."""
        warn(
            "Posterior.with_point_estimate is deprecated; use with_point_at (the same values)",
            DeprecationWarning,
        )
        return self.with_point_at(point_estimate)

    @property
    def point_estimate(self) -> str:
        """Deprecated name of :attr:`point_at`."""
        warn("Posterior.point_estimate is deprecated; read point_at", DeprecationWarning)
        return self.point_at

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Posterior:
        """A copy with every element on ``device`` (and in ``dtype``), like ``Tensor.to``."""
        entries = {
            k: PosteriorEntry(e.element.to(device=device, dtype=dtype), e.group, e.base, e.shape)
            for k, e in self.items()
        }
        return self._like(entries)

    def _like(
        self, entries: Mapping[str | int, PosteriorEntry], point_at: str | None = None
    ) -> Posterior:
        """A posterior of ``entries`` with this one's options (``point_at``, if given, in place
        of its own)."""
        return Posterior(
            entries,
            point_at=self.point_at if point_at is None else point_at,
            missing=self.missing,
            size=self.size,
            temperature=self.temperature,
            data_size=self.data_size,
        )

    # ---------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """Everything as tensors, strings, numbers, lists and dicts (loadable with
        ``torch.load(weights_only=True)``): each distinct group and base once, by class name
        and constructor parameters, per entry its key, shape, element and their indices, and
        the temperature and data size (:mod:`liegroup_blr.posterior_io`, format version 2)."""
        return posterior_io.state_dict(
            self.items(),
            point_at=self.point_at,
            size=self.size,
            missing=self.missing,
            temperature=self.temperature,
            data_size=self.data_size,
        )

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Any],
        groups: LieGroup | Mapping[str | int, LieGroup] | None = None,
        bases: Distribution | Mapping[str | int, Distribution] | None = None,
        *,
        temperature: float | None = None,
    ) -> Posterior:
        """Rebuild a posterior from :meth:`state_dict`.

        Built-in groups and the bases of the library's registry are restored by name.
        Custom ones are passed here: one object for every custom entry, or a mapping from an
        entry's key or the class name to the object (an entry's key wins). A passed object
        must be of the class that was saved.

        A version-1 state dict (written before posteriors recorded their temperature) loads
        with a warning naming τ: it is read as τ = 1 unless ``temperature`` is given. A given
        ``temperature`` replaces the recorded one in any version.

        Raises:
            ValueError: in one line, for a dict that is not a posterior's, of an unknown format
                version, malformed, or whose custom groups or bases were not passed.
        """
        entries, options = posterior_io.entries(
            state_dict, groups, bases, PosteriorEntry, temperature=temperature
        )
        return cls(entries, **options)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` with ``torch.save`` to a temporary file beside ``path``,
        then move it into place (atomic: ``path`` is never a partial file)."""
        posterior_io.save(self.state_dict(), path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        groups: LieGroup | Mapping[str | int, LieGroup] | None = None,
        bases: Distribution | Mapping[str | int, Distribution] | None = None,
        map_location: str | torch.device | None = "cpu",
        *,
        temperature: float | None = None,
    ) -> Posterior:
        """Read a file written by :meth:`save` with ``torch.load(weights_only=True)``;
        ``groups``, ``bases`` and ``temperature`` (τ of a version-1 file, which records none)
        as :meth:`from_state_dict`.

        Raises:
            ValueError: in one line, for a file that cannot be read (truncated, corrupt, or
                holding more than weights) or is not a posterior's.
        """
        state_dict = posterior_io.load(path, map_location)
        try:
            return cls.from_state_dict(state_dict, groups, bases, temperature=temperature)
        except ValueError as err:
            raise ValueError(f"path: {os.fspath(path)!r}: {err}") from None

    # ------------------------------------------------------------- values
    def sample(self, generator: torch.Generator | None = None) -> dict[str | int, Tensor]:
        """One posterior sample θ = readout(g·ξ) per entry, ξ ~ q0 drawn i.i.d. per coordinate
        of the base space with :func:`~liegroup_blr.distributions.sample_into` from
        ``generator`` (default: torch's global generator), entry by entry in order: the
        order in which an optimizer draws its fresh noise, and θ with the group's
        :meth:`~liegroup_blr.groups.LieGroup.theta`, as the optimizer computes it, so a
        generator in the state of the optimizer's generator of prediction draws
        (``optimizer.state_dict()["predict_rng"]``) gives its next ``sampled_params()`` sample
        bit for bit."""
        out = {}
        for key, e in self.items():
            xi = e.element.new_empty(e.group.base_shape(e.shape))
            sample_into(e.base, xi, generator)
            out[key] = e.group.theta(e.element, xi).reshape(e.shape)
        return out

    def point_estimates(self) -> dict[str | int, Tensor]:
        """The point estimate per entry, as the optimizer writes it (the group's
        :meth:`~liegroup_blr.groups.LieGroup.point`): readout(g·ξ₀) with ξ₀ the group's
        reference point (``"g"``) or E[ξ] in every coordinate (``"mean"``)."""
        out = {}
        for key, e in self.items():
            mean = float(e.base.mean) if self.point_at == "mean" else None
            out[key] = e.group.point(e.element, mean).reshape(e.shape)
        return out

    # --------------------------------------------------------------- models
    def _targets(self, model: nn.Module) -> list[tuple[str | int, nn.Parameter]]:
        """The model's parameter of each entry; ValueError if names or shapes differ."""
        if self.by_position:
            params: Mapping[str | int, nn.Parameter] = dict(enumerate(model.parameters()))
            if len(params) != self.size:
                raise ValueError(
                    f"model: has {len(params)} parameters, the posterior was taken by position "
                    f"over {self.size}; use the same architecture, or take it with model=..."
                )
        else:
            params = dict(model.named_parameters())
        out = []
        for key, e in self.items():
            p = params.get(key)
            if p is None:
                raise ValueError(f"model: has no parameter {key!r}, which the posterior holds")
            if p.shape != e.shape:
                raise ValueError(
                    f"model: parameter {key!r} has shape {tuple(p.shape)}, the posterior's "
                    f"{tuple(e.shape)}"
                )
            out.append((key, p))
        return out

    @staticmethod
    @contextmanager
    def _swapped(
        targets: list[tuple[str | int, nn.Parameter]], values: dict[str | int, Tensor]
    ) -> Iterator[None]:
        """``values`` in the target parameters for the block, their old values after it."""
        saved = [p.detach().clone() for _, p in targets]
        try:
            with torch.no_grad():
                for key, p in targets:
                    p.copy_(values[key])
            yield
        finally:
            with torch.no_grad():
                for (_, p), old in zip(targets, saved, strict=True):
                    p.copy_(old)

    @contextmanager
    def sampled(self, model: nn.Module, generator: torch.Generator | None = None) -> Iterator[None]:
        """Hold one posterior sample (:meth:`sample`) in ``model``'s parameters for the
        block, and their previous values again after it, also on error. Parameters the
        posterior does not hold (:attr:`missing` ones, or a part the optimizer never had)
        keep their values.

        Raises:
            ValueError: ``model`` lacks one of the posterior's names, has another number of
                parameters than a posterior keyed by position, or another shape.
        """
        targets = self._targets(model)  # refused before any draw
        with self._swapped(targets, self.sample(generator)):
            yield

    @contextmanager
    def at_point_estimate(self, model: nn.Module) -> Iterator[None]:
        """Hold the point estimate (:meth:`point_estimates`) in ``model`` for the block."""
        with self._swapped(self._targets(model), self.point_estimates()):
            yield

    @torch.no_grad()
    def load_point_estimate(self, model: nn.Module) -> None:
        """Write the point estimate (:meth:`point_estimates`) into ``model``, permanently."""
        values = self.point_estimates()
        for key, p in self._targets(model):
            p.copy_(values[key])


def _recorded(name: str, value: Any, *, positive: bool) -> float | None:
    """``value`` as a float (``None`` stays): finite and ≥ 0 (> 0 with ``positive``);
    ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a number or None, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(
            f"{name}: must be a finite number {'>' if positive else '>='} 0, got {value!r}"
        )
    return number
