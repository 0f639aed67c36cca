"""Optimizers and learning-rate schedules from the ``[optimizer]`` and ``[schedule]`` tables."""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ivon
import torch
from torch import nn

import liegroup_blr as lgb
from experiments.common import distributed
from experiments.common.schema import NAME, NUMBER, Unset
from liegroup_blr.distributions import from_name

Params = Iterable[nn.Parameter]
Optimizer = torch.optim.Optimizer

GROUPS: dict[str, str] = {
    "additive": "AdditiveGroup",
    "multiplicative": "MultiplicativeGroup",
    "affine": "DiagonalAffineGroup",
    "full_affine": "FullAffineGroup",
    "rotation_scaling": "RotationScalingGroup",
}
"""Built-in group names for ``name = "lie"``; any ``"package.module:ClassName"`` works too."""


def _import(spec: str, what: str) -> Any:
    """The object named by ``"package.module:attribute"``."""
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import {what} {spec!r}: {err}") from None


def _check_options(cls: type, options: dict[str, Any]) -> None:
    """Every key of ``options`` must be a keyword of ``cls.__init__`` (unless it takes
    ``**kwargs``): a misspelt key is an error, not a silently ignored option."""
    params = inspect.signature(cls).parameters  # the constructor's, without self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = sorted(
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"group_options: unknown key(s) {unknown} for {cls.__name__}; valid keys: {valid}"
        )


def build_group(spec: str, options: dict[str, Any]) -> lgb.groups.LieGroup:
    """A :class:`~liegroup_blr.groups.LieGroup` from a built-in name or an import path, with
    ``options`` checked against its constructor's keywords."""
    if spec in GROUPS:
        cls = getattr(lgb.groups, GROUPS[spec])
    elif ":" in spec:
        cls = _import(spec, "group")
    else:
        raise ValueError(
            f"unknown group {spec!r}; valid: {sorted(GROUPS)} or 'package.module:ClassName'"
        )
    if not (isinstance(cls, type) and issubclass(cls, lgb.groups.LieGroup)):
        raise ValueError(f"group {spec!r} is not a subclass of liegroup_blr.groups.LieGroup")
    _check_options(cls, options)
    return cls(**options)


def build_preconditioner(spec: Any, group: lgb.groups.LieGroup) -> Any:
    """The ``preconditioner`` of :class:`~liegroup_blr.LieGroupBLR` from a config value.

    ``None`` or ``"fisher"`` pass through; ``"package.module:callable"`` is imported and must
    be callable; a list of positive factors is one per algebra component; a table
    ``{component = factor}`` names the group's :attr:`~liegroup_blr.groups.LieGroup.components`
    (unnamed ones get 1) and becomes that list.
    """
    if spec is None or spec == "fisher":
        return spec
    if isinstance(spec, str):
        if ":" not in spec:
            raise ValueError(
                f"preconditioner: unknown {spec!r}; valid: 'fisher', a list of factors, a table "
                "of factors by component, or 'package.module:callable'"
            )
        fn = _import(spec, "preconditioner")
        if not callable(fn):
            raise ValueError(f"preconditioner {spec!r} is not callable")
        return fn
    if isinstance(spec, dict):
        names = group.components
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(
                f"preconditioner: unknown component(s) {unknown} of {type(group).__name__}; "
                f"its components: {list(names)}"
            )
        spec = [spec.get(name, 1.0) for name in names]
    factors = list(spec) if isinstance(spec, (list, tuple)) else None
    if not factors or not all(
        isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors
    ):
        raise ValueError(f"preconditioner: factors must be positive numbers, got {spec!r}")
    return factors


class AveragedGradients(torch.optim.Optimizer):
    """A deterministic baseline under torchrun: after each evaluation of the closure its
    gradients are averaged over ``process_group`` (None: one process, or FSDP2, which averages
    them itself). The Lie-group rules sum their algebra-gradient accumulators over their
    ``process_group`` instead, so every optimizer of :func:`build_optimizer` steps on the same
    plain closure (:func:`experiments.common.loop.closure`)."""

    def __init__(self, *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def averaged(self, closure: Callable[[], Any] | None) -> Callable[[], Any] | None:
        """``closure`` followed by the mean of the gradients over the processes."""
        if closure is None or self.process_group is None:
            return closure

        def evaluate() -> Any:
            loss = closure()
            params = [p for group in self.param_groups for p in group["params"]]
            distributed.average_gradients(params, self.process_group)
            return loss

        return evaluate

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return super().step(self.averaged(closure))


class SGD(AveragedGradients, torch.optim.SGD):
    """:class:`torch.optim.SGD` that averages its gradients over ``process_group``."""


class Adam(AveragedGradients, torch.optim.Adam):
    """:class:`torch.optim.Adam` that averages its gradients over ``process_group``."""


class IVON(AveragedGradients, ivon.IVON):
    """:class:`ivon.IVON` stepped as the other optimizers are, whose ``state_dict`` also holds
    its step count t.

    ``step(closure)`` evaluates the closure at each of IVON's ``mc_samples`` posterior
    samples: each call runs inside ``sampled_params(train=True)``, which draws θ and collects
    its gradient (averaged over ``process_group`` before it is collected).

    IVON divides its momentum by the bias correction 1 − β₁ᵗ, and ``ivon.IVON`` keeps t in an
    attribute outside its state dict: a resumed run would restart at t = 0 and take a first
    step 1/(1 − β₁) times too large. With t in the state dict a resumed run continues exactly.
    """

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        averaged = self.averaged(closure)
        if averaged is None:
            return ivon.IVON.step(self)

        def sampled() -> Any:
            with self.sampled_params(train=True):
                return averaged()

        return ivon.IVON.step(self, sampled)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "current_step": self.current_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        step = state_dict.pop("current_step")
        super().load_state_dict(state_dict)
        self.current_step = int(step)


def build_optimizer(
    cfg: dict[str, Any],
    params: Iterable[nn.Parameter],
    data_size: float,
    process_group: Any = None,
) -> torch.optim.Optimizer:
    """The optimizer of a resolved ``[optimizer]`` table (:data:`OPTIMIZERS`); ``data_size``
    is N. Under torchrun every optimizer gets the ``process_group`` (the baselines average
    their gradients over it, :class:`AveragedGradients`), so each steps on a plain closure."""
    if cfg["name"] not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg['name']!r}")
    return OPTIMIZERS[cfg["name"]].build(cfg, params, data_size, process_group)


def _decay(cfg: dict[str, Any], data_size: float) -> float:
    """The prior as the baselines' and IVON's weight decay: δ/N."""
    return float(cfg["prior_precision"] / data_size)


def _sgd(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    """SGD with EMA momentum (dampening = β)."""
    beta = cfg["momentum"]
    decay = _decay(cfg, data_size)
    return SGD(
        params, cfg["lr"], momentum=beta, dampening=beta, weight_decay=decay, process_group=group
    )


def _adam(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    betas = tuple(cfg["betas"])
    decay = _decay(cfg, data_size)
    return Adam(params, cfg["lr"], betas=betas, weight_decay=decay, process_group=group)


def _ivon(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    """IVON, whose prior precision is ``weight_decay`` × ``ess`` (= δ with ``ess`` = N)."""
    clip = cfg["clip_radius"]
    return IVON(
        params,
        cfg["lr"],
        ess=data_size if cfg["ess"] is None else cfg["ess"],
        hess_init=cfg["hess_init"],
        beta1=cfg["beta1"],
        beta2=cfg["beta2"],
        weight_decay=_decay(cfg, data_size),
        mc_samples=cfg["mc_samples"],
        hess_approx=cfg["hess_approx"],
        clip_radius=math.inf if clip is None else clip,
        process_group=group,
    )


def _blr_options(cfg: dict[str, Any], data_size: float, group: Any) -> dict[str, Any]:
    """The keywords every Lie-group rule takes: it receives δ, τ and N itself."""
    return {
        "momentum": cfg["momentum"],
        "base": from_name(cfg["base"], scale=cfg["base_scale"], **cfg["base_options"]),
        "data_size": data_size,
        "temperature": cfg["temperature"],
        "prior_precision": cfg["prior_precision"],
        "mc_samples": cfg["mc_samples"],
        "point_estimate": cfg["point_estimate"],
        "noise": cfg["noise"],
        "antithetic": cfg["antithetic"],
        "compile": cfg["compile"],
        "process_group": group,
    }


def _additive(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    return lgb.AdditiveBLR(params, cfg["lr"], **_blr_options(cfg, data_size, group))


def _multiplicative(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    extra = {"init_offset": cfg["init_offset"], "init": cfg["init"], "signed": cfg["signed"]}
    common = _blr_options(cfg, data_size, group)
    return lgb.MultiplicativeBLR(params, cfg["lr"], **common, **extra)


def _affine(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    extra = {"scale_momentum": cfg["scale_momentum"], "init_scale": cfg["init_scale"]}
    common = _blr_options(cfg, data_size, group)
    return lgb.AffineBLR(params, cfg["lr"], cfg["scale_lr"], **common, **extra)


def _lie(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    lie_group = build_group(cfg["group"], cfg["group_options"])
    preconditioner = build_preconditioner(cfg["preconditioner"], lie_group)
    common = _blr_options(cfg, data_size, group)
    base = common.pop("base")
    return lgb.LieGroupBLR(
        params, lie_group, base, cfg["lr"], **common, preconditioner=preconditioner
    )


def _mean_field(cfg: dict[str, Any], params: Params, data_size: float, group: Any) -> Optimizer:
    """posteriors' ``vi.diag`` as :class:`experiments.common.meanfield.MeanFieldVI` (the peers'
    environment only; one process)."""
    try:
        from experiments.common.meanfield import MeanFieldVI
    except ImportError as err:
        raise ValueError(
            f"optimizer 'vi' needs the peers' environment ({err}); make it with the command "
            "in experiments/requirements-peers.txt"
        ) from None
    options = {k: cfg[k] for k in ("prior_precision", "init_log_sd", "mc_samples")}
    return MeanFieldVI(params, cfg["lr"], data_size, betas=tuple(cfg["betas"]), **options)


@dataclass(frozen=True)
class Kind:
    """An optimizer the drivers build by name: the keys of its ``[optimizer]`` table with
    their defaults (those of the library / torch.optim), its builder ``build(cfg, params,
    data_size, process_group)``, and its posterior: None (a point estimate: SGD, Adam),
    ``"sampled"`` (its own samples: IVON, mean-field VI) or ``"liegroup"`` (a
    :class:`liegroup_blr.Posterior`: the next task's prior, memories)."""

    keys: dict[str, Any]
    build: Callable[[dict[str, Any], Params, float, Any], Optimizer]
    posterior: str | None


_BLR = {
    "lr": NUMBER,
    "momentum": 0.9,
    "temperature": 1.0,
    "prior_precision": 0.0,
    "mc_samples": 1,
    "base_options": {},
    "point_estimate": "g",
    "noise": "fresh",
    "antithetic": False,
    "compile": False,
    "vectorize": False,
    "batch_split": 1,
}

OPTIMIZERS: dict[str, Kind] = {
    "sgd": Kind({"lr": NUMBER, "momentum": 0.9, "prior_precision": 0.0}, _sgd, None),
    "adam": Kind({"lr": NUMBER, "betas": [0.9, 0.999], "prior_precision": 0.0}, _adam, None),
    # IVON (Shen et al., 2024; the ivon-opt package): ess None = N, clip_radius None = none
    "ivon": Kind(
        {
            "lr": NUMBER,
            "ess": Unset(float),
            "hess_init": 1.0,
            "beta1": 0.9,
            "beta2": 0.99999,
            "prior_precision": 0.0,
            "mc_samples": 1,
            "hess_approx": "price",
            "clip_radius": Unset(float),
        },
        _ivon,
        "sampled",
    ),
    # mean-field VI from posteriors (experiments/common/meanfield.py): torchopt's Adam on (μ, log σ)
    "vi": Kind(
        {
            "lr": NUMBER,
            "betas": [0.9, 0.999],
            "prior_precision": 0.0,
            "init_log_sd": -3.0,
            "mc_samples": 1,
        },
        _mean_field,
        "sampled",
    ),
    "additive": Kind({**_BLR, "base": "gaussian", "base_scale": 1e-3}, _additive, "liegroup"),
    "multiplicative": Kind(
        {
            **_BLR,
            "base": "rayleigh",
            "base_scale": 1.0,
            "init_offset": 1e-5,
            "init": "auto",
            "signed": True,
        },
        _multiplicative,
        "liegroup",
    ),
    "affine": Kind(
        {
            **_BLR,
            "momentum": 0.8,
            "scale_lr": NUMBER,
            "scale_momentum": 0.999,
            "base": "gaussian",
            "base_scale": 0.005,
            "init_scale": 1.0,
        },
        _affine,
        "liegroup",
    ),
    "lie": Kind(
        {
            **_BLR,
            "group": NAME,
            "group_options": {},
            "preconditioner": None,
            "base": "gaussian",
            "base_scale": 1e-3,
        },
        _lie,
        "liegroup",
    ),
}
"""The optimizers by ``[optimizer] name``: the one registry of the drivers (config keys,
builder, posterior)."""


def lr_factor(epoch: int, epochs: int, warmup: int) -> float:
    """Learning-rate factor of ``epoch`` (0-based) out of ``epochs``, as in the reference.

    Linear warm-up (e+1)/w for the first w epochs, then a cosine ½(1 + cos(π(e−w)/(E−w))),
    which starts at 1 and stays above 0 in the last epoch.
    """
    if epoch < warmup:
        return (epoch + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup) / (epochs - warmup)))
