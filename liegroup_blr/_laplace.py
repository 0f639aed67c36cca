r"""The prediction variances of :func:`~liegroup_blr.memory_maps.loo_nll` and
:func:`~liegroup_blr.memory_maps.memory_map` by Jacobians: a diagonal posterior's
:math:`J\Sigma J^\top` (:func:`jacobian_batch`), and the Laplace posteriors at a trained mean
(:func:`laplace_moments`): precision :math:`N\bar G + \delta I`, :math:`\bar G` the mean GGN
:math:`J_i^\top\Lambda_iJ_i` over the inputs (its diagonal, its K-FAC per ``nn.Linear``
layer, the whole of it, or the Hessian of the loss), untempered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from .posterior import Posterior, unwrap

__all__ = ["jacobian_batch", "laplace_moments", "laplace_prior"]


def jacobian_batch(
    model: nn.Module, params: dict[str, Tensor], variances: dict[str, Tensor], cross_class: bool
) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    r"""Logits at the mean and :math:`v_{ik} = \sum_p J_{ikp}^2\Sigma_{pp}` (or
    :math:`V_i = J_i\Sigma J_i^\top`) of a batch, by one pullback per output, vmapped over
    the examples."""

    def one(x: Tensor) -> tuple[Tensor, Tensor]:
        out = vjp(lambda p: functional_call(model, p, (x[None],)).reshape(-1), params)
        f, pullback = out[0], out[1]
        basis = torch.eye(f.shape[0], dtype=f.dtype, device=f.device)
        if not cross_class:  # one output at a time: one gradient per example in memory
            v = [weighted_square(pullback(basis[k])[0], variances) for k in range(len(f))]
            return f, torch.stack(v)
        (grads,) = vmap(pullback)(basis)  # name → [K, *shape]
        V = [
            torch.einsum("kp,p,lp->kl", g.flatten(1), variances[n].flatten(), g.flatten(1))
            for n, g in grads.items()
        ]
        return f, torch.stack(V).sum(0)

    return vmap(one)


def weighted_square(grads: dict[str, Tensor], variances: dict[str, Tensor]) -> Tensor:
    """:math:`\\sum_p J_p^2 \\Sigma_{pp}` of one output's gradient ``grads``."""
    return torch.stack([(g.square() * variances[n]).sum() for n, g in grads.items()]).sum()


def laplace_prior(
    source: Any, post: Posterior, prior_precision: float | None
) -> tuple[float, float | None]:
    """(δ, N) of a Laplace source: δ = ``prior_precision`` if given, else the optimizer's
    param groups' (``prior_precision`` plus ``weight_decay`` × N, all groups alike); N the
    posterior's recorded data size (None: the number of inputs)."""
    if prior_precision is None:
        optimizer = None if isinstance(source, Posterior) else unwrap(source)
        if optimizer is None:
            raise ValueError(
                "prior_precision: a Posterior does not record its prior precision δ; pass it "
                "(a Laplace variance source needs N·GGN + δ)"
            )
        deltas = {
            float(g.get("prior_precision", 0.0))
            + float(g.get("weight_decay", 0.0)) * float(g.get("data_size") or 0.0)
            for g in optimizer.param_groups
        }
        if len(deltas) != 1:
            raise ValueError(
                f"prior_precision: the optimizer's param groups differ ({sorted(deltas)}); pass "
                "the one to use"
            )
        prior_precision = deltas.pop()
    if (
        isinstance(prior_precision, bool)
        or not isinstance(prior_precision, (int, float))
        or not prior_precision >= 0
    ):
        raise ValueError(f"prior_precision: must be a number >= 0, got {prior_precision!r}")
    return float(prior_precision), post.data_size


def mean_params(model: nn.Module, post: Posterior) -> tuple[dict[str, Tensor], list[str]]:
    """The posterior mean as a name → tensor dict for ``functional_call``, and the names in
    the posterior's order."""
    at_mean = post.with_point_at("mean")
    with at_mean.at_point_estimate(model):  # ValueError if names or shapes differ
        named = dict(model.named_parameters())
        order = list(named)
        names = [order[k] if isinstance(k, int) else k for k in post]
        params = {n: named[n].detach().clone() for n in names}
    return params, names


def curvature(f: Tensor, likelihood: str, noise_variance: float) -> Tensor:
    """``[B, K, K]`` Λ: the likelihood's Hessian in the logits at ``f``."""
    K = f.shape[-1]
    if likelihood == "gaussian":
        eye = torch.eye(K, dtype=f.dtype, device=f.device)
        return (eye / noise_variance).expand(len(f), K, K)
    p = torch.softmax(f, -1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def flat_jacobians(
    model: nn.Module, params: dict[str, Tensor]
) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """Logits ``[B, K]`` and their Jacobians in the flattened parameters ``[B, K, P]``."""

    def one(x: Tensor) -> tuple[Tensor, Tensor]:
        out = vjp(lambda p: functional_call(model, p, (x[None],)).reshape(-1), params)
        f, pullback = out[0], out[1]
        (grads,) = vmap(pullback)(torch.eye(f.shape[0], dtype=f.dtype, device=f.device))
        return f, torch.cat([grads[n].flatten(1) for n in params], 1)

    return vmap(one)


def laplace_moments(
    model: nn.Module,
    post: Posterior,
    inputs: Tensor,
    targets: Tensor | None,
    variance: str,
    batch_size: int,
    cross_class: bool,
    likelihood: str,
    noise_variance: float,
    delta: float,
    data_size: float | None,
) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Per batch: its rows, the logits at the posterior mean ``[B, K]`` and their
    (co)variance under the Laplace posterior of precision :math:`\\frac{N}{n}\\sum_i
    J_i^\\top\\Lambda_iJ_i + \\delta I` (or its diagonal, its K-FAC, the Hessian of the
    loss), untempered."""
    params, names = mean_params(model, post)
    device = next(iter(params.values())).device
    n = len(inputs)
    scale = (data_size if data_size is not None else n) / n
    batches = [slice(s, s + batch_size) for s in range(0, n, batch_size)]

    def xb(rows: slice) -> Tensor:
        return inputs[rows].to(device)

    if variance == "kfac":
        yield from kfac_moments(
            model, params, batches, xb, cross_class, likelihood, noise_variance, delta, scale
        )
        return
    jac = flat_jacobians(model, params)
    size = sum(p.numel() for p in params.values())
    first = next(iter(params.values()))
    if variance == "diagonal_ggn":
        diag = first.new_zeros(size)
        for rows in batches:
            f, J = jac(xb(rows))
            Lam = curvature(f, likelihood, noise_variance)
            diag += torch.einsum("bkp,bkl,blp->p", J, Lam, J)
        var = 1 / (scale * diag + delta)
        if not bool(torch.isfinite(var).all()) or bool((var <= 0).any()):
            raise ValueError(
                "prior_precision: the diagonal GGN + δ has a zero entry (δ = 0 and a parameter "
                "no output depends on); give δ > 0"
            )
        offset, variances = 0, {}
        for name in names:
            k = params[name].numel()
            variances[name] = var[offset : offset + k].reshape(params[name].shape)
            offset += k
        batch = jacobian_batch(model, params, variances, cross_class)
        for rows in batches:
            yield rows, *batch(xb(rows))
        return
    if size > EXACT_LIMIT:
        raise ValueError(
            f"variance: {variance!r} inverts a {size} × {size} matrix; it takes at most "
            f"{EXACT_LIMIT} parameters (use 'kfac' or 'diagonal_ggn')"
        )
    H = first.new_zeros(size, size, dtype=torch.float64)
    if variance == "ggn":
        for rows in batches:
            f, J = jac(xb(rows))
            Lam = curvature(f, likelihood, noise_variance)
            H += torch.einsum("bkp,bkl,blq->pq", J, Lam, J).double()
    else:  # "hessian": of the summed loss at the mean
        if targets is None:
            raise ValueError("variance: 'hessian' needs the targets")
        shapes = [(n_, params[n_].shape) for n_ in names]
        theta = torch.cat([params[n_].flatten() for n_ in names])

        def loss(t: Tensor, x: Tensor, y: Tensor) -> Tensor:
            unflat, o = {}, 0
            for n_, shape in shapes:
                k = shape.numel()
                unflat[n_] = t[o : o + k].reshape(shape)
                o += k
            f = functional_call(model, unflat, (x,)).reshape(len(x), -1)
            if likelihood == "gaussian":
                return 0.5 * (f - y.reshape(f.shape).to(f.dtype)).square().sum() / noise_variance
            return nn.functional.cross_entropy(f, y.long(), reduction="sum")

        hessian = torch.func.hessian(loss)
        for rows in [slice(s, s + 32) for s in range(0, n, 32)]:
            H += hessian(theta, xb(rows), targets[rows].to(device)).double()
    H = scale * H + delta * torch.eye(size, dtype=H.dtype, device=H.device)
    L, info = torch.linalg.cholesky_ex(H)
    if int(info):
        raise ValueError(
            f"variance: the {variance!r} precision N·H + δ is not positive definite (the "
            "Hessian of a loss at a point that is no minimum, or δ = 0); use 'ggn'"
        )
    Sigma = torch.cholesky_inverse(L).to(first.dtype)
    for rows in batches:
        f, J = jac(xb(rows))
        JS = J @ Sigma
        if cross_class:
            yield rows, f, JS @ J.transpose(1, 2)
        else:
            yield rows, f, (JS * J).sum(-1)


EXACT_LIMIT = 20_000
"""The most parameters the exact sources (``"ggn"``, ``"hessian"``) take: a P × P matrix in
float64 (3.2 GB at 20,000)."""


def kfac_moments(
    model: nn.Module,
    params: dict[str, Tensor],
    batches: list[slice],
    xb: Callable[[slice], Tensor],
    cross_class: bool,
    likelihood: str,
    noise_variance: float,
    delta: float,
    scale: float,
) -> Iterator[tuple[slice, Tensor, Tensor]]:
    r"""K-FAC of the GGN per ``nn.Linear`` layer: :math:`\frac{N}{n}\,\frac1n\sum_i\bar a_i
    \bar a_i^\top \otimes \sum_i G_i` (:math:`\bar a` the layer's input with a 1 for the
    bias, :math:`G_i = g_i^\top\Lambda_ig_i`, :math:`g_i` the Jacobian of the logits in the
    layer's output), + δ, inverted in the Kronecker eigenbasis; layers independent."""
    layers: dict[str, nn.Linear] = {}
    owned: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            own = {f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)}
            if own & set(params):
                if not own <= set(params):
                    raise ValueError(
                        f"variance: 'kfac' needs every parameter of the nn.Linear {name!r} in "
                        "the posterior"
                    )
                layers[name] = module
                owned |= own
    if set(params) - owned:
        raise ValueError(
            f"variance: 'kfac' takes nn.Linear layers only; {sorted(set(params) - owned)} "
            "belong to none"
        )

    def linearised(x: Tensor) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """Logits, each layer's input with a 1 for the bias ``[B, in(+1)]`` and the Jacobian of
        the logits in its output ``[B, K, out]`` (zero probes added to the outputs)."""
        acts: dict[str, Tensor] = {}
        probes: dict[str, Tensor] = {}

        def hook(name: str) -> Callable[..., Tensor]:
            def add_probe(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
                a = args[0].detach()
                if a.ndim != 2:
                    raise ValueError(
                        f"variance: 'kfac' takes nn.Linear layers on [batch, features] inputs; "
                        f"{name!r} got {tuple(a.shape)}"
                    )
                if module.bias is not None:
                    a = torch.cat([a, a.new_ones(len(a), 1)], 1)
                acts[name] = a
                probes[name] = torch.zeros_like(out, requires_grad=True)
                return out + probes[name]

            return add_probe

        handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
        try:
            with torch.enable_grad():
                f = functional_call(model, params, (x,)).reshape(len(x), -1)
                grads = [
                    torch.autograd.grad(f[:, k].sum(), list(probes.values()), retain_graph=True)
                    for k in range(f.shape[1])
                ]
        finally:
            for h in handles:
                h.remove()
        g = {n: torch.stack([gk[j] for gk in grads], 1) for j, n in enumerate(probes)}
        return f.detach(), acts, g

    A: dict[str, Tensor] = {}
    B: dict[str, Tensor] = {}
    n = 0
    for rows in batches:
        f, acts, g = linearised(xb(rows))
        Lam = curvature(f, likelihood, noise_variance)
        n += len(f)
        for name in layers:
            a, gi = acts[name], g[name]
            A[name] = A.get(name, 0) + a.T @ a
            B[name] = B.get(name, 0) + torch.einsum("bko,bkl,blq->oq", gi, Lam, gi)
    basis = {}
    for name in layers:  # eigenbases; precision eigenvalues N/n · s_a s_b / n + δ
        sa, Ua = torch.linalg.eigh(A[name].double() / n)
        sb, Ub = torch.linalg.eigh(B[name].double())
        M = 1 / (scale * sa.clamp_min(0)[:, None] * sb.clamp_min(0)[None, :] + delta)
        if not bool(torch.isfinite(M).all()):
            raise ValueError("prior_precision: the K-FAC precision is singular (δ = 0); give δ > 0")
        basis[name] = (Ua.to(f.dtype), Ub.to(f.dtype), M.to(f.dtype))
    for rows in batches:
        f, acts, g = linearised(xb(rows))
        parts = []
        for name, (Ua, Ub, M) in basis.items():
            at = acts[name] @ Ua  # [B, in]
            gt = g[name] @ Ub  # [B, K, out]
            w = at.square() @ M  # [B, out]
            parts.append(
                torch.einsum("bko,bo,blo->bkl", gt, w, gt)
                if cross_class
                else (gt.square() * w[:, None, :]).sum(-1)
            )
        yield rows, f, torch.stack(parts).sum(0)


# ----------------------------------------------------------------------- score
