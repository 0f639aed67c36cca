"""The Lie-group Bayesian learning rule for any group, and the machinery every rule shares."""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributions import Distribution
from torch.optim import Optimizer

from ..distributions import check_base, sample_into
from ..fisher import algebra_gradient, entropy_gradient, fisher_closed_form, fisher_monte_carlo
from ..groups import LieGroup
from ..noise import NOISE_SOURCES, NoiseTable, symmetric_centre

__all__ = ["LieGroupBLR"]

Preconditioner = str | Sequence[float] | Tensor | Callable[[Tensor], Tensor] | None
_POINT_ESTIMATES = ("g", "mean")
_CPU = torch.device("cpu")


def state_dtype(p: Tensor) -> torch.dtype:
    """Group state is kept in float32 for half-precision parameters, else in their dtype."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one host sync)."""
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    return not extremes or bool(torch.stack(extremes).isfinite().all())


def _shared_seed(seed: int | None, process_group: Any) -> int:
    """The given seed, or one drawn from torch's global RNG; rank 0's across a group."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    if process_group is None:
        return int(seed)
    box = [int(seed)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
    return box[0]


def _number(hp: dict[str, Any], key: str, low: float, high: float = math.inf, *, closed=True):
    """Check low ≤ hp[key] < high (low < ... when not closed); ValueError naming ``key``."""
    value = hp[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    ok = (low <= value if closed else low < value) and value < high
    if not ok or math.isnan(value):
        lo = "[" if closed else "("
        raise ValueError(f"{key}: must lie in {lo}{low}, {high}), got {value}")


class LieGroupBLR(Optimizer):
    r"""The Lie-group Bayesian learning rule for any :class:`~liegroup_blr.groups.LieGroup`.

    Each parameter θ is the readout of :math:`g \cdot \xi`, :math:`\xi \sim q_0` (``base``),
    with its own group element :math:`g`. One step lowers the variational objective
    :math:`E_q[\bar\ell(\theta)] + \frac{\delta}{N} E_q[\tfrac12\|\theta\|^2]
    - \frac{\tau}{N} H(q)`:

    .. math::
        \hat X &= \frac1S \sum_{s=1}^S \nabla_X\, \bar\ell_\delta(\theta_s(X))\big|_{X=0}
                 - \frac{\tau}{N} \nabla_X \log|\det J_{g \exp X}|\big|_{X=0},
        \quad \bar\ell_\delta = \bar\ell + \tfrac{\delta}{2N}\|\theta\|^2, \\
        M &\leftarrow \beta M + (1-\beta)\, P(\hat X), \qquad
        g \leftarrow g \cdot \exp(-\alpha M),

    with :math:`S` = ``mc_samples`` draws :math:`\theta_s(X) = \operatorname{readout}((g
    \exp X) \cdot \xi_s)`; the algebra gradients come from ``torch.func.vjp`` through the
    group's ``exp``, ``compose``, ``act`` (reparameterisation), the entropy gradient from
    ``torch.func.grad`` of ``log_abs_det``. :math:`P` is the preconditioner: identity (the
    built-in rules fold the constant Fisher metric into α), per-component step factors, the
    inverse Fisher metric at the identity, or any callable.

    Outside :meth:`sampled_params` every parameter holds the point estimate
    ``readout(g · ξ₀)`` (ξ₀ = ``group.reference_point``, or E[ξ] with ``point_estimate="mean"``).

    Args:
        params: parameters or param groups (each group may set its own ``lr``, ``momentum``,
            ``base``, ``data_size``, ``temperature``, ``prior_precision``).
        group: the Lie group.
        base: scalar base distribution q0, drawn i.i.d. per coordinate.
        lr: step size α > 0.
        momentum: β ∈ [0, 1), EMA of the algebra gradient.
        data_size: N > 0; required when ``prior_precision`` > 0 or the entropy term is used.
        temperature: τ ≥ 0.
        prior_precision: δ ≥ 0 of the Gaussian prior N(0, I/δ).
        mc_samples: S ≥ 1 samples per :meth:`step` with a closure.
        preconditioner: ``None``, a sequence of per-component factors (one per leading algebra
            component), ``"fisher"`` (inverse Fisher block at the identity, for groups acting
            coordinatewise) or a callable ``X -> P(X)``.
        init: callable ``θ -> g`` giving each parameter's initial element
            (default ``group.from_point``).
        **options: optimizer-level options, keyword-only, shared by every rule:

            * ``point_estimate`` — ``"g"`` (default) or ``"mean"``.
            * ``seed`` — seed of the optimizer's own noise generator; drawn from torch's global
              RNG when ``None``, so ``torch.manual_seed`` makes runs reproducible.
            * ``noise`` — ``"fresh"`` (default) draws ξ from the base at every sample;
              ``"table"`` reads it from a :class:`~liegroup_blr.noise.NoiseTable` at random
              offsets, far cheaper on a CPU.
            * ``antithetic`` — pair each training sample ξ with its reflection 2c − ξ (bases
              symmetric about c): consecutive samples of a step form pairs, half the draws. A
              pair cancels the part of the gradient integrand that is odd in ξ − c (on a
              quadratic loss the location gradients become exact); even parts are not reduced.
            * ``table_size`` — values in each noise table (default max(2²⁴, 4 × the largest
              parameter)).
            * ``compile`` — run the update arithmetic as two ``torch.compile`` graphs (the
              proposal of the new momenta, then the move of the elements) with no graph
              breaks; the learning rate enters as a tensor, so schedules don't recompile.
            * ``process_group`` — a ``torch.distributed`` process group (e.g.
              ``torch.distributed.group.WORLD``) to train over: every process draws its own
              noise, the algebra-gradient accumulators and sample counts are summed across
              processes before the update (not ``p.grad``: the algebra gradients are
              nonlinear in each process's noise), so the group state stays identical
              everywhere. Do not wrap the model in DistributedDataParallel.

    Raises:
        ValueError: naming the argument, for any invalid hyperparameter.
    """

    lie_group: LieGroup
    _sample_buffers: tuple[str, ...] = ("xi",)
    """Scratch buffers a draw fills and the following accumulation reads."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        group: LieGroup,
        base: Distribution,
        lr: float,
        momentum: float = 0.9,
        data_size: float | None = None,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        *,
        preconditioner: Preconditioner = None,
        init: Callable[[Tensor], Tensor] | None = None,
        **options: Any,
    ) -> None:
        self._init_fn = init
        self._preconditioner = self._make_preconditioner(preconditioner)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
        )
        self._construct(params, group, defaults, mc_samples, **options)

    # ------------------------------------------------------------------ setup
    def _construct(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        group: LieGroup,
        defaults: dict[str, Any],
        mc_samples: int,
        *,
        point_estimate: str = "g",
        seed: int | None = None,
        noise: str = "fresh",
        antithetic: bool = False,
        table_size: int | None = None,
        compile: bool = False,
        process_group: Any = None,
    ) -> None:
        """Validate the optimizer-level options (documented on :class:`LieGroupBLR`), then
        build the param groups and their state."""
        if not isinstance(group, LieGroup):
            raise ValueError(f"group: expected a liegroup_blr.groups.LieGroup, got {group!r}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"mc_samples: must be an integer ≥ 1, got {mc_samples!r}")
        if point_estimate not in _POINT_ESTIMATES:
            raise ValueError(f"point_estimate: must be one of {_POINT_ESTIMATES}")
        if noise not in NOISE_SOURCES:
            raise ValueError(f"noise: must be one of {NOISE_SOURCES}, got {noise!r}")
        if table_size is not None and (isinstance(table_size, bool) or table_size < 1):
            raise ValueError(f"table_size: must be a positive integer, got {table_size!r}")
        self.lie_group = group
        self.mc_samples = mc_samples
        self.point_estimate = point_estimate
        self.noise = noise
        self.antithetic = bool(antithetic)
        self.table_size = table_size
        self.process_group = process_group
        self._rank = 0 if process_group is None else dist.get_rank(process_group)
        self.seed = _shared_seed(seed, process_group)
        self.skipped_steps = 0
        self._tables: dict[tuple[int, torch.device, torch.dtype], NoiseTable] = {}
        self._reflect_next = False  # the next training draw reflects the previous one
        self._reflect = self._keep = False  # this draw reflects / is kept for reflection
        self._generators: dict[torch.device, torch.Generator] = {}
        self._scratch: dict[Tensor, dict[str, Tensor]] = {}
        self._accumulated: dict[Tensor, None] = {}
        self._num_samples = 0
        self._sampling = False
        self._fisher_blocks: dict[int, Tensor] = {}
        self.compile = bool(compile)
        if self.compile:  # one graph each; lr enters as a tensor, so schedules don't recompile
            self._propose = torch.compile(self._fused_propose, fullgraph=True)  # type: ignore[method-assign]
            self._commit = torch.compile(self._fused_commit, fullgraph=True)  # type: ignore[method-assign]
        super().__init__(params, defaults)
        if process_group is not None:
            self._broadcast_state()

    def _check_hyperparameters(self, hp: dict[str, Any]) -> None:
        """Raise ValueError naming the first invalid hyperparameter of a param group."""
        _number(hp, "lr", 0.0, closed=False)
        _number(hp, "momentum", 0.0, 1.0)
        _number(hp, "temperature", 0.0)
        _number(hp, "prior_precision", 0.0)
        if hp["data_size"] is not None:
            _number(hp, "data_size", 0.0, closed=False)
        elif hp["prior_precision"] > 0 or (
            hp["temperature"] > 0 and not self.lie_group.constant_entropy
        ):
            raise ValueError(
                "data_size: the number of training examples N is required when "
                "prior_precision > 0 or temperature > 0 (the objective scales them by 1/N)"
            )
        check_base(hp["base"], self.lie_group.positive_base)
        if self.antithetic and symmetric_centre(hp["base"]) is None:
            raise ValueError(
                "antithetic: needs a base symmetric about its centre (Normal, Laplace, "
                f"Uniform, StudentT, Cauchy, Dirac), got {type(hp['base']).__name__}"
            )
        if self.point_estimate == "mean" and not math.isfinite(float(hp["base"].mean)):
            raise ValueError("point_estimate: 'mean' needs a base with a finite mean")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validate its hyperparameters and initialise its state."""
        options = {k: v for k, v in param_group.items() if k != "params"}
        self._check_hyperparameters({**self.defaults, **options})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if not p.is_floating_point():
                self.param_groups.pop()
                raise ValueError(f"params: only floating-point parameters, got {p.dtype}")
        with torch.no_grad():
            params = self._active(group)
            for p in params:
                self._init_state(p, group)
            self._write_point(group, params)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        theta = p.detach().to(state_dtype(p))
        element = self._init_fn(theta) if self._init_fn else self.lie_group.from_point(theta)
        element = element.to(theta)
        if element.shape != self.lie_group.element_shape(p.shape):
            raise ValueError(f"init: element shape {tuple(element.shape)} does not fit {p.shape}")
        self.state[p] = {
            "element": element,
            "momentum": theta.new_zeros(self.lie_group.algebra_shape(p.shape)),
        }

    @staticmethod
    def _active(group: dict[str, Any]) -> list[Tensor]:
        return [p for p in group["params"] if p.requires_grad]

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed ^ zlib.crc32(f"{device}:{self._rank}".encode()))
            self._generators[device] = gen
        return gen

    def _buffer(self, p: Tensor, key: str, shape: torch.Size) -> Tensor:
        """A reusable scratch tensor of ``shape`` in ``p``'s state dtype (allocating large
        tensors on every step costs page faults: scratch is kept and reused)."""
        scratch = self._scratch.setdefault(p, {})
        buf = scratch.get(key)
        if buf is None or buf.shape != shape:
            buf = scratch[key] = torch.empty(shape, dtype=state_dtype(p), device=p.device)
        return buf

    def _rename(self, params: list[Tensor], old: str, new: str) -> None:
        """Scratch buffer ``old`` becomes ``new``; the previous ``new`` is reused as ``old``."""
        for p in params:
            scratch = self._scratch[p]
            scratch[new], previous = scratch[old], scratch.get(new)
            if previous is None or previous.shape != scratch[new].shape:
                del scratch[old]
            else:
                scratch[old] = previous

    def _loss_gradients(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        """∇ℓ̄ + (δ/N)θ at the current sample (just ``p.grad`` when δ = 0)."""
        grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]
        if not group["prior_precision"]:
            return grads
        total = [self._buffer(p, "grad", p.shape) for p in params]
        torch._foreach_copy_(total, grads)
        torch._foreach_add_(total, params, alpha=group["prior_precision"] / group["data_size"])
        return total

    # ------------------------------------------------------------ public API
    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold one posterior sample θ = readout(g·ξ) in the parameters for the block.

        With ``train=True`` the gradients the block leaves in ``p.grad`` are accumulated as one
        Monte-Carlo sample of the next :meth:`step` (call ``zero_grad`` inside each block). On
        exit, also on error, the parameters return to the point estimate.
        """
        if self._sampling:
            raise RuntimeError("sampled_params blocks cannot be nested")
        self._sampling = True
        try:
            with torch.no_grad():
                self._draw_all(train)
            yield
            if train:
                with torch.no_grad():
                    self._accumulate_all()
        finally:
            self._sampling = False
            with torch.no_grad():
                self._write_point_all()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group element.

        Args:
            closure: zeroes the gradients, evaluates the loss ℓ̄, calls ``backward`` and
                returns the loss; called ``mc_samples`` times, each at a fresh sample θ.
                Without a closure, the samples accumulated by ``sampled_params(train=True)``
                blocks since the last step are used.

        Returns:
            the mean closure loss over samples (``None`` without a closure).

        A non-finite loss or algebra gradient skips the update with a ``RuntimeWarning``:
        group elements and momenta are left exactly as they were (``skipped_steps`` counts).
        """
        if self._sampling:
            raise RuntimeError("step() cannot be called inside sampled_params()")
        loss = None
        if closure is not None:
            losses = []
            for _ in range(self.mc_samples):
                self._draw_all(train=True)
                try:
                    with torch.enable_grad():
                        value = closure()
                except BaseException:
                    self._reset_samples()
                    self._write_point_all()
                    raise
                self._accumulate_all()
                losses.append(value.detach() if isinstance(value, Tensor) else value)
            loss = sum(losses) / len(losses)
        elif self._num_samples == 0:
            raise RuntimeError(
                "step() without a closure needs gradients from at least one "
                "`with optimizer.sampled_params(train=True):` block"
            )
        self._update(loss is None or bool(torch.isfinite(torch.as_tensor(loss)).all()))
        return loss

    def group_element(self, p: Tensor) -> dict[str, Tensor]:
        """Named components of ``p``'s current group element (detached copies):
        ``{'m'}`` additive, ``{'g+', 'g-'}`` multiplicative, ``{'A', 'b'}`` affine,
        ``{'g'}`` for groups without named parts."""
        parts = self.lie_group.parts(self.state[p]["element"])
        return {k: v.detach().clone() for k, v in parts.items()}

    @torch.no_grad()
    def set_group_element(self, p: Tensor, element: Tensor) -> None:
        """Replace ``p``'s group element (shape ``group.element_shape(p.shape)``) and write the
        new point estimate into ``p``; momentum is kept."""
        state = self.state[p]
        if element.shape != state["element"].shape:
            raise ValueError(f"element: expected shape {tuple(state['element'].shape)}")
        ok, reason = self.lie_group.check_element(element)
        if not ok:
            raise ValueError(f"element: {reason}")
        state["element"].copy_(element)
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                self._write_point(group, [p])

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, plus the noise generators' states and the skip count.

        Base distributions belong to the construction, like the parameters: they are left out
        (so the dict loads with ``torch.load(weights_only=True)``) and
        :meth:`load_state_dict` keeps those the optimizer was built with.
        """
        if self._sampling or self._num_samples:
            raise RuntimeError("state_dict() between sampled_params(train=True) and step()")
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group.pop("base", None)
        sd["rng"] = {str(d): g.get_state() for d, g in self._generators.items()}
        sd["seed"] = self.seed
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: states, hyperparameters, noise generators; the
        parameters then hold the loaded point estimate."""
        state_dict = dict(state_dict)
        rng = state_dict.pop("rng", {})
        self.seed = int(state_dict.pop("seed", self.seed))
        self.skipped_steps = int(state_dict.pop("skipped_steps", 0))
        bases = [group["base"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params, strict=True):
            if i in saved:  # undo Optimizer's cast of state to the parameter dtype
                self.state[p] = {
                    k: v.to(device=p.device, dtype=state_dtype(p)) for k, v in saved[i].items()
                }
        for group, base in zip(self.param_groups, bases, strict=True):
            group["base"] = base
        self._generators.clear()
        for device, gen_state in rng.items():
            self._generator(torch.device(device)).set_state(gen_state)
        self._scratch.clear()
        self._tables.clear()  # rebuilt from the loaded seed
        with torch.no_grad():
            self._write_point_all()

    # -------------------------------------------------------- the MC loop
    def _draw_all(self, train: bool) -> None:
        self._reflect = train and self._reflect_next
        self._keep = train and self.antithetic and not self._reflect
        for group in self.param_groups:
            params = self._active(group)
            if params:
                self._draw(group, params, train)
        if train and self.antithetic:
            self._reflect_next = not self._reflect

    def _accumulate_all(self) -> None:
        for group in self.param_groups:
            with_grad = [p for p in self._active(group) if p.grad is not None]
            first = [p for p in with_grad if p not in self._accumulated]
            rest = [p for p in with_grad if p in self._accumulated]
            if first:
                self._accumulate(group, first, True)
            if rest:
                self._accumulate(group, rest, False)
            self._accumulated.update(dict.fromkeys(first))
        self._num_samples += 1

    def _reset_samples(self) -> None:
        self._accumulated.clear()
        self._num_samples = 0
        self._reflect_next = False

    def _write_point_all(self) -> None:
        for group in self.param_groups:
            params = self._active(group)
            if params:
                self._write_point(group, params)

    def _update(self, loss_finite: bool) -> None:
        n = self._num_samples
        work = [
            (
                self._hyperparameters(group),
                [p for p in self._active(group) if p in self._accumulated],
            )
            for group in self.param_groups
        ]
        work = [(group, params) for group, params in work if params]
        if self.process_group is not None:
            n, loss_finite = self._all_reduce(work, n, loss_finite)
        proposals: list[Tensor] = []
        if loss_finite:
            for group, params in work:
                proposals += self._propose(group, params, n)
        moved: set[Tensor] = set()
        if loss_finite and all_finite(proposals):
            for group, params in work:
                self._commit(group, params)
                moved.update(params)
        elif work:
            self.skipped_steps += 1
            warnings.warn(
                f"{type(self).__name__}: non-finite loss or gradient; step skipped, "
                "optimizer state unchanged",
                RuntimeWarning,
                stacklevel=3,
            )
        self._reset_samples()
        for group in self.param_groups:  # the rest still hold a sample
            rest = [p for p in self._active(group) if p not in moved]
            if rest:
                self._write_point(group, rest)

    def _hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group as the update sees it: under ``compile`` its lr is a 0-d tensor."""
        if not self.compile:
            return group
        device = group["params"][0].device
        return {**group, "lr": torch.tensor(float(group["lr"]), device=device)}

    # ------------------------------------------------------------- distribution
    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Give every process rank 0's initial elements (and parameters)."""
        src = dist.get_global_rank(self.process_group, 0)
        for group in self.param_groups:
            params = self._active(group)
            for p in params:
                dist.broadcast(self.state[p]["element"], src=src, group=self.process_group)
            if params:
                self._write_point(group, params)

    def _all_reduce(
        self, work: list[tuple[dict[str, Any], list[Tensor]]], n: int, loss_finite: bool
    ) -> tuple[int, bool]:
        """Sum the algebra-gradient accumulators, sample counts and non-finite flags over the
        process group, in one flat buffer per (device, dtype)."""
        accumulators = [t for group, params in work for t in self._accumulators(params)]
        device = accumulators[0].device if accumulators else _CPU
        if dist.get_backend(self.process_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        counts = torch.tensor([float(n), float(not loss_finite)], device=device)
        dist.all_reduce(counts, group=self.process_group)
        buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in accumulators:
            buckets.setdefault((t.device, t.dtype), []).append(t)
        for bucket in buckets.values():
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.process_group)
            for t, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                t.copy_(summed)
        total, bad = counts.tolist()
        return int(total), bad == 0

    # ------------------------------------------------------------ the noise
    def _noise_into(self, group: dict[str, Any], params: list[Tensor], out: list[Tensor]) -> None:
        """Fill ``out[i]`` with this draw's base noise ξ for ``params[i]``: fresh, from the
        noise table, or (second sample of an antithetic pair) the reflection 2c − ξ."""
        pairs = zip(params, out, strict=True)
        kept = [self._buffer(p, "antithetic", o.shape) for p, o in pairs] if self.antithetic else []
        if self._reflect:
            torch._foreach_copy_(out, kept)
            torch._foreach_mul_(out, -1.0)
            centre = symmetric_centre(group["base"])
            if centre:
                torch._foreach_add_(out, 2 * centre)
            return
        if self.noise == "table":
            offsets = torch.randint(0, 2**62, (len(out),), generator=self._generator(_CPU))
            for p, buf, offset in zip(params, out, offsets.tolist(), strict=True):
                self._table(group, p).fill_(buf, offset)
        else:
            for p, buf in zip(params, out, strict=True):
                sample_into(group["base"], buf, self._generator(p.device))
        if self._keep:
            torch._foreach_copy_(kept, out)

    def _table(self, group: dict[str, Any], p: Tensor) -> NoiseTable:
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        key = (index, p.device, state_dtype(p))
        table = self._tables.get(key)
        if table is None:
            largest = max(q.numel() * 2 for q in group["params"])  # 2: signed parts
            size = self.table_size or max(2**24, 4 * largest)
            seed = (self.seed + 7919 * (index + 1) + 104729 * self._rank) % 2**63
            table = NoiseTable(group["base"], size, seed, state_dtype(p), p.device)
            self._tables[key] = table
        return table

    # ---------------------------------------------- hooks (generic versions)
    # _draw writes a sample into the parameters; _accumulate adds one sample's algebra
    # gradient to scratch "acc"; _propose turns "acc" into the new momentum (still scratch)
    # and returns tensors that must be finite; _commit makes it the momentum, moves the
    # elements and writes the new point estimates into the parameters.
    def _draw(self, group: dict[str, Any], params: list[Tensor], train: bool) -> None:
        G = self.lie_group
        for p in params:
            xi = self._buffer(p, "xi", G.base_shape(p.shape))
            self._noise_into(group, [p], [xi])
            p.copy_(G.readout(G.act(self.state[p]["element"], xi)))

    def _accumulate(self, group: dict[str, Any], params: list[Tensor], first: bool) -> None:
        decay = group["prior_precision"] / group["data_size"] if group["prior_precision"] else 0
        for p in params:
            scratch = self._scratch[p]
            grad = p.grad.to(state_dtype(p))  # type: ignore[union-attr]
            if decay:
                grad = grad.add(p.to(grad.dtype), alpha=decay)
            X = algebra_gradient(self.lie_group, self.state[p]["element"], scratch["xi"], grad)
            if first:
                scratch["acc"] = X
            else:
                scratch["acc"].add_(X)

    def _accumulators(self, params: list[Tensor]) -> list[Tensor]:
        """The tensors that sum the samples' algebra gradients (all-reduced across processes)."""
        return [self._scratch[p]["acc"] for p in params]

    def _propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        G = self.lie_group
        entropy_weight = 0.0 if G.constant_entropy else group["temperature"]
        if entropy_weight:
            entropy_weight /= group["data_size"]
        out = []
        for p in params:
            state, scratch = self.state[p], self._scratch[p]
            X = scratch["acc"].div_(n)
            if entropy_weight:
                X.sub_(entropy_gradient(G, state["element"]), alpha=entropy_weight)
            X = self._preconditioner(X, group)
            scratch["acc"] = X.lerp_(state["momentum"], group["momentum"])
            out.append(scratch["acc"])
        return out

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        G = self.lie_group
        for p in params:
            state, scratch = self.state[p], self._scratch[p]
            state["momentum"], scratch["acc"] = scratch["acc"], state["momentum"]
            state["element"] = G.step(state["element"], state["momentum"] * -group["lr"])
        self._write_point(group, params)

    # Under ``compile=True`` the update runs these per-tensor formulations through
    # torch.compile, which fuses each parameter's arithmetic into one kernel (a compiled
    # foreach chain is not fused on the CPU); eager steps run the foreach hooks above.
    def _fused_propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        return self._propose(group, params, n)

    def _fused_commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        self._commit(group, params)

    def _mean(self, group: dict[str, Any]) -> float:
        """E[ξ] under ``point_estimate="mean"``, else 0 (the built-in rules read ξ₀ = 0 or 1)."""
        return float(group["base"].mean) if self.point_estimate == "mean" else 0.0

    def _reference(self, group: dict[str, Any], p: Tensor) -> Tensor:
        """ξ₀ at which the point estimate is read."""
        dtype = state_dtype(p)
        if self.point_estimate == "mean":
            shape = self.lie_group.base_shape(p.shape)
            return torch.full(shape, float(group["base"].mean), dtype=dtype, device=p.device)
        return self.lie_group.reference_point(p.shape, dtype=dtype, device=p.device)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        for p in params:
            element = self.state[p]["element"]
            p.copy_(self.lie_group.point_estimate(element, self._reference(group, p)))

    # ------------------------------------------------------ preconditioning
    def _make_preconditioner(
        self, spec: Preconditioner
    ) -> Callable[[Tensor, dict[str, Any]], Tensor]:
        if spec is None:
            return lambda X, group: X
        if callable(spec):
            return lambda X, group: spec(X)
        if isinstance(spec, str):
            if spec != "fisher":
                raise ValueError(f"preconditioner: unknown {spec!r}; use None, 'fisher', ...")
            return self._inverse_fisher
        factors = torch.as_tensor(spec, dtype=torch.float64)
        if factors.ndim != 1 or not bool((factors > 0).all()):
            raise ValueError("preconditioner: per-component factors must be a 1-d positive list")

        def scale(X: Tensor, group: dict[str, Any]) -> Tensor:
            if len(factors) == 1:
                return X.mul_(float(factors[0]))
            if X.shape[0] != len(factors):
                raise ValueError(
                    f"preconditioner: {len(factors)} factors for {X.shape[0]} algebra components"
                )
            return X.mul_(factors.to(X).view(-1, *([1] * (X.ndim - 1))))

        return scale

    def _inverse_fisher(self, X: Tensor, group: dict[str, Any]) -> Tensor:
        """X ← F⁻¹X with F the per-coordinate Fisher block at the identity."""
        G, base = self.lie_group, group["base"]
        block = self._fisher_blocks.get(id(base))
        if block is None:
            block = fisher_closed_form(G, base)
            if block is None:
                block = fisher_monte_carlo(G, base, generator=self._generator(torch.device("cpu")))
            self._fisher_blocks[id(base)] = block
        c = block.shape[0]
        flat = X.reshape(c, -1)
        return torch.linalg.solve(block.to(X), flat).reshape(X.shape)
