r"""Where the base noise ξ comes from: noise sources behind one small protocol.

Every optimizer owns one :class:`NoiseSource` (``noise=`` at construction: ``"fresh"``,
``"table"`` or a source object; ``antithetic=True`` pairs its draws): the generators of its
training draws and of its prediction draws, one per device (and per shard of a sharded
parameter), seeded from the optimizer's seed, with a ``state_dict`` of their own, so an
optimizer's ``state_dict`` resumes the noise bit for bit. A source says how a sample's ξ is
made (:meth:`NoiseSource.draw`) and what the engine may rely on (:attr:`NoiseSource.views`).

- :class:`FreshNoise` draws ξ from the base every time.
- :class:`TableNoise` serves each request as a window of a pre-drawn :class:`NoiseTable` at a
  uniformly random offset: on a CPU a fresh ``normal_`` over a network's parameters costs more
  than its forward and backward pass, a window one random integer.
- :class:`Antithetic` pairs consecutive training samples of a step, ξ and its reflection
  :math:`2c - \xi` about the centre c of a symmetric base: half the draws, and a lower variance
  of the gradient estimate.
- Any subclass of :class:`NoiseSource` (the reference code's noise, a quasi-random sequence).

Draws for prediction (``start_sample(train=False)``: model averages, ``sampled_params()``
outside training) come from generators of their own, seeded from the same seed and saved in
the same state dict, so evaluating never advances the training noise: a run that evaluates
trains exactly like one that does not, ranks that evaluate on one process only stay in step,
and a checkpoint resumes bit for bit whatever was evaluated before it.

A sharded (DTensor, FSDP2) parameter's shard is served the part of the whole parameter's
table window that it covers, addressed by global index: the same values as one process,
however the parameter is split. Fresh draws for a shard come from the shard's own generator
(seeded by its coordinate on the device mesh): each element is drawn once per sample, by the
rank that holds it, independently of the other shards; a CPU generator cannot skip ahead to an
offset, so these are not the one process's values, only values of the same law.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution

from .distributions import base_family, sample_each, sample_into
from .sharding import SHARDED, shard_name, shard_of

__all__ = [
    "NOISE_SOURCES",
    "Antithetic",
    "FreshNoise",
    "NoiseSource",
    "NoiseTable",
    "TableNoise",
    "noise_source",
    "symmetric_centre",
]

NOISE_SOURCES = ("fresh", "table")
"""The noise sources named by a string (:class:`FreshNoise`, :class:`TableNoise`)."""

_CPU = torch.device("cpu")


def symmetric_centre(base: Distribution) -> float | None:
    """Centre c of a base symmetric about c (so 2c − ξ has the base's law), else ``None``:
    its family's ``centre`` (:class:`~liegroup_blr.distributions.BaseFamily`)."""
    family = base_family(base)
    return None if family is None or family.centre is None else family.centre(base)


class NoiseTable:
    r"""``size`` i.i.d. draws of ``base``, served as windows at uniformly random offsets.

    A request for n values returns ``table[o : o + n]`` with o uniform on {0, …, T − n}.
    Every window is an i.i.d. sample of the base (a stretch of i.i.d. draws). Two requests
    share a coordinate's value only if their offsets coincide, so the correlation of a
    coordinate across two draws is :math:`1/(T - n + 1)`; windows that merely overlap reuse
    values at other coordinates. The table is a deterministic function of ``seed``, so it is
    rebuilt, not stored, when an optimizer resumes.

    Args:
        base: scalar base distribution.
        size: T, the number of pre-drawn values.
        seed: seed of the table's own generator.
        dtype: dtype of the table.
        device: device of the table.
    """

    def __init__(
        self,
        base: Distribution,
        size: int,
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size: must be ≥ 1, got {size}")
        generator = torch.Generator(device=device).manual_seed(seed)
        self.table = sample_into(base, torch.empty(size, dtype=dtype, device=device), generator)

    @property
    def size(self) -> int:
        """T, the number of pre-drawn values."""
        return self.table.numel()

    def window(self, numel: int, offset: int) -> Tensor:
        """The ``numel`` values at ``offset`` (a view: no copy, read-only by convention)."""
        if numel > self.size:
            raise ValueError(f"numel: a window of {numel} exceeds the table of {self.size}")
        return self.table.narrow(0, offset % (self.size - numel + 1), numel)

    def fill_(self, out: Tensor, offset: int) -> Tensor:
        """Copy the window at ``offset`` into ``out``."""
        return out.copy_(self.window(out.numel(), offset).view(out.shape))


class NoiseSource:
    """The noise of one optimizer: its generators, their seeding and state, and the protocol
    the engine draws through.

    The engine calls :meth:`bind` once (the seed, shared by the ranks that must draw alike,
    and the rank), then per sample :meth:`start_sample` and :meth:`draw` for each param
    group, and :meth:`end_step` after each update. A subclass implements :meth:`draw`, which
    fills ``outs`` (or returns other tensors of their shapes, e.g. read-only views) from
    ``self.generator(...)``, and sets :attr:`views` when it returns views.

    Attributes:
        views: whether :meth:`draw` returns read-only views of its own storage rather than
            filling ``outs`` (a compiled update then draws the next sample after the update
            where a copy would cost more than it saves).
        needs_symmetric_base: whether the source reflects draws about the base's centre.
    """

    views = False
    needs_symmetric_base = False

    def __init__(self) -> None:
        self._seed, self._rank = 0, 0
        self._generators: dict[tuple[torch.device, str], torch.Generator] = {}
        self._predict: dict[tuple[torch.device, str], torch.Generator] = {}  # prediction draws

    @property
    def seed(self) -> int:
        """The seed of every generator."""
        return self._seed

    @property
    def rank(self) -> int:
        """The process rank mixed into the seeds."""
        return self._rank

    def bind(self, seed: int, rank: int = 0) -> None:
        """Seed the source (``rank``: mixed into the seeds); its generators start afresh."""
        self._seed, self._rank = int(seed), rank
        self._generators.clear()
        self._predict.clear()

    def generator(
        self, device: torch.device, shard: str = "", *, predict: bool = False
    ) -> torch.Generator:
        """The training generator of ``device`` (made on first use from the seed, device and
        rank), or of a ``shard`` of sharded parameters on it
        (:func:`~liegroup_blr.sharding.shard_name`); ``predict``: the generator of prediction
        draws instead, seeded apart."""
        gens = self._predict if predict else self._generators
        gen = gens.get((device, shard))
        if gen is None:
            gen = torch.Generator(device=device)
            name = f"{device}:{self.rank}{shard}" + (":predict" if predict else "")
            gen.manual_seed(self.seed ^ zlib.crc32(name.encode()))
            gens[device, shard] = gen
        return gen

    @property
    def nbytes(self) -> int:
        """Bytes the source holds besides its generators (tables, kept draws)."""
        return 0

    def start_sample(self, train: bool) -> None:
        """Open one sample: a training sample, or one for prediction (``train=False``)."""

    def end_step(self) -> None:
        """A step's samples are done."""

    def draw(
        self,
        outs: list[Tensor],
        base: Distribution,
        keys: list[Tensor],
        index: int,
        *,
        predict: bool,
    ) -> list[Tensor]:
        """This sample's ξ ~ q0 (``base``) for the parameters ``keys`` of param group ``index``,
        from the training or (``predict``) the prediction generators: ``outs`` filled, or
        tensors of their shapes the engine only reads."""
        raise NotImplementedError

    def make_generators(self, keys: list[Tensor]) -> None:
        """Make now every generator draws for the parameters ``keys`` will use, so that a
        state dict lists them all (DCP loads only the entries of the state dict it is
        given)."""
        for predict in (False, True):
            for key in keys:
                self.generator(key.device, shard_name(key), predict=predict)

    def state_dict(self) -> dict[str, Any]:
        """Seed and the states of the training (``"rng"``) and prediction (``"predict_rng"``)
        generators."""
        generators = {"rng": self._generators, "predict_rng": self._predict}
        state: dict[str, Any] = {"seed": self._seed}  # one call: the engine takes it per step
        for key, gens in generators.items():
            state[key] = {f"{d}{shard}": gen.get_state() for (d, shard), gen in gens.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; prediction generators missing from ``state`` (a state
        saved before they existed) start from the seed."""
        self.bind(int(state.get("seed", self.seed)), self.rank)
        for key, predict in (("rng", False), ("predict_rng", True)):
            for name, gen_state in state.get(key, {}).items():
                device, _, shard = name.partition("/")
                gen = self.generator(torch.device(device), shard and f"/{shard}", predict=predict)
                gen.set_state(gen_state)


class FreshNoise(NoiseSource):
    """ξ drawn from the base every time (``noise="fresh"``, the default)."""

    def draw(self, outs, base, keys, index, *, predict):
        sharded = any(isinstance(k, SHARDED) for k in keys)
        if not sharded and len(devices := {out.device for out in outs}) == 1:
            device = devices.pop()
            gen = (self._predict if predict else self._generators).get((device, ""))
            return sample_each(base, outs, gen or self.generator(device, predict=predict))
        return [
            sample_into(base, out, self.generator(out.device, shard_name(k), predict=predict))
            for out, k in zip(outs, keys, strict=True)
        ]


class TableNoise(NoiseSource):
    """Windows of a pre-drawn :class:`NoiseTable` per param group, device and dtype
    (``noise="table"``), served as read-only views; the offsets come from the CPU generator.

    Args:
        size: values in each table (default max(2²⁴, 4 × the group's largest tensor)).
    """

    views = True

    def __init__(self, size: int | None = None) -> None:
        if size is not None and (isinstance(size, bool) or size < 1):
            raise ValueError(f"table_size: must be a positive integer, got {size!r}")
        super().__init__()
        self.size = size
        self._tables: dict[tuple[int, torch.device, torch.dtype], NoiseTable] = {}

    def bind(self, seed: int, rank: int = 0) -> None:
        super().bind(seed, rank)
        self._tables.clear()

    def table(self, base: Distribution, index: int, like: Tensor, largest: int) -> NoiseTable:
        """The table of param group ``index`` for ``like``'s device and dtype."""
        key = (index, like.device, like.dtype)
        table = self._tables.get(key)
        if table is None:
            size = self.size or max(2**24, 4 * largest)
            seed = (self.seed + 7919 * (index + 1) + 104729 * self.rank) % 2**63
            table = self._tables[key] = NoiseTable(base, size, seed, like.dtype, like.device)
        return table

    @property
    def nbytes(self) -> int:
        return sum(t.table.nbytes for t in self._tables.values())

    def draw(self, outs, base, keys, index, *, predict):
        largest = 2 * max(k.numel() for k in keys)  # 2: signed parts
        cpu = self.generator(_CPU, predict=predict)
        offsets = torch.randint(0, 2**62, (len(outs),), generator=cpu).tolist()
        return [
            self._window(self.table(base, index, out, largest), out, k, offset)
            for out, k, offset in zip(outs, keys, offsets, strict=True)
        ]

    @staticmethod
    def _window(table: NoiseTable, out: Tensor, key: Tensor, offset: int) -> Tensor:
        """The window at ``offset`` as ``out``'s shape; of a sharded parameter ``key``, the
        part of the whole parameter's window that its local shard covers, copied into
        ``out``."""
        if not isinstance(key, SHARDED):
            return table.window(out.numel(), offset).view(out.shape)
        shape = (*out.shape[: out.dim() - key.dim()], *key.shape)
        whole = table.window(torch.Size(shape).numel(), offset).view(shape)
        return out.copy_(shard_of(whole, key))

    def make_generators(self, keys: list[Tensor]) -> None:
        for predict in (False, True):
            self.generator(_CPU, predict=predict)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tables"] = {}  # deterministic in the seed: rebuilt, not copied
        return state


class Antithetic(NoiseSource):
    r"""Consecutive training samples of a step in pairs (ξ, 2c − ξ), c the centre of a
    symmetric base (``antithetic=True``): the first of a pair drawn by ``source``, the second
    its reflection; prediction draws are not paired. The generators are ``source``'s.

    Args:
        source: the source of the first draw of each pair.
    """

    needs_symmetric_base = True

    def __init__(self, source: NoiseSource) -> None:  # the generators are the source's
        self.source = source
        self._kept: dict[Tensor, Tensor] = {}  # first draw of the current pair
        self._reflect_next = self._reflect = self._keep = False

    @property
    def seed(self) -> int:
        return self.source.seed

    @property
    def rank(self) -> int:
        return self.source.rank

    def bind(self, seed: int, rank: int = 0) -> None:
        self.source.bind(seed, rank)
        self._forget()

    def generator(self, device, shard="", *, predict=False):
        return self.source.generator(device, shard, predict=predict)

    @property
    def nbytes(self) -> int:
        return self.source.nbytes + sum(k.nbytes for k in self._kept.values())

    def start_sample(self, train: bool) -> None:
        """A training sample is the first or the second of a pair."""
        self._reflect = train and self._reflect_next
        self._keep = train and not self._reflect
        if train:
            self._reflect_next = not self._reflect
        self.source.start_sample(train)

    def end_step(self) -> None:
        """The next training sample opens a new pair."""
        self._reflect_next = False
        self.source.end_step()

    def draw(self, outs, base, keys, index, *, predict):
        if self._reflect:
            torch._foreach_copy_(outs, [self._kept[k] for k in keys])
            torch._foreach_mul_(outs, -1.0)
            centre = symmetric_centre(base)
            if centre:
                torch._foreach_add_(outs, 2 * centre)
            return outs
        xis = self.source.draw(outs, base, keys, index, predict=predict)
        if self._keep:
            for k, xi in zip(keys, xis, strict=True):
                first = self._kept.get(k)
                if first is None or first.shape != xi.shape or first.dtype != xi.dtype:
                    first = self._kept[k] = torch.empty_like(xi)
                first.copy_(xi)
        return xis

    def make_generators(self, keys: list[Tensor]) -> None:
        self.source.make_generators(keys)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
        self._forget()

    def _forget(self) -> None:
        self._kept.clear()
        self._reflect_next = False


def noise_source(
    noise: str | NoiseSource = "fresh", *, antithetic: bool = False, table_size: int | None = None
) -> NoiseSource:
    """The source the optimizers' ``noise``, ``antithetic`` and ``table_size`` options name.

    Raises:
        ValueError: an unknown name, or ``table_size`` with a source other than the table.
    """
    if isinstance(noise, NoiseSource):
        if table_size is not None:
            raise ValueError("table_size: give it to the source (TableNoise(size=...))")
        source = noise
    elif noise in NOISE_SOURCES:
        table = TableNoise(table_size)  # table_size checked with either name
        source = table if noise == "table" else FreshNoise()
    else:
        raise ValueError(
            f"noise: must be one of {NOISE_SOURCES} or a liegroup_blr.noise.NoiseSource, "
            f"got {noise!r}"
        )
    return Antithetic(source) if antithetic else source
