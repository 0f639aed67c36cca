"""Memory-map estimates checked against leave-one-out retraining run to convergence.

    python -m experiments.memory.converged CONFIG.toml [--out DIR] [--resume] [--seeds 0]

CONFIG is a run config (or a comparison config with ``[runs.LABEL]`` tables) of the affine
rule with a Gaussian base (:class:`liegroup_blr.AffineBLR`, a diagonal Gaussian posterior) or
the signed multiplicative rule with a prior (:class:`liegroup_blr.MultiplicativeBLR`,
δ > 0), with a ``[memory.converged]`` table (:data:`CONVERGED`). For every run and seed,
into ``DIR/LABEL/seedS``:

1. ``train/``: train the run (:func:`experiments.memory.maps.trained`);
2. ``estimates.pt``: the memory-map estimate of every training example (Jacobian form,
   :func:`liegroup_blr.memory_map`): of the change of its logits (Σₖ|vₖeₖ|) and of its
   probabilities (Σₖ|eₖλₖvₖ|);
3. ``retrain.jsonl``: deterministic leave-one-out retraining of ``examples`` random training
   examples to convergence (:data:`RETRAINERS`), and a control with nothing removed; one
   row per retraining, written as each finishes (``--resume`` skips the finished);
4. ``estimates_at_control.pt``: the same estimates under the converged control's posterior,
   the stationary point the memory-perturbation equation assumes;
5. ``influence.pt``: the change predicted from the exact Hessian of the objective at the
   control, and the approximations from it to the estimate's form
   (:mod:`experiments.memory.influence`);
6. ``converged.png`` (the objective settling, the estimate against the truth on log-log
   axes with the identity line and the floor), ``influence.png`` (each prediction against
   the truth) and ``summary.json``.

``DIR`` gets ``config.json`` (every resolved config and the ``[memory.converged]`` table),
``results.json`` and ``docs_summary.json`` (:func:`write_docs_summary`: what
``docs/results/NAME.json`` holds).

The retraining: the expectation over q in the rule's objective is replaced by ``samples``
draws of q0 fixed for the whole retraining, with the N of the full data set whatever is
removed, so the objective is deterministic (:class:`ShiftRetrainer`: the affine rule's in
its mean, the covariance held at the trained one; :class:`ScaleRetrainer`: the
multiplicative rule's in log g±). It is minimised by L-BFGS (strong Wolfe line search) in
float64 in chunks of ``chunk`` iterations until the relative change of the objective over a
chunk falls below ``rtol`` or ``max_iterations`` are done. The control (nothing removed)
starts from the trained posterior, each removal from the control's converged one: the truth
is the removal's retrained prediction minus the control's; the floor is the same retraining
with nothing removed (what the protocol moves by itself); the drift is the control's
prediction minus the trained one (what converging moves from the trained posterior).
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.memory.converged"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import copy
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call
from torch.nn.functional import cross_entropy

import liegroup_blr as lgb
from experiments.common import config as config_module
from experiments.common import runfiles, skeleton
from experiments.common.training import check_runs
from experiments.memory import influence as memory_influence
from experiments.memory import maps as memory_map
from experiments.memory.maps import metrics_on_test, trained
from experiments.memory.scores import train_inputs
from experiments.memory.stats import against, aggregate, median_ratio, spearman
from liegroup_blr.groups import DiagonalAffineGroup

CONVERGED: dict[str, Any] = {
    "samples": 4,
    "examples": 200,
    "chunk": 10,
    "rtol": 1e-10,
    "max_iterations": 600,
    "history": 50,
}
"""The ``[memory.converged]`` table with its defaults: ``samples`` fixed draws of q0 (even:
the affine rule's are antithetic pairs) for the expectation over q, ``examples`` random
training examples to retrain, L-BFGS in chunks of ``chunk`` iterations (``history`` pairs
kept) until the relative change of the objective over a chunk is below ``rtol`` or
``max_iterations`` are done."""

ESTIMATES, RETRAIN, SUMMARY = "estimates.pt", "retrain.jsonl", "summary.json"
ESTIMATES_AT_CONTROL, INFLUENCE = "estimates_at_control.pt", "influence.pt"
BASELINES = ("loss", "residual", "variance")
"""Rankings without the estimate, checked against the truth too."""
CONTROL_MEAN = "control_mean.pt"
DOCS_SUMMARY = "docs_summary.json"


def _check(table: dict[str, Any], configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    if table["samples"] < 2 or table["samples"] % 2:
        raise config_module.ConfigError(
            f"[memory.converged].samples must be even and >= 2, got {table['samples']}"
        )
    for key in ("examples", "chunk", "max_iterations", "history"):
        if table[key] < 1:
            raise config_module.ConfigError(
                f"[memory.converged].{key} must be >= 1, got {table[key]}"
            )
    if not 0 < table["rtol"] < 1:
        raise config_module.ConfigError(
            f"[memory.converged].rtol must lie in (0, 1), got {table['rtol']}"
        )
    for by_seed in configs.values():
        for cfg in by_seed.values():
            _check_optimizer(cfg["optimizer"])
            if cfg["data"]["augment"]:
                raise config_module.ConfigError("[data].augment must be false")


def _check_optimizer(opt: dict[str, Any]) -> None:
    """The rules this check can retrain (:data:`RETRAINERS`), each where its objective has a
    minimiser."""
    if opt["name"] == "affine" and opt.get("base", "gaussian") == "gaussian":
        return
    if opt["name"] == "multiplicative" and opt.get("signed", True):
        if not opt["prior_precision"] > 0:
            raise config_module.ConfigError(
                "[optimizer].prior_precision = 0: the multiplicative objective then has no "
                "minimiser (the entropy −τ/N Σ log g falls without bound as g grows); set "
                "prior_precision > 0"
            )
        return
    raise config_module.ConfigError(
        f"[optimizer] {opt['name']!r}: this check retrains name = 'affine' with base = "
        "'gaussian' (the mean) or name = 'multiplicative' with signed = true (log g±)"
    )


def resolve(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """(label → seed → resolved run config, the resolved ``[memory.converged]`` table): the
    runs as :func:`experiments.memory.maps.resolve` takes them, whose ``[memory]`` table
    holds this driver's sub-table."""
    configs, memory = memory_map.resolve(raw, seeds)
    table = config_module.fill("[memory.converged]", memory["converged"], CONVERGED)
    _check(table, configs)
    return configs, table


# ---------------------------------------------------------------- retraining
class Retrainer:
    """Deterministic leave-one-out retraining of a trained posterior's free parameters
    (``start``, name → tensor) by L-BFGS in float64 on the CPU, of the objective

        J = 1/(S·N) Σ_s Σ_{j kept} ℓ_j(θ_s) + penalty,

    θ_s the ``samples`` fixed draws of the posterior; a subclass gives the draws, the
    penalty, the point whose logits are read and the posterior at given parameters."""

    start: dict[str, Tensor]

    def __init__(self, run: Any, table: dict[str, Any], seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed + 104729)  # the fixed draws
        self.post = lgb.Posterior.from_optimizer(run.optimizer, run.model)
        self.table = table
        self.model = copy.deepcopy(run.model).double().cpu().eval()
        x, y = train_inputs(run)
        self.x, self.y = x.double().cpu(), y.cpu()
        self.size = len(self.y)
        self.dtype = next(iter(self.post.values())).element.dtype
        names = list(dict(self.model.named_parameters()))
        self.names = {k: k if isinstance(k, str) else names[k] for k in self.post}
        groups = run.optimizer.param_groups
        self.delta = float(groups[0]["prior_precision"])
        self.tau = float(groups[0]["temperature"])

    def draws(self, params: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """The network's parameters θ_s at the fixed draws."""
        raise NotImplementedError

    def penalty(self, params: dict[str, Tensor], draws: list[dict[str, Tensor]]) -> Tensor:
        """The objective's terms other than the data's."""
        raise NotImplementedError

    def point(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The network's parameters at the posterior mean."""
        raise NotImplementedError

    def objective(self, params: dict[str, Tensor], keep: Tensor | None) -> Tensor:
        """J at ``params`` over the rows ``keep`` (None: all)."""
        x, y = self._rows(keep)
        draws = self.draws(params)
        total = torch.zeros((), dtype=torch.float64)
        for theta in draws:
            logits = functional_call(self.model, theta, (x,))
            total = total + cross_entropy(logits, y, reduction="sum")
        return total / (len(draws) * self.size) + self.penalty(params, draws)

    def example_loss(self, params: dict[str, Tensor], i: int) -> Tensor:
        """ℓ̄_i, example ``i``'s loss averaged over the draws: N times what it adds to J."""
        x, y = self.x[i : i + 1], self.y[i : i + 1]
        draws = self.draws(params)
        losses = [cross_entropy(functional_call(self.model, t, (x,)), y) for t in draws]
        return torch.stack(losses).mean()

    def mean_logits(self, params: dict[str, Tensor], index: Tensor) -> Tensor:
        """The logits at the posterior mean of the examples ``index``, ``[len(index), K]``,
        differentiable in ``params``."""
        return functional_call(self.model, self.point(params), (self.x[index],))

    @torch.no_grad()
    def logits(self, params: dict[str, Tensor], index: Tensor) -> Tensor:
        """:meth:`mean_logits` without gradients."""
        return self.mean_logits(params, index)

    def posterior(self, params: dict[str, Tensor]) -> lgb.Posterior:
        """The posterior at ``params``, in the trained posterior's dtype and keys."""
        raise NotImplementedError

    def _rows(self, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        return (self.x, self.y) if keep is None else (self.x[keep], self.y[keep])

    def _with(self, elements: dict[str, Tensor]) -> lgb.Posterior:
        entries = {
            k: dataclasses.replace(e, element=elements[self.names[k]].to(self.dtype))
            for k, e in self.post.items()
        }
        post = self.post
        return lgb.Posterior(
            entries,
            point_at=post.point_at,
            temperature=post.temperature,
            data_size=post.data_size,
        )

    def retrain(
        self, removed: int | None, index: Tensor, start: dict[str, Tensor] | None = None
    ) -> dict[str, Any]:
        """Minimise the objective without ``removed`` (None: nothing removed) from ``start``
        (default: the trained posterior's parameters); the logits at the converged posterior
        of ``index``, those one chunk before, the objective after every chunk, the
        iterations, whether the stopping rule was met, the final gradient's largest entry,
        seconds, and the converged parameters (``self.last``)."""
        t0 = time.perf_counter()
        table = self.table
        keep = None if removed is None else torch.arange(self.size) != removed
        start = self.start if start is None else start
        params = {n: m.detach().clone().requires_grad_(True) for n, m in start.items()}
        opt = torch.optim.LBFGS(
            list(params.values()),
            lr=1.0,
            max_iter=table["chunk"],
            history_size=table["history"],
            line_search_fn="strong_wolfe",
            tolerance_grad=1e-14,
            tolerance_change=1e-16,
        )

        def closure() -> Tensor:
            opt.zero_grad()
            value = self.objective(params, keep)
            value.backward()
            return value

        with torch.no_grad():
            trace = [float(self.objective(params, keep))]
        before = self.logits(params, index)
        iterations = 0
        while iterations < table["max_iterations"]:
            before = self.logits(params, index)
            opt.step(closure)
            iterations += table["chunk"]
            with torch.no_grad():
                trace.append(float(self.objective(params, keep)))
            if abs(trace[-2] - trace[-1]) <= table["rtol"] * abs(trace[-1]):
                break
        grad = max(float(m.grad.abs().max()) for m in params.values() if m.grad is not None)
        self.last = {n: m.detach() for n, m in params.items()}
        return {
            "logits": self.logits(params, index).tolist(),
            "previous": before.tolist(),
            "objective": trace,
            "iterations": iterations,
            "converged": abs(trace[-2] - trace[-1]) <= table["rtol"] * abs(trace[-1]),
            "grad_max": grad,
            "seconds": time.perf_counter() - t0,
        }


class ShiftRetrainer(Retrainer):
    """A diagonal Gaussian posterior's mean m retrained, its covariance A²σ² and ``samples``
    antithetic draws of q0 held fixed:

        J(m) = 1/(S·N) Σ_s Σ_{j kept} ℓ_j(m + A(ξ_s − Eξ)) + δ/(2N) ‖m‖²."""

    def __init__(self, run: Any, table: dict[str, Any], seed: int) -> None:
        super().__init__(run, table, seed)
        self.mean: dict[str, Tensor] = {}
        self.noise: dict[str, Tensor] = {}  # name → [S, *shape]
        self.scale: dict[str, Tensor] = {}
        self.centre: dict[str, float] = {}  # name → Eξ
        half = table["samples"] // 2
        for key, entry in self.post.items():
            if not isinstance(entry.group, DiagonalAffineGroup):
                raise ValueError(f"posterior: entry {key!r} is not diagonal affine")
            name = self.names[key]
            A, b = entry.element[0].double().cpu(), entry.element[1].double().cpu()
            centre = float(entry.base.mean)
            xi = torch.empty((half, *A.shape), dtype=torch.float64)
            lgb.distributions.sample_into(entry.base, xi, self.generator)
            xi = torch.cat([xi - centre, centre - xi])  # antithetic about Eξ
            self.mean[name] = b + A * centre
            self.noise[name] = A * xi
            self.scale[name], self.centre[name] = A, centre
        self.start = self.mean

    def draws(self, mean: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """θ_s = m + A(ξ_s − Eξ)."""
        S = self.table["samples"]
        return [{n: m + self.noise[n][s] for n, m in mean.items()} for s in range(S)]

    def penalty(self, mean: dict[str, Tensor], draws: list[dict[str, Tensor]]) -> Tensor:
        """δ/(2N) ‖m‖²."""
        prior = sum((m.square().sum() for m in mean.values()), torch.zeros((), dtype=torch.float64))
        return 0.5 * self.delta / self.size * prior

    def point(self, mean: dict[str, Tensor]) -> dict[str, Tensor]:
        return mean

    def posterior(self, mean: dict[str, Tensor]) -> lgb.Posterior:
        """(A, b) with b = m − A·Eξ."""
        return self._with(
            {n: torch.stack([A, mean[n] - A * self.centre[n]]) for n, A in self.scale.items()}
        )


class ScaleRetrainer(Retrainer):
    """A signed multiplicative posterior θ = g⁺ξ⁺ − g⁻ξ⁻ retrained whole (its spread is
    proportional to g, so nothing stays fixed), in log g±, with ``samples`` draws of ξ±
    fixed:

        J(g) = 1/(S·N) Σ_s Σ_{j kept} ℓ_j(θ_s) + δ/(2SN) Σ_s ‖θ_s‖² − τ/N Σ (log g⁺ + log g⁻),

    θ_s = g⁺ξ⁺_s − g⁻ξ⁻_s: the multiplicative rule's objective, E_q over the draws. The
    logits read are those at the posterior mean Eξ·(g⁺ − g⁻), the prediction the
    Jacobian form of the estimate is about."""

    def __init__(self, run: Any, table: dict[str, Any], seed: int) -> None:
        super().__init__(run, table, seed)
        self.start = {}
        self.noise: dict[str, Tensor] = {}  # name → [S, 2, *shape]
        self.centre: dict[str, float] = {}  # name → Eξ
        for key, entry in self.post.items():
            group = entry.group
            if not isinstance(group, lgb.groups.MultiplicativeGroup) or not group.signed:
                raise ValueError(f"posterior: entry {key!r} is not signed multiplicative")
            name = self.names[key]
            g = entry.element.double().cpu()
            xi = torch.empty((table["samples"], *g.shape), dtype=torch.float64)
            lgb.distributions.sample_into(entry.base, xi, self.generator)
            self.start[name], self.noise[name] = g.log(), xi
            self.centre[name] = float(entry.base.mean)

    def draws(self, log_scale: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """θ_s = g⁺ξ⁺_s − g⁻ξ⁻_s, g = exp(``log_scale``)."""
        scale = {n: log_g.exp() for n, log_g in log_scale.items()}
        return [
            {n: g[0] * self.noise[n][s, 0] - g[1] * self.noise[n][s, 1] for n, g in scale.items()}
            for s in range(self.table["samples"])
        ]

    def penalty(self, log_scale: dict[str, Tensor], draws: list[dict[str, Tensor]]) -> Tensor:
        """δ/(2SN) Σ_s ‖θ_s‖² − τ/N Σ log g."""
        square = torch.zeros((), dtype=torch.float64)
        for theta in draws:
            square = square + sum(p.square().sum() for p in theta.values())
        entropy = sum(log_g.sum() for log_g in log_scale.values())
        return 0.5 * self.delta * square / (len(draws) * self.size) - self.tau / self.size * entropy

    def point(self, log_scale: dict[str, Tensor]) -> dict[str, Tensor]:
        """Eξ·(g⁺ − g⁻)."""
        return {n: self.centre[n] * (g[0].exp() - g[1].exp()) for n, g in log_scale.items()}

    def posterior(self, log_scale: dict[str, Tensor]) -> lgb.Posterior:
        return self._with({n: log_g.exp() for n, log_g in log_scale.items()})


RETRAINERS: dict[str, type[Retrainer]] = {
    "affine": ShiftRetrainer,
    "multiplicative": ScaleRetrainer,
}
"""The retraining for each rule this check takes, by the optimizer's name."""


def retrain_all(retrainer: Retrainer, examples: list[int], path: Path) -> list[dict[str, Any]]:
    """The control (nothing removed; the logits of every example before and after) and one
    retraining per example (the logits of that example), each row appended to ``path``
    (rewritten atomically) as soon as it is done; rows already there are kept."""
    rows = runfiles.read_jsonl(path)
    done = {(r["kind"], r["index"]) for r in rows}
    everyone = torch.tensor(examples)
    control_path = path.with_name(CONTROL_MEAN)
    if ("control", None) not in done or not control_path.exists():
        rows = [r for r in rows if r["kind"] != "control"]
        start = retrainer.logits(retrainer.start, everyone).tolist()
        row = retrainer.retrain(None, everyone)
        runfiles.save_torch(control_path, retrainer.last)
        rows.insert(
            0, {"kind": "control", "index": None, "examples": examples, "start": start, **row}
        )
        runfiles.write_jsonl(path, rows)
    converged_control = runfiles.load_torch(control_path)
    if ("again", None) not in done:  # the floor: the same retraining, nothing removed
        row = retrainer.retrain(None, everyone, converged_control)
        rows.append({"kind": "again", "index": None, **row})
        runfiles.write_jsonl(path, rows)
    for i in examples:
        if ("removed", i) in done:
            continue
        row = retrainer.retrain(i, torch.tensor([i]), converged_control)
        row["logits"], row["previous"] = row["logits"][0], row["previous"][0]
        rows.append({"kind": "removed", "index": i, **row})
        runfiles.write_jsonl(path, rows)
    return rows


# -------------------------------------------------------------------- summary
def changes(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Per retrained example (the control's order), L1 distances of the logits (``_f``) and
    of the probabilities (``_p``): ``truth`` (removed − control), ``floor`` (the same
    retraining with nothing removed, from the converged control: what the protocol moves by
    itself), ``drift`` (control − trained: what converging the fixed-draw objective moves
    from the trained posterior) and ``settle`` (how far the retrained prediction moved over
    its last chunk, removal and control together: what convergence leaves)."""
    control = next(r for r in rows if r["kind"] == "control")
    again = next(r for r in rows if r["kind"] == "again")
    removed = {r["index"]: r for r in rows if r["kind"] == "removed"}
    examples = [i for i in control["examples"] if i in removed]
    at = [control["examples"].index(i) for i in examples]
    f = {
        "again": np.asarray(again["logits"])[at],
        "start": np.asarray(control["start"])[at],
        "control": np.asarray(control["logits"])[at],
        "control_prev": np.asarray(control["previous"])[at],
        "without": np.asarray([removed[i]["logits"] for i in examples]),
        "without_prev": np.asarray([removed[i]["previous"] for i in examples]),
    }
    out: dict[str, Any] = {"examples": np.asarray(examples), "signed": f["without"] - f["control"]}
    for suffix, v in (("_f", f), ("_p", {k: _softmax(a) for k, a in f.items()})):
        out[f"truth{suffix}"] = np.abs(v["without"] - v["control"]).sum(-1)
        out[f"drift{suffix}"] = np.abs(v["control"] - v["start"]).sum(-1)
        out[f"floor{suffix}"] = np.abs(v["again"] - v["control"]).sum(-1)
        out[f"settle{suffix}"] = np.abs(v["without"] - v["without_prev"]).sum(-1) + np.abs(
            v["control"] - v["control_prev"]
        ).sum(-1)
    return out


def _softmax(logits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(logits).softmax(-1).numpy()


def at_control_summary(estimates: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """Per space, :func:`against` for the estimates computed at the converged control (the
    stationary point the memory-perturbation equation assumes) rather than at the trained
    posterior; ``c`` the true changes (:func:`changes`)."""
    idx = c["examples"]
    return {
        space: against(estimates[key][idx].double().numpy(), c[f"truth_{space}"])
        for space, key in (("f", "logits"), ("p", "probabilities"))
    }


def summarise(estimates: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per space (logits ``f``, probabilities ``p``): medians of the truth, floor and what
    convergence leaves; median truth ÷ floor and the share above it; the estimate's median
    ratio to the truth (and its quartiles), Spearman and Pearson of the logarithms; and the
    retrainings' iterations, seconds and convergence."""
    c = changes(rows)
    idx = c["examples"]
    removed = [r for r in rows if r["kind"] == "removed"]
    control = next(r for r in rows if r["kind"] == "control")
    again = next(r for r in rows if r["kind"] == "again")
    out: dict[str, Any] = {
        "examples": len(idx),
        "iterations_median": float(np.median([r["iterations"] for r in removed])),
        "iterations_max": max(r["iterations"] for r in removed),
        "converged": float(np.mean([r["converged"] for r in removed])),
        "seconds_median": float(np.median([r["seconds"] for r in removed])),
        "grad_max_median": float(np.median([r["grad_max"] for r in removed])),
        "control": {k: control[k] for k in ("iterations", "converged", "grad_max", "seconds")},
        "again": {k: again[k] for k in ("iterations", "converged", "grad_max", "seconds")},
    }
    for space, key in (("f", "logits"), ("p", "probabilities")):
        est = estimates[key][idx].double().numpy()
        truth, floor, settle, drift = (
            c[f"{k}_{space}"] for k in ("truth", "floor", "settle", "drift")
        )
        out[space] = {
            "truth_median": float(np.median(truth)),
            "floor_median": float(np.median(floor)),
            "settle_median": float(np.median(settle)),
            "drift_median": float(np.median(drift)),
            "truth_over_drift": median_ratio(truth, drift),
            "settle_over_truth_max": float(np.max(settle / truth)),
            "truth_over_floor": median_ratio(truth, floor),
            "above_floor": float((truth > floor).mean()),
            **against(est, truth),
            "spearman_baselines": {
                name: spearman(estimates[name][idx].double().numpy(), truth)
                for name in BASELINES
                if name in estimates
            },
        }
    if "moved" in estimates:  # the direction: cosine of the estimated and true change of f
        est_f, true_f = estimates["moved"][idx].double().numpy(), c["signed"]
        norms = np.linalg.norm(est_f, axis=1) * np.linalg.norm(true_f, axis=1)
        cosine = (est_f * true_f).sum(1) / np.where(norms > 0, norms, np.nan)
        out["f"]["cosine_median"] = float(np.nanmedian(cosine))
        out["f"]["cosine_quartiles"] = [float(q) for q in np.nanquantile(cosine, [0.25, 0.75])]
    return out


REMOVALS_LABEL = "a removal (from the converged control)"
FLOOR_DRIFT_LABEL = "floor (red ×) and drift (grey +): the change"
"""The converged figure's legend entry of the removals' curves and the axis label of the
floor's and the drift's points (:func:`figure`)."""


def figure(estimates: dict[str, Any], rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Three panels: the objective J − min J over L-BFGS iterations (control and removals,
    each in the legend), and per space the estimate against the truth on log-log axes, the
    identity line drawn, with the floor (retraining alone) and the drift (control − trained)
    at the same estimates: their x is not the truth, so the top axis says what it is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = changes(rows)
    idx = c["examples"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.0))
    ax = axes[0]
    chunk = None
    for r in rows:
        if r["kind"] == "again":
            continue
        trace = np.asarray(r["objective"])
        chunk = r["iterations"] / max(1, len(trace) - 1)
        gap = trace - trace.min()
        steps = np.arange(len(trace)) * chunk
        kind = r["kind"] == "control"
        ax.semilogy(
            steps[:-1],
            np.maximum(gap[:-1], 1e-16),
            color="k" if kind else "tab:blue",
            alpha=1.0 if kind else 0.15,
            lw=2 if kind else 0.8,
            label="control (nothing removed)" if kind else None,
        )
    ax.plot([], [], color="tab:blue", alpha=0.5, lw=0.8, label=REMOVALS_LABEL)
    ax.set_xlabel("L-BFGS iterations")
    ax.set_ylabel("objective − its final value")
    ax.set_title("the full-batch objective settles")
    ax.legend(loc="upper right", fontsize=8)
    for ax, (space, key, name) in zip(
        axes[1:],
        (("f", "logits", "logits ‖Δf‖₁"), ("p", "probabilities", "probabilities ‖Δp‖₁")),
        strict=True,
    ):
        est = estimates[key][idx].double().numpy()
        truth, floor, drift = (c[f"{k}_{space}"] for k in ("truth", "floor", "drift"))
        ax.loglog(truth, est, ".", color="tab:blue", ms=4, label="leave-one-out (truth)")
        ax.loglog(
            np.maximum(floor, 1e-12),
            est,
            "x",
            color="tab:red",
            ms=4,
            label="same retraining, nothing removed (floor)",
        )
        ax.loglog(drift, est, "+", color="0.7", ms=4, label="control − trained (drift)")
        shown = np.concatenate([truth, est, floor, drift])
        lo, hi = shown[shown > 0].min(), shown.max()
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="identity")
        ax.set_xlabel(f"true change of the {name} (blue •)")
        top = ax.secondary_xaxis("top")
        top.set_xlabel(f"{FLOOR_DRIFT_LABEL} of the {name}", color="0.3", fontsize=9)
        ax.set_ylabel("estimate")
        ax.set_title(f"{name}: Spearman {spearman(est, truth):.2f}")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ one run
def estimates_of(run: Any, posterior: lgb.Posterior | None = None) -> dict[str, Any]:
    """The memory-map estimates of the training set (Jacobian form) under ``posterior``
    (default: the trained one; τ the run's): the scores of both spaces, the estimated change
    of the logits as a vector (``moved``), and the rankings without the estimate: the
    residual ‖eᵢ‖₁, the total variance tr Vᵢ and the loss at the mean (``residual``,
    ``variance``, ``loss``)."""
    x, y = train_inputs(run)
    source = run.optimizer if posterior is None else posterior
    tau = float(run.optimizer.param_groups[0]["temperature"])
    out: dict[str, Any] = {"labels": y.cpu()}
    for key in ("logits", "probabilities"):
        mm = lgb.memory_map(run.model, source, x, y, method="jacobian", change=key, temperature=tau)
        out[key] = mm.scores.cpu()
    out["moved"] = (mm.variances * mm.residuals).cpu()  # the estimated change v ⊙ e, [N, K]
    out["residual"] = mm.prediction_error.cpu()
    out["variance"] = mm.total_variance.cpu()
    out["loss"] = -mm.predictions.gather(1, y[:, None])[:, 0].log().cpu()
    return out


def validate(table: dict[str, Any], cfg: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Train, estimate, retrain to convergence and summarise one run; writes ``folder``."""
    seed = cfg["seed"]
    run = trained(cfg, folder / "train")
    est_path = folder / ESTIMATES
    if est_path.exists():
        est = runfiles.load_torch(est_path)
    else:
        est = estimates_of(run)
        runfiles.save_torch(est_path, est)
    gen = torch.Generator().manual_seed(seed)
    examples = torch.randperm(len(est["labels"]), generator=gen)[: table["examples"]].tolist()
    retrainer = RETRAINERS[cfg["optimizer"]["name"]](run, table, seed)
    rows = retrain_all(retrainer, examples, folder / RETRAIN)
    control = runfiles.load_torch(folder / CONTROL_MEAN)
    at_control = estimates_of(run, retrainer.posterior(control))
    runfiles.save_torch(folder / ESTIMATES_AT_CONTROL, at_control)
    influence_path = folder / INFLUENCE
    if influence_path.exists():
        predicted = runfiles.load_torch(influence_path)
    else:
        predicted = memory_influence.predict(retrainer, control, examples)
        runfiles.save_torch(influence_path, predicted)
    title = (
        f"{cfg['data']['name']}, {cfg['optimizer']['name']} rule, seed {seed}: "
        f"{len(examples)} random examples retrained to convergence"
    )
    figure(est, rows, folder / "converged.png", title)
    c = changes(rows)
    memory_influence.figure(
        predicted,
        at_control["logits"],
        c,
        folder / "influence.png",
        f"{cfg['data']['name']}, {cfg['optimizer']['name']} rule, seed {seed}: "
        f"{len(examples)} removals predicted at the converged control",
    )
    summary = {
        "test": metrics_on_test(run, 64),
        "train_size": len(est["labels"]),
        **summarise(est, rows),
        "at_control": at_control_summary(at_control, c),
        "influence": memory_influence.summarise(predicted, c),
    }
    runfiles.write_json(folder / SUMMARY, summary)
    return summary


def converged(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Validate every run and seed of ``raw`` into ``out``; returns label → summaries."""
    out = Path(out)
    configs, table = resolve(raw, seeds)
    check_runs(configs)
    with runfiles.locked(out):
        skeleton.prepare_folder(out, skeleton.written(configs), resume, {"converged": table})
        results: dict[str, Any] = {}
        for label, by_seed in configs.items():
            per_seed = {
                f"seed{s}": validate(table, cfg, out / label / f"seed{s}")
                for s, cfg in by_seed.items()
            }
            results[label] = {
                "seeds": list(by_seed),
                "summary": aggregate(list(per_seed.values())),
                "per_seed": per_seed,
            }
        runfiles.write_json(out / "results.json", results)
        write_docs_summary(out)
    return results


def write_docs_summary(out: Path) -> dict[str, Any]:
    """``out/docs_summary.json``: the folder's summary as ``python -m
    experiments.reporting.docs_tables summarise`` writes it (per label its seeds and every number,
    mean ± sd over seeds), and the full resolved config (``full_config``, the folder's
    ``config.json``); copied to ``docs/results/NAME.json`` it is what the documentation quotes."""
    from experiments.reporting.docs_tables import summarise_folder

    summary = {**summarise_folder(out), "full_config": runfiles.read_json(out / "config.json")}
    runfiles.write_json(out / DOCS_SUMMARY, summary)
    return summary


def _show(results: dict[str, Any], out: Path) -> None:
    for label, res in results.items():
        for seed, s in res["per_seed"].items():
            for space in ("f", "p"):
                e = s[space]
                print(
                    f"{label} {seed} {space}: {s['examples']} examples, median estimate/truth "
                    f"{e['ratio_median']:.3g}, Spearman {e['spearman']:.3f}, truth/floor "
                    f"{e['truth_over_floor']:.3g} (above {e['above_floor']:.2f})"
                )
    print(f"results in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, converged, _show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
