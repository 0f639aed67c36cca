r"""Where the base noise ξ comes from: fresh draws, a pre-drawn table, antithetic pairs.

Every optimizer owns one :class:`NoiseSource`: its generators (one per device), its noise
tables, their seeding and the antithetic pairing, with a ``state_dict`` of its own, so an
optimizer's ``state_dict`` resumes the noise bit for bit.

On a CPU a fresh ``normal_`` over a network's parameters costs more than its forward and
backward pass. :class:`NoiseTable` draws base noise once and serves each request as a window
of the table at a uniformly random offset, copied into place — one memory pass and a single
random integer instead of a random number per coordinate, as evolution-strategies codes do.
Antithetic sampling pairs ξ with its reflection :math:`2c - \xi` about the centre c of a
symmetric base: half the draws, and lower variance of the gradient estimate.

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
from torch.distributions import Cauchy, Distribution, Laplace, Normal, StudentT, Uniform

from .distributions import Dirac, sample_each, sample_into
from .optim.distributed import SHARDED, shard_of

__all__ = ["NOISE_SOURCES", "NoiseSource", "NoiseTable", "shard_name", "symmetric_centre"]

NOISE_SOURCES = ("fresh", "table")
"""Noise sources the optimizers accept (fresh draws from the base, or a :class:`NoiseTable`)."""

_CPU = torch.device("cpu")


def symmetric_centre(base: Distribution) -> float | None:
    """Centre c of a base symmetric about c (so 2c − ξ has the base's law), else ``None``."""
    if isinstance(base, (Normal, Laplace, StudentT, Cauchy)):
        return float(base.loc)
    if isinstance(base, Uniform):
        return float(base.low + base.high) / 2
    if isinstance(base, Dirac):
        return float(base.value)
    return None


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
    r"""The noise of one optimizer: generators, tables, seeding and antithetic pairing.

    Draws are made per param group with :meth:`sample`; a sample over all groups is opened by
    :meth:`start_sample`. With ``antithetic=True`` consecutive training samples of a step form
    pairs (ξ, 2c − ξ); :meth:`end_step` starts the next step with a fresh pair.

    Args:
        kind: ``"fresh"`` (draw ξ from the base every time) or ``"table"`` (windows of a
            :class:`NoiseTable` per param group, device and dtype).
        seed: seed of every generator and table.
        rank: process rank, mixed into the seeds so processes draw independent noise.
        antithetic: pair training samples by reflection.
        table_size: values in each table (default max(2²⁴, 4 × the group's largest tensor)).
    """

    def __init__(
        self,
        kind: str = "fresh",
        seed: int = 0,
        *,
        rank: int = 0,
        antithetic: bool = False,
        table_size: int | None = None,
    ) -> None:
        if kind not in NOISE_SOURCES:
            raise ValueError(f"noise: must be one of {NOISE_SOURCES}, got {kind!r}")
        if table_size is not None and (isinstance(table_size, bool) or table_size < 1):
            raise ValueError(f"table_size: must be a positive integer, got {table_size!r}")
        self.kind, self.seed, self.rank = kind, int(seed), rank
        self.antithetic, self.table_size = bool(antithetic), table_size
        self._generators: dict[tuple[torch.device, str], torch.Generator] = {}
        self._predict: dict[tuple[torch.device, str], torch.Generator] = {}  # prediction draws
        self._tables: dict[tuple[int, torch.device, torch.dtype], NoiseTable] = {}
        self._kept: dict[Tensor, Tensor] = {}  # first draw of the current antithetic pair
        self._reflect_next = False
        self._reflect = self._keep = False
        self._train = True  # whether the open sample is a training sample

    def generator(
        self, device: torch.device, shard: str = "", *, predict: bool = False
    ) -> torch.Generator:
        """The training generator of ``device`` (made on first use from the seed, device and
        rank), or of a ``shard`` of sharded parameters on it
        (:func:`~liegroup_blr.noise.shard_name`); ``predict``: the generator of prediction
        draws instead, seeded apart from it."""
        gens = self._predict if predict else self._generators
        gen = gens.get((device, shard))
        if gen is None:
            gen = torch.Generator(device=device)
            name = f"{device}:{self.rank}{shard}" + (":predict" if predict else "")
            gen.manual_seed(self.seed ^ zlib.crc32(name.encode()))
            gens[device, shard] = gen
        return gen

    def table(self, base: Distribution, index: int, like: Tensor, largest: int) -> NoiseTable:
        """The table of param group ``index`` for ``like``'s device and dtype."""
        key = (index, like.device, like.dtype)
        table = self._tables.get(key)
        if table is None:
            size = self.table_size or max(2**24, 4 * largest)
            seed = (self.seed + 7919 * (index + 1) + 104729 * self.rank) % 2**63
            table = self._tables[key] = NoiseTable(base, size, seed, like.dtype, like.device)
        return table

    @property
    def nbytes(self) -> int:
        """Bytes of the noise tables and of the kept first draws of antithetic pairs."""
        tables = sum(t.table.nbytes for t in self._tables.values())
        return tables + sum(k.nbytes for k in self._kept.values())

    def start_sample(self, train: bool) -> None:
        """Open one sample: a training sample is the first or the second of a pair; any other
        is drawn from the prediction generators."""
        self._train = train
        self._reflect = train and self._reflect_next
        self._keep = train and self.antithetic and not self._reflect
        if train and self.antithetic:
            self._reflect_next = not self._reflect

    def end_step(self) -> None:
        """The next training sample opens a new antithetic pair."""
        self._reflect_next = False

    def sample(
        self, outs: list[Tensor], base: Distribution, keys: list[Tensor], index: int
    ) -> list[Tensor]:
        """This sample's ξ for param group ``index`` (``keys``: its parameters), one tensor
        of each ``outs`` shape: a read-only window of the noise table (no copy), or ``outs``
        filled with fresh draws or, for the second of an antithetic pair, 2c − ξ."""
        if not outs:
            return []
        if self._reflect:
            torch._foreach_copy_(outs, [self._kept[k] for k in keys])
            torch._foreach_mul_(outs, -1.0)
            centre = symmetric_centre(base)
            if centre:
                torch._foreach_add_(outs, 2 * centre)
            return outs
        sharded, predict = any(isinstance(k, SHARDED) for k in keys), not self._train
        if self.kind == "table":
            largest = 2 * max(k.numel() for k in keys)  # 2: signed parts
            cpu = self.generator(_CPU, predict=predict)
            offsets = torch.randint(0, 2**62, (len(outs),), generator=cpu)
            xis = [
                self.table(base, index, out, largest).window(out.numel(), offset).view(out.shape)
                if not sharded
                else self._shard_window(self.table(base, index, out, largest), out, k, offset)
                for out, k, offset in zip(outs, keys, offsets.tolist(), strict=True)
            ]
        elif not sharded and len(devices := {out.device for out in outs}) == 1:
            device = devices.pop()
            gen = (self._predict if predict else self._generators).get((device, ""))
            xis = sample_each(base, outs, gen or self.generator(device, predict=predict))
        else:
            xis = [
                sample_into(base, out, self.generator(out.device, shard_name(k), predict=predict))
                for out, k in zip(outs, keys, strict=True)
            ]
        if self._keep:
            for k, xi in zip(keys, xis, strict=True):
                first = self._kept.get(k)
                if first is None or first.shape != xi.shape or first.dtype != xi.dtype:
                    first = self._kept[k] = torch.empty_like(xi)
                first.copy_(xi)
        return xis

    def make_generators(self, keys: list[Tensor]) -> None:
        """Make now every generator draws for the parameters ``keys`` will use, so that a
        state dict lists them all (DCP loads only the entries of the state dict it is
        given)."""
        for predict in (False, True):
            if self.kind == "table":
                self.generator(_CPU, predict=predict)
                continue
            for key in keys:
                self.generator(key.device, shard_name(key), predict=predict)

    @staticmethod
    def _shard_window(table: NoiseTable, out: Tensor, key: Tensor, offset: int) -> Tensor:
        """The sharded parameter ``key``'s part of the window at ``offset`` for the whole
        parameter, copied into ``out`` (its local shard's shape)."""
        shape = (*out.shape[: out.dim() - key.dim()], *key.shape)
        whole = table.window(torch.Size(shape).numel(), offset).view(shape)
        return out.copy_(shard_of(whole, key))

    def state_dict(self) -> dict[str, Any]:
        """Seed and the states of the training (``"rng"``) and prediction (``"predict_rng"``)
        generators (tables are rebuilt from the seed)."""
        return {
            "seed": self.seed,
            "rng": _states(self._generators),
            "predict_rng": _states(self._predict),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; tables and pairing start afresh, and prediction
        generators missing from ``state`` (a state saved before they existed) start from the
        seed."""
        self.seed = int(state.get("seed", self.seed))
        self._generators.clear()
        self._predict.clear()
        self._tables.clear()
        self._kept.clear()
        self._reflect_next = False
        for key, predict in (("rng", False), ("predict_rng", True)):
            for name, gen_state in state.get(key, {}).items():
                device, _, shard = name.partition("/")
                gen = self.generator(torch.device(device), shard and f"/{shard}", predict=predict)
                gen.set_state(gen_state)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tables"] = {}  # deterministic in the seed: rebuilt, not copied
        return state


def _states(generators: dict[tuple[torch.device, str], torch.Generator]) -> dict[str, Tensor]:
    """Each generator's state, by ``"<device><shard>"``."""
    return {f"{device}{shard}": gen.get_state() for (device, shard), gen in generators.items()}


def shard_name(key: Tensor) -> str:
    """The generator name of a sharded parameter's shard: ``"/shard"`` and its coordinates on
    the device-mesh dimensions it is sharded along (ranks holding replicas of one shard draw
    alike); ``""`` for any other tensor."""
    if not isinstance(key, SHARDED):
        return ""
    coordinate = key.device_mesh.get_coordinate() or []
    dims = [d for d, q in enumerate(key.placements) if q.is_shard()]
    return "/shard" + ",".join(str(coordinate[d]) for d in dims)
