"""The memorable past against known answers.

A softmax regression without bias whose posterior mean is 0 predicts the uniform distribution
for every input, and its prediction variance is proportional to ‖x‖² (the Jacobian of the
logits is x): an input of 0 has no variance and scores exactly 0, and among inputs c·u the
score grows with c. So the memorable examples of the constructed task are known, and in
which order, whatever the score's form (probabilities or logits, diagonal or cross-class).

The regularisers are checked against closed forms: the K-prior is exact for generalised
linear models (linear and multinomial logistic regression end at the joint MAP of two
tasks), the logits variant of FROMP's per-example kernel is exact where the joint kernel is
diagonal, FROMP's own per-class kernels on the probabilities equal JΣJᵀ + 1e-5·I from explicit
per-class Jacobians of a linear softmax model, and all have zero gradient at the old model (no
double counting); replay is the control that fails these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.groups import DiagonalAffineGroup
from liegroup_blr.memorable import FROMP_JITTER, USES, MemorablePast
from liegroup_blr.posterior import Posterior, PosteriorEntry

K, D = 3, 4


def softmax_regression(
    mean: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, Posterior]:
    """nn.Linear(D, K, bias=False) with weight ``mean`` and the diagonal-affine posterior
    N(mean, scale²) of its weight (A = 1, base N(0, scale²))."""
    model = nn.Linear(D, K, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(mean)
    element = torch.stack((torch.ones(K, D), mean)).to(dtype)
    base = Normal(torch.tensor(0.0, dtype=dtype), torch.tensor(scale, dtype=dtype))
    entry = PosteriorEntry(element, DiagonalAffineGroup(), base, torch.Size((K, D)))
    return model, Posterior({"weight": entry})


def diagonal_gaussian(weight: torch.Tensor, variance: torch.Tensor) -> Posterior:
    """The posterior N(weight, diag(variance)) of an nn.Linear's weight (A = √variance, base
    N(0, 1))."""
    element = torch.stack((variance.sqrt(), weight))
    entry = PosteriorEntry(element, DiagonalAffineGroup(), Normal(0.0, 1.0), weight.shape)
    return Posterior({"weight": entry})


def constructed_task() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """30 inputs: 25 zeros, and c·u for c = 1 … 5 at known rows; labels at random. Returns the
    inputs, the labels and the rows of c = 5, 4, 3, 2, 1 (descending score)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(30, D)
    u = torch.randn(D, generator=gen)
    rows = [17, 3, 26, 9, 12]  # c = 5, 4, 3, 2, 1
    for c, row in zip((5, 4, 3, 2, 1), rows, strict=True):
        x[row] = c * u
    return x, torch.randint(0, K, (30,), generator=gen), rows


class Lookup(nn.Module):
    """A model whose outputs are a fixed table: row ``x[i, 0]`` of ``table``."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x[:, 0].long()]


def lookup_task(
    table: torch.Tensor, labels: list[int]
) -> tuple[Lookup, torch.Tensor, torch.Tensor]:
    n = len(labels)
    return Lookup(table), torch.arange(n, dtype=torch.float64)[:, None], torch.tensor(labels)


def newton(objective: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor) -> torch.Tensor:
    """The minimiser of a smooth strictly convex ``objective`` by damped Newton steps
    (float64, to machine precision)."""
    theta = start.clone()
    for _ in range(100):
        g = torch.func.grad(objective)(theta)
        if g.abs().max() < 1e-13:
            break
        step = torch.linalg.solve(torch.func.hessian(objective)(theta), g)
        size, value = 1.0, objective(theta)
        while objective(theta - size * step) > value and size > 1e-8:
            size /= 2
        theta = theta - size * step
    return theta


# ------------------------------------------------------------------- selection
def test_sensitivity_selection_keeps_the_examples_known_to_score_highest_in_order() -> None:
    x, y, rows = constructed_task()
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    for per_task in (5, 3):
        memory = MemorablePast(per_task, selection="sensitivity")
        chosen = memory.add_task(model, posterior=post, inputs=x, targets=y)
        assert chosen.tolist() == rows[:per_task]
        assert torch.equal(memory.inputs, x[rows[:per_task]])
        assert torch.equal(memory.targets, y[rows[:per_task]])
        assert torch.equal(memory.tasks, torch.zeros(per_task, dtype=torch.long))
        scores = lgb.sensitivity(model, post, x, y)
        assert torch.all(scores[[r for r in range(30) if r not in rows]] == 0)
        assert torch.equal(memory.scores, scores[rows[:per_task]])
        assert torch.all(memory.scores[:-1] > memory.scores[1:])


def test_random_selection_is_the_generator_s_uniform_draw() -> None:
    x, y, _ = constructed_task()
    model, _ = softmax_regression(torch.zeros(K, D), scale=0.3)
    memory = MemorablePast(5, selection="random")
    chosen = memory.add_task(
        model, posterior=None, inputs=x, targets=y, generator=torch.Generator().manual_seed(7)
    )
    # nothing is scored: the choice is the generator's first permutation
    expected = torch.randperm(30, generator=torch.Generator().manual_seed(7))[:5]
    assert torch.equal(chosen, expected)
    assert torch.equal(memory.inputs, x[expected]) and torch.all(memory.scores.isnan())


def test_lambda_selection_is_class_balanced_and_keeps_the_highest_lambda() -> None:
    # logits (c, 0, 0): λ = Σ p(1 − p) falls as c ≥ 0 grows, so within a class the smallest
    # c are the memorable points. Class 0 (rows 0-3), 1 (rows 4-7), 2 (rows 8-11).
    c = torch.tensor([0.1, 0.2, 0.3, 0.35, 1.0, 0.5, 2.0, 0.9, 3.0, 0.6, 2.5, 4.0])
    table = torch.stack((c, torch.zeros(12), torch.zeros(12)), dim=1).double()
    model, x, y = lookup_task(table, [0] * 4 + [1] * 4 + [2] * 4)
    p = torch.softmax(table, dim=-1)
    lam = (p * (1 - p)).sum(-1)
    assert torch.all(lam[c.argsort()][:-1] > lam[c.argsort()][1:])  # λ order = c order
    memory = MemorablePast(6)  # selection="lambda": 2 per class
    chosen = memory.add_task(model, posterior=None, inputs=x, targets=y)
    assert chosen.tolist() == [0, 1, 5, 7, 9, 10]  # the two smallest c of each class
    assert lam.topk(6).indices.sort().values.tolist() == [0, 1, 2, 3, 5, 9]  # not balanced
    assert torch.equal(memory.scores, lam[chosen])
    assert torch.equal(memory.outputs_old, table[chosen])
    # a class of one example gives its remainder to the others: 7 = 1 + 3 + 3
    model, x, y = lookup_task(table, [0] + [1] * 5 + [2] * 6)
    chosen = MemorablePast(7).add_task(model, posterior=None, inputs=x, targets=y)
    assert chosen.tolist() == [0, 1, 2, 3, 9, 7, 6]
    assert y[chosen].tolist() == [0, 1, 1, 1, 2, 2, 2]
    # 7 over three full classes: round-robin, the remainder to the lowest label
    model, x, y = lookup_task(table, [0] * 4 + [1] * 4 + [2] * 4)
    chosen = MemorablePast(7).add_task(model, inputs=x, targets=y)
    assert y[chosen].tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert len(MemorablePast(50).add_task(model, inputs=x, targets=y)) == 12  # at most the task


def test_tasks_are_appended_with_their_index() -> None:
    x, y, rows = constructed_task()
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    memory = MemorablePast(2, selection="sensitivity")
    memory.add_task(model, posterior=post, inputs=x, targets=y)
    memory.add_task(model, posterior=post, inputs=2 * x, targets=y)
    assert len(memory) == 4 and memory.num_tasks == 2
    assert memory.tasks.tolist() == [0, 0, 1, 1]
    assert torch.equal(memory.inputs[2:], 2 * x[rows[:2]])
    assert torch.equal(memory.targets, y[rows[:2] + rows[:2]])


def test_the_old_outputs_are_the_model_s_point_estimate_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Dropout(0.5), nn.Linear(8, K))
    x, y = torch.randn(20, D), torch.randint(0, K, (20,))
    memory = MemorablePast(5, "random")
    chosen = memory.add_task(model, posterior=None, inputs=x, targets=y, batch_size=3)
    assert model.training  # restored
    model.eval()
    assert torch.allclose(memory.outputs_old, model(x[chosen]), atol=1e-6)
    assert not memory.outputs_old.requires_grad and memory.kernel_inverse.numel() == 0


# -------------------------------------------------------------- closed forms
def two_regression_tasks(d: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    X1, X2 = torch.randn(12, d, generator=gen).double(), torch.randn(9, d, generator=gen).double()
    w = torch.randn(d, generator=gen).double()
    y1 = X1 @ w + 0.3 * torch.randn(12, generator=gen).double()
    y2 = X2 @ (w + 1) + 0.3 * torch.randn(9, generator=gen).double()
    return X1, y1, X2, y2


def linear_model(weight: torch.Tensor) -> nn.Linear:
    model = nn.Linear(weight.shape[1], weight.shape[0], bias=False).double()
    with torch.no_grad():
        model.weight.copy_(weight)
    return model


def test_kprior_is_exact_for_bayesian_linear_regression() -> None:
    d, delta, s2 = 3, 0.7, 0.25
    X1, y1, X2, y2 = two_regression_tasks(d)
    eye = torch.eye(d, dtype=torch.float64)

    def map_of(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # N(0, δ⁻¹I) prior
        return torch.linalg.solve(X.T @ X / s2 + delta * eye, X.T @ y / s2)

    theta1 = map_of(X1, y1)
    memory = MemorablePast(len(y1), "random", "kprior", likelihood="gaussian", noise_variance=s2)
    memory.add_task(linear_model(theta1[None]), posterior=None, inputs=X1, targets=y1)
    assert torch.allclose(memory.outputs_old[:, 0], memory.inputs @ theta1, atol=1e-12)
    N2 = len(y2)

    def objective(theta: torch.Tensor) -> torch.Tensor:
        k_prior = N2 * memory.loss((memory.inputs @ theta)[:, None], data_size=N2)
        weight_prior = delta / 2 * (theta - theta1).square().sum()
        return k_prior + weight_prior + (X2 @ theta - y2).square().sum() / (2 * s2)

    joint = map_of(torch.cat((X1, X2)), torch.cat((y1, y2)))
    theta2 = newton(objective, torch.zeros(d, dtype=torch.float64))
    assert torch.allclose(theta2, joint, atol=1e-10, rtol=0)
    assert not torch.allclose(theta1, joint, atol=1e-3)  # task 2 moved it


def test_kprior_is_exact_for_multinomial_logistic_regression() -> None:
    d, delta = 3, 0.5
    gen = torch.Generator().manual_seed(2)
    X1, X2 = torch.randn(15, d, generator=gen).double(), torch.randn(11, d, generator=gen).double()
    y1, y2 = torch.randint(0, K, (15,), generator=gen), torch.randint(0, K, (11,), generator=gen)

    def nll(theta: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = X @ theta.reshape(K, d).T
        return nn.functional.cross_entropy(logits, y, reduction="sum")

    start = torch.zeros(K * d, dtype=torch.float64)
    theta1 = newton(lambda t: nll(t, X1, y1) + delta / 2 * t.square().sum(), start)
    memory = MemorablePast(len(y1), "random", "kprior")
    memory.add_task(linear_model(theta1.reshape(K, d)), posterior=None, inputs=X1, targets=y1)
    N2 = len(y2)

    def objective(theta: torch.Tensor) -> torch.Tensor:
        logits = memory.inputs @ theta.reshape(K, d).T
        k_prior = N2 * memory.loss(logits, data_size=N2)
        return k_prior + delta / 2 * (theta - theta1).square().sum() + nll(theta, X2, y2)

    X, y = torch.cat((X1, X2)), torch.cat((y1, y2))
    joint = newton(lambda t: nll(t, X, y) + delta / 2 * t.square().sum(), start)
    theta2 = newton(objective, start)
    assert torch.allclose(theta2, joint, atol=1e-6, rtol=0)
    assert not torch.allclose(theta1, joint, atol=1e-2)


def test_fromp_logits_equals_the_weight_space_prior_where_its_kernel_is_exact() -> None:
    # Linear regression on axis-aligned inputs c_i·e_i: task 1's posterior covariance Σ₁ is
    # diagonal, and so is the joint kernel XΣ₁Xᵀ of its d points: the per-example blocks are
    # the joint kernel, and ½ΔᵀK⁻¹Δ = ½(θ − θ₁)ᵀΣ₁⁻¹(θ − θ₁) (up to the jitter's 1e-6).
    d, delta, s2 = 3, 0.7, 0.25
    X1 = torch.diag(torch.tensor([0.5, -2.0, 1.3], dtype=torch.float64))
    y1 = torch.tensor([1.0, -0.4, 2.2], dtype=torch.float64)
    _, _, X2, y2 = two_regression_tasks(d)
    precision1 = X1.T @ X1 / s2 + delta * torch.eye(d, dtype=torch.float64)
    theta1 = torch.linalg.solve(precision1, X1.T @ y1 / s2)
    Sigma1 = torch.linalg.inv(precision1)
    assert torch.equal(Sigma1, torch.diag(Sigma1.diagonal()))
    posterior = diagonal_gaussian(theta1[None], Sigma1.diagonal()[None])
    memory = MemorablePast(d, "random", "fromp_logits", likelihood="gaussian", noise_variance=s2)
    memory.add_task(linear_model(theta1[None]), posterior=posterior, inputs=X1, targets=y1)
    N2 = len(y2)

    def fromp(theta: torch.Tensor) -> torch.Tensor:
        return N2 * memory.loss((memory.inputs @ theta)[:, None], data_size=N2)

    gen = torch.Generator().manual_seed(3)
    for theta in (theta1 + torch.randn(d, generator=gen).double() for _ in range(3)):
        prior = (theta - theta1) @ precision1 @ (theta - theta1) / 2
        assert fromp(theta).item() == pytest.approx(prior.item(), rel=1e-5)
    # so task 2 ends at the joint MAP (up to the jitter)
    theta2 = newton(lambda t: fromp(t) + (X2 @ t - y2).square().sum() / (2 * s2), theta1)
    X, y = torch.cat((X1, X2)), torch.cat((y1, y2))
    joint = torch.linalg.solve(
        X.T @ X / s2 + delta * torch.eye(d, dtype=torch.float64), X.T @ y / s2
    )
    assert torch.allclose(theta2, joint, atol=1e-5, rtol=0)


def test_fromp_logits_value_and_gradient_are_the_closed_form_of_the_stored_kernel() -> None:
    # Softmax regression with posterior N(W, s²I): the logits' covariance of x is s²‖x‖² I_K,
    # so K_j⁻¹ = I / (s²‖x_j‖² + ε), ε = 1e-6 · s² · mean‖x_j‖² over the kept examples.
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(K, D, generator=gen).double()
    x, y = torch.randn(20, D, generator=gen).double(), torch.randint(0, K, (20,), generator=gen)
    s = 0.3
    model, post = softmax_regression(W, scale=s, dtype=torch.float64)
    memory = MemorablePast(8, "lambda", "fromp_logits")
    chosen = memory.add_task(model, posterior=post, inputs=x, targets=y)
    variance = s**2 * x[chosen].square().sum(-1)
    jitter = 1e-6 * variance.mean()
    expected = torch.eye(K, dtype=torch.float64) / (variance + jitter)[:, None, None]
    assert torch.allclose(memory.kernel_inverse, expected, rtol=1e-10, atol=1e-12)
    f = (memory.outputs_old + torch.randn(8, K, generator=gen).double()).requires_grad_()
    value = memory.loss(f, data_size=50)
    value.backward()
    delta = (f - memory.outputs_old).detach()
    by_hand = sum(delta[j] @ expected[j] @ delta[j] / 2 for j in range(8)) / 50
    assert value.item() == pytest.approx(by_hand.item(), rel=1e-10)
    assert torch.allclose(f.grad, (expected @ delta[:, :, None])[:, :, 0] / 50, rtol=1e-10)


def memories(dtype: torch.dtype = torch.float64) -> dict[tuple[str, str], MemorablePast]:
    """A filled memory of every use and likelihood (fromp and fromp_logits on the constructed
    posterior; fromp refreshed)."""
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(K, D, generator=gen).to(dtype)
    x, labels = torch.randn(10, D, generator=gen).to(dtype), torch.randint(0, K, (10,))
    values = torch.randn(10, K, generator=gen).to(dtype)
    model, post = softmax_regression(W, scale=0.4, dtype=dtype)
    out = {}
    for use in USES:
        for likelihood, y, selection in (
            ("categorical", labels, "lambda"),
            ("gaussian", values, "random"),
        ):
            sigma2 = 1.0 if likelihood == "categorical" else 0.5
            memory = MemorablePast(6, selection, use, likelihood=likelihood, noise_variance=sigma2)
            memory.add_task(
                model,
                posterior=post,
                inputs=x,
                targets=y,
                generator=torch.Generator().manual_seed(0),
            )
            if use == "fromp":
                memory.refresh(model, posterior=post)
            out[use, likelihood] = memory
    return out


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("use", USES)
def test_gradients_equal_finite_differences(use: str, likelihood: str) -> None:
    memory = memories()[use, likelihood]
    gen = torch.Generator().manual_seed(6)
    f = torch.randn(6, K, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: memory.loss(f, data_size=7.0), (f,))
    if use == "fromp":  # its kernels couple the rows: every row at once
        with pytest.raises(ValueError, match="rows=None"):
            memory.loss(f[:3], 7.0, torch.tensor([4, 1, 4]))
        return
    rows = torch.tensor([4, 1, 4])
    g = torch.randn(3, K, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g: memory.loss(g, 7.0, rows), (g,))


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("use", USES)
def test_only_replay_pulls_at_the_old_model(use: str, likelihood: str) -> None:
    # no double counting: K-prior and both FROMPs have zero gradient at θ = θ_old
    memory = memories()[use, likelihood]
    f = memory.outputs_old.clone().requires_grad_()
    value = memory.loss(f, data_size=10)
    value.backward()
    if use == "replay":
        assert f.grad.abs().max() > 1e-3
    else:
        assert value.abs().item() < 1e-15 and f.grad.abs().max() < 1e-15


def test_kprior_s_gradient_is_the_likelihood_s_with_the_old_soft_labels() -> None:
    memory = memories()["kprior", "categorical"]
    f = torch.randn(6, K, dtype=torch.float64, requires_grad=True)
    memory.loss(f, data_size=9).backward()
    p_old = torch.softmax(memory.outputs_old, dim=-1)
    assert torch.allclose(f.grad, (torch.softmax(f, dim=-1) - p_old) / 9, atol=1e-15)


# ------------------------------------------------------------------- counting
def test_each_memory_example_counts_as_one_example_of_the_task() -> None:
    memory = memories()["kprior", "categorical"]
    M, N = len(memory), 40.0
    gen = torch.Generator().manual_seed(7)
    f = torch.randn(M, K, generator=gen, dtype=torch.float64)
    p_old = torch.softmax(memory.outputs_old, dim=-1)

    def r(j: int) -> float:  # KL(p_old ‖ softmax f_j), by hand
        q = torch.softmax(f[j], dim=-1)
        return sum(float(p_old[j, k] * math.log(p_old[j, k] / q[k])) for k in range(K))

    assert memory.loss(f, N).item() == pytest.approx(sum(r(j) for j in range(M)) / N, rel=1e-12)
    rows = torch.tensor([4, 1])  # a two-row minibatch stands for M / 2 times its sum
    by_hand = (M / 2) * (r(4) + r(1)) / N
    assert memory.loss(f[rows], N, rows).item() == pytest.approx(by_hand, rel=1e-12)
    # unbiased: the mean over the M one-row minibatches is the whole memory's value
    singles = [memory.loss(f[[j]], N, torch.tensor([j])) for j in range(M)]
    assert torch.stack(singles).mean().item() == pytest.approx(memory.loss(f, N).item(), rel=1e-12)


def test_replay_is_the_cross_entropy_of_the_rows_with_their_labels() -> None:
    memory = memories()["replay", "categorical"]
    gen = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(6, K, generator=gen, dtype=torch.float64), dim=-1)
    logits = q.log().requires_grad_()
    expected = -sum(math.log(q[i, memory.targets[i]]) for i in range(6)) / 20
    loss = memory.loss(logits, data_size=20)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()  # ∂R/∂logits = (softmax(logits) − onehot(y))/N
    onehot = nn.functional.one_hot(memory.targets, K)
    assert torch.allclose(logits.grad, (q - onehot) / 20, atol=1e-15)
    rows = torch.tensor([4, 0, 4])
    picked = -(6 / 3) * sum(math.log(q[i, memory.targets[i]]) for i in (4, 0, 4)) / 20
    assert memory.loss(q[rows].log(), 20, rows).item() == pytest.approx(picked, rel=1e-12)
    gaussian = memories()["replay", "gaussian"]
    f = torch.zeros(6, K, dtype=torch.float64)
    assert gaussian.loss(f, 2.0).item() == pytest.approx(
        gaussian.targets.square().sum().item() / (2 * 0.5) / 2, rel=1e-12
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, f: m.loss(f[:2], 5), "inputs\\[rows\\]"),
        (lambda m, f: m.loss(f[:, :2], 5), "inputs\\[rows\\]"),
        (lambda m, f: m.loss(f, 0), "data_size.*training-set size"),
        (lambda m, f: MemorablePast(3).loss(f, 5), "empty; add_task"),
    ],
)
def test_loss_refusals_name_the_fix(call: Callable, message: str) -> None:
    memory = memories()["kprior", "categorical"]
    with pytest.raises(ValueError, match=message):
        call(memory, torch.zeros(6, K, dtype=torch.float64))


# ---------------------------------------------------------------- state dicts
@pytest.mark.parametrize("use", USES)
def test_state_dict_save_and_load_round_trip(use: str, tmp_path: Path) -> None:
    x, y, _ = constructed_task()
    model, post = softmax_regression(torch.randn(K, D), scale=0.3)
    memory = MemorablePast(4, "sensitivity", use)
    generator = torch.Generator().manual_seed(3)
    memory.add_task(model, posterior=post, inputs=x, targets=y, generator=generator)
    memory.add_task(model, posterior=post, inputs=-x, targets=y, generator=generator)
    if use == "fromp":
        memory.refresh(model, posterior=post)
    path = tmp_path / "memory.pt"
    memory.save(path)
    loaded = MemorablePast.load(path)
    settings = (loaded.per_task, loaded.selection, loaded.use, loaded.likelihood)
    assert settings == (4, "sensitivity", use, "categorical") and loaded.num_tasks == 2
    for name in ("inputs", "targets", "tasks", "scores", "outputs_old", "kernel_inverse"):
        assert torch.equal(getattr(loaded, name), getattr(memory, name)), name
    assert (memory.kernel_inverse.shape == (8, K, K)) == (use == "fromp_logits")
    assert len(loaded.task_kernel_inverse) == (2 if use == "fromp" else 0)
    for a, b in zip(loaded.task_kernel_inverse, memory.task_kernel_inverse, strict=True):
        assert a.shape == (K, 4, 4) and torch.equal(a, b)
    logits = torch.randn(8, K)
    assert torch.equal(loaded.loss(logits, 10), memory.loss(logits, 10))
    again = MemorablePast(4, "sensitivity", use)
    again.load_state_dict(memory.state_dict())
    assert torch.equal(again.inputs, memory.inputs)
    with pytest.raises(ValueError, match="per_task=4"):
        MemorablePast(5, "sensitivity", use).load_state_dict(memory.state_dict())
    with pytest.raises(ValueError, match="selection='sensitivity'"):
        MemorablePast(4, "random", use).load_state_dict(memory.state_dict())
    other = "replay" if use != "replay" else "kprior"
    with pytest.raises(ValueError, match=f"use='{use}'"):
        MemorablePast(4, "sensitivity", other).load_state_dict(memory.state_dict())
    with pytest.raises(ValueError, match="missing"):
        again.load_state_dict({"per_task": 4, "selection": "sensitivity"})
    gaussian = memories()[use, "gaussian"]
    back = MemorablePast.from_state_dict(gaussian.state_dict())
    assert (back.likelihood, back.noise_variance) == ("gaussian", 0.5)
    assert torch.equal(back.kernel_inverse, gaussian.kernel_inverse)
    assert len(back.task_kernel_inverse) == len(gaussian.task_kernel_inverse)


# ------------------------------------------------------------ BLR posteriors
def test_an_optimizer_is_read_as_its_posterior() -> None:
    torch.manual_seed(0)
    x, y, _ = constructed_task()
    model = nn.Linear(D, K, bias=False)
    optimizer = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.1, data_size=30)
    memory = MemorablePast(5, "sensitivity")
    chosen = memory.add_task(model, posterior=optimizer, inputs=x, targets=y)
    post = optimizer.posterior(model)
    assert torch.equal(memory.scores, lgb.sensitivity(model, post, x, y)[chosen])


def test_lie_group_blr_optimizers_give_fromp_logits_its_kernel() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(40, D), torch.randint(0, K, (40,))
    model = nn.Linear(D, K)
    affine = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.1, data_size=40)
    memory = MemorablePast(6, "lambda", "fromp_logits")
    chosen = memory.add_task(
        model, posterior=affine, inputs=x, targets=y
    )  # method auto: the Jacobian form
    V = lgb.memory_maps.prediction_variance(model, affine, x[chosen], cross_class=True).double()
    V = V + 1e-6 * V.diagonal(dim1=-2, dim2=-1).mean() * torch.eye(K, dtype=torch.float64)
    identity = torch.eye(K, dtype=torch.float64).expand(6, K, K)
    assert torch.allclose(memory.kernel_inverse.double() @ V, identity, atol=1e-4)

    model = nn.Linear(D, K)
    multiplicative = lgb.MultiplicativeBLR(model.parameters(), lr=0.1, data_size=40, init="auto")
    memory = MemorablePast(6, "sensitivity", "fromp_logits")  # the Monte Carlo kernel
    memory.add_task(
        model,
        posterior=multiplicative,
        inputs=x,
        targets=y,
        samples=16,
        generator=torch.Generator(),
    )
    kinv = memory.kernel_inverse
    assert kinv.shape == (6, K, K) and torch.isfinite(kinv).all()
    assert torch.linalg.eigvalsh(kinv.double()).min() > 0  # positive definite
    f = memory.outputs_old.clone().requires_grad_()
    memory.loss(f, 40).backward()
    assert f.grad.abs().max() == 0  # the point estimate's own outputs: no pull


# -------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0,), {}, "per_task"),
        ((2.5,), {}, "per_task"),
        ((3, "loss"), {}, "selection"),
        ((3, "random", "ewc"), {}, "use"),
        ((3,), {"likelihood": "poisson"}, "likelihood"),
        ((3, "random"), {"likelihood": "gaussian", "noise_variance": 0.0}, "noise_variance"),
        ((3,), {"noise_variance": 2.0}, "noise_variance: only the Gaussian"),
        ((3, "lambda"), {"likelihood": "gaussian"}, "use selection='random'"),
    ],
)
def test_refusals_name_the_argument(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemorablePast(*args, **kwargs)


@pytest.mark.parametrize(
    ("selection", "use", "message"),
    [
        ("sensitivity", "kprior", "use selection='lambda'"),
        ("lambda", "fromp_logits", "use use='fromp'"),
    ],
)
def test_a_missing_posterior_is_refused_with_the_fix(
    selection: str, use: str, message: str
) -> None:
    x, y, _ = constructed_task()
    model, _ = softmax_regression(torch.zeros(K, D), scale=0.3)
    with pytest.raises(ValueError, match=message):
        MemorablePast(3, selection, use).add_task(model, posterior=None, inputs=x, targets=y)
    with pytest.raises(ValueError, match="labels must lie in"):
        MemorablePast(3, "random").add_task(model, posterior=None, inputs=x, targets=y + 5)


# ----------------------------------------------- FROMP as its code defines it
def linear_softmax(gen: torch.Generator) -> nn.Linear:
    """nn.Linear(D, K) in float64 with random weight and bias."""
    model = nn.Linear(D, K).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(K, D, generator=gen))
        model.bias.copy_(torch.randn(K, generator=gen))
    return model


def hand_jacobians(model: nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """Per class c, ``[n, K·D + K]`` the Jacobian of p_c = softmax(Wx + b)_c in (W, b), by
    its closed form ∂p_c/∂f_k = p_c(δ_ck − p_k), ∂f_k/∂W_kd = x_d, ∂f_k/∂b_k = 1."""
    with torch.no_grad():
        p = torch.softmax(model(x), dim=-1)
    eye = torch.eye(K, dtype=x.dtype)
    out = []
    for c in range(K):
        a = p[:, c : c + 1] * (eye[c] - p)  # [n, K] ∂p_c/∂f
        out.append(torch.cat([(a[:, :, None] * x[:, None, :]).flatten(1), a], dim=1))
    return out


def hand_kernel_inverse(model: nn.Linear, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[K, n, n]`` (J_c diag(s) J_cᵀ + 1e-5·I)⁻¹, s the variances of (W, b) flattened."""
    eye = torch.eye(len(x), dtype=x.dtype)
    return torch.stack(
        [torch.linalg.inv(J @ torch.diag(s) @ J.T + 1e-5 * eye) for J in hand_jacobians(model, x)]
    )


def flat(variances: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([variances["weight"].flatten(), variances["bias"]])


def fromp_memory(per_task: int = 5) -> tuple[MemorablePast, nn.Linear, dict, list]:
    """A "fromp" memory of two tasks of a linear softmax model (random selection), not yet
    refreshed; the model, a diagonal covariance and the two tasks' inputs."""
    gen = torch.Generator().manual_seed(11)
    model = linear_softmax(gen)
    variances = {
        "weight": torch.rand(K, D, generator=gen).double(),
        "bias": torch.rand(K, generator=gen).double(),
    }
    memory = MemorablePast(per_task, "random", "fromp")
    xs = [torch.randn(12, D, generator=gen).double() for _ in range(2)]
    for x in xs:
        memory.add_task(
            model, inputs=x, targets=torch.randint(0, K, (12,), generator=gen), generator=gen
        )
    return memory, model, variances, xs


def test_fromp_kernels_are_per_class_jsigmajt_plus_the_jitter_per_task() -> None:
    memory, model, variances, _ = fromp_memory()
    assert memory.kernel_inverse.numel() == 0 and memory.task_kernel_inverse == []
    memory.refresh(model, covariance=variances)
    assert FROMP_JITTER == 1e-5 and len(memory.task_kernel_inverse) == 2
    for t in range(2):
        x = memory.inputs[memory.tasks == t]
        expected = hand_kernel_inverse(model, x, flat(variances))
        got = memory.task_kernel_inverse[t]
        assert got.shape == (K, 5, 5)
        assert torch.allclose(got, expected, rtol=1e-9, atol=1e-9)
        kernel = torch.linalg.inv(got[0])  # cross-example terms kept: not diagonal
        assert (kernel - torch.diag(kernel.diagonal())).abs().max() > 1e-3 * kernel.diagonal().max()
    # a zero covariance leaves the jitter alone: K = 1e-5·I; another jitter is taken as given
    zero = {n: torch.zeros_like(v) for n, v in variances.items()}
    memory.refresh(model, covariance=zero)
    assert torch.allclose(
        memory.task_kernel_inverse[1], 1e5 * torch.eye(5, dtype=torch.float64).expand(K, 5, 5)
    )
    memory.refresh(model, covariance=zero, jitter=0.5)
    assert torch.allclose(
        memory.task_kernel_inverse[0], 2 * torch.eye(5, dtype=torch.float64).expand(K, 5, 5)
    )
    # a parameter left out of the covariance is held fixed: only the bias columns of J
    memory.refresh(model, covariance={"bias": variances["bias"]})
    x = memory.inputs[memory.tasks == 0]
    s = torch.cat([torch.zeros(K * D, dtype=torch.float64), variances["bias"]])
    assert torch.allclose(
        memory.task_kernel_inverse[0], hand_kernel_inverse(model, x, s), rtol=1e-9
    )


def test_fromp_loss_and_its_gradient_are_fromp_s_objective_over_n() -> None:
    memory, model, variances, _ = fromp_memory()
    memory.refresh(model, covariance=variances)
    p_old = torch.softmax(model(memory.inputs), dim=-1).detach()
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():  # move the weights: the objective is no longer at its minimum
        model.weight.add_(0.3 * torch.randn(K, D, generator=gen).double())
    model.zero_grad()
    value = memory.loss(model(memory.inputs), data_size=40)
    value.backward()
    p = torch.softmax(model(memory.inputs), dim=-1).detach()
    by_hand, grad = 0.0, torch.zeros(K * D + K, dtype=torch.float64)
    for t in range(2):
        rows = memory.tasks == t
        J = hand_jacobians(model, memory.inputs[rows])
        for c in range(K):
            delta = (p - p_old)[rows, c]
            K_inv = memory.task_kernel_inverse[t][c]
            by_hand += float(delta @ K_inv @ delta) / 2
            grad += J[c].T @ K_inv @ delta  # FROMP's code's gradient, Σ Jᵀ K⁻¹ Δ
    assert by_hand > 1e-3
    assert value.item() == pytest.approx(by_hand / 40, rel=1e-10)
    autograd = torch.cat([model.weight.grad.flatten(), model.bias.grad])
    assert torch.allclose(autograd, grad / 40, rtol=1e-8, atol=1e-14)


def test_fromp_has_zero_gradient_at_the_refresh_point() -> None:
    memory, model, variances, _ = fromp_memory()
    memory.refresh(model, covariance=variances)
    value = memory.loss(model(memory.inputs), data_size=10)
    value.backward()
    assert value.item() < 1e-25
    assert model.weight.grad.abs().max() < 1e-14 and model.bias.grad.abs().max() < 1e-14


def test_refresh_recomputes_targets_and_kernels_of_every_task_from_the_current_weights() -> None:
    memory, model, variances, _ = fromp_memory()
    with pytest.raises(ValueError, match="2 task\\(s\\) added since the last refresh"):
        memory.loss(model(memory.inputs), 10)
    memory.refresh(model, covariance=variances)
    first = [k.clone() for k in memory.task_kernel_inverse]
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        model.weight.add_(torch.randn(K, D, generator=gen).double())
    x3 = torch.randn(12, D, generator=gen).double()
    memory.add_task(model, inputs=x3, targets=torch.randint(0, K, (12,), generator=gen))
    with pytest.raises(ValueError, match="1 task\\(s\\) added since the last refresh"):
        memory.loss(model(memory.inputs), 10)
    memory.refresh(model, covariance=variances)
    assert len(memory.task_kernel_inverse) == 3
    assert torch.allclose(memory.outputs_old, model(memory.inputs).detach(), atol=1e-12)
    for t in range(3):  # every task's kernel at the new weights, none at the old
        expected = hand_kernel_inverse(model, memory.inputs[memory.tasks == t], flat(variances))
        assert torch.allclose(memory.task_kernel_inverse[t], expected, rtol=1e-9, atol=1e-9)
        if t < 2:
            assert not torch.allclose(memory.task_kernel_inverse[t], first[t], rtol=1e-3)
    # a refresh with another covariance changes the kernels, not the targets
    targets = memory.outputs_old.clone()
    memory.refresh(model, covariance={n: 2 * v for n, v in variances.items()})
    assert torch.equal(memory.outputs_old, targets)
    assert not torch.allclose(memory.task_kernel_inverse[0], expected, rtol=1e-3)


def test_fromp_sigma_from_a_posterior_is_its_variance_over_the_temperature() -> None:
    gen = torch.Generator().manual_seed(14)
    W, variance = (
        torch.randn(K, D, generator=gen).double(),
        torch.rand(K, D, generator=gen).double(),
    )
    model = linear_model(W)
    x, y = torch.randn(12, D, generator=gen).double(), torch.randint(0, K, (12,), generator=gen)
    post = diagonal_gaussian(W, variance)
    memories_ = [MemorablePast(6, "lambda", "fromp") for _ in range(4)]
    for memory in memories_:
        memory.add_task(model, inputs=x, targets=y)
    memories_[0].refresh(model, posterior=post, temperature=1.0)
    memories_[1].refresh(model, covariance={"weight": variance})
    memories_[2].refresh(model, posterior=post, temperature=4.0)
    memories_[3].refresh(model, covariance={"weight": variance / 4})
    assert torch.allclose(
        memories_[0].task_kernel_inverse[0], memories_[1].task_kernel_inverse[0], rtol=1e-12
    )
    assert torch.allclose(
        memories_[2].task_kernel_inverse[0], memories_[3].task_kernel_inverse[0], rtol=1e-12
    )
    assert not torch.allclose(
        memories_[0].task_kernel_inverse[0], memories_[2].task_kernel_inverse[0], rtol=1e-3
    )
    # a BLR optimizer is read as its posterior
    torch.manual_seed(0)
    net = nn.Linear(D, K)
    opt = lgb.AffineBLR(net.parameters(), lr=0.1, scale_lr=0.1, data_size=30)
    a, b = MemorablePast(4, "lambda", "fromp"), MemorablePast(4, "lambda", "fromp")
    for memory in (a, b):
        memory.add_task(net, inputs=x.float(), targets=y)
    a.refresh(net, posterior=opt)
    b.refresh(net, posterior=opt.posterior(net))
    assert torch.equal(a.task_kernel_inverse[0], b.task_kernel_inverse[0])


def test_fromp_scores_each_task_on_its_head() -> None:
    # six outputs, two heads of three: task 0 on columns 0-2, task 1 on columns 3-5
    gen = torch.Generator().manual_seed(15)
    net = nn.Linear(D, 2 * K).double()
    columns = [torch.arange(K), torch.arange(K, 2 * K)]
    memory = MemorablePast(4, "random", "fromp")
    for t in range(2):
        x = torch.randn(10, D, generator=gen).double()
        head = nn.Sequential(net, Columns(columns[t]))
        memory.add_task(
            head, inputs=x, targets=torch.randint(0, K, (10,), generator=gen), generator=gen
        )
    variances = {n: torch.rand(p.shape, generator=gen).double() for n, p in net.named_parameters()}
    memory.refresh(net, covariance=variances, head=lambda f, t: f[:, columns[t]])
    for t in range(2):
        rows = memory.tasks == t
        sub = nn.Linear(D, K).double()  # the head's own linear model: rows columns[t] of net
        with torch.no_grad():
            sub.weight.copy_(net.weight[columns[t]])
            sub.bias.copy_(net.bias[columns[t]])
        s = torch.cat([variances["weight"][columns[t]].flatten(), variances["bias"][columns[t]]])
        expected = hand_kernel_inverse(sub, memory.inputs[rows], s)
        assert torch.allclose(memory.task_kernel_inverse[t], expected, rtol=1e-9, atol=1e-9)
        assert torch.allclose(
            memory.outputs_old[rows], net(memory.inputs[rows])[:, columns[t]].detach()
        )
    with pytest.raises(ValueError, match="head: gives task 0 6 outputs"):
        memory.refresh(net, covariance=variances)


class Columns(nn.Module):
    def __init__(self, columns: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("columns", columns)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return f[:, self.columns]


def test_fromp_state_round_trips_and_the_old_fromp_state_is_refused(tmp_path: Path) -> None:
    memory, model, variances, _ = fromp_memory()
    memory.refresh(model, covariance=variances)
    memory.save(tmp_path / "memory.pt")
    loaded = MemorablePast.load(tmp_path / "memory.pt")
    assert loaded.use == "fromp" and len(loaded.task_kernel_inverse) == 2
    for a, b in zip(loaded.task_kernel_inverse, memory.task_kernel_inverse, strict=True):
        assert torch.equal(a, b)
    f = model(memory.inputs).detach() + 0.1
    assert torch.equal(loaded.loss(f, 10), memory.loss(f, 10))
    # a state of the old code's use="fromp": per-example [M, K, K] kernels, no per-task ones
    old = memories()["fromp_logits", "categorical"].state_dict()
    del old["task_kernel_inverse"]
    old["use"] = "fromp"
    with pytest.raises(ValueError, match="now use='fromp_logits'"):
        MemorablePast.from_state_dict(old)
    with pytest.raises(ValueError, match="now use='fromp_logits'"):
        MemorablePast(6, "lambda", "fromp").load_state_dict(old)
    old["use"] = "fromp_logits"  # the fix the message names
    assert MemorablePast.from_state_dict(old).kernel_inverse.shape == (6, K, K)
    kprior = memories()["kprior", "categorical"].state_dict()  # older states of other uses load
    del kprior["task_kernel_inverse"]
    assert MemorablePast.from_state_dict(kprior).task_kernel_inverse == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, model, v: m.refresh(model, v), "refresh: takes the model, then keywords"),
        (lambda m, model, v: m.refresh(model), "posterior, covariance: pass exactly one"),
        (
            lambda m, model, v: m.refresh(
                model, covariance=v, posterior=diagonal_gaussian(model.weight.detach(), v["weight"])
            ),
            "posterior, covariance: pass exactly one",
        ),
        (
            lambda m, model, v: m.refresh(model, covariance={"w": v["bias"]}),
            "covariance: 'w' is not a parameter",
        ),
        (
            lambda m, model, v: m.refresh(model, covariance={"bias": v["weight"]}),
            "covariance: 'bias' has shape",
        ),
        (
            lambda m, model, v: m.refresh(model, covariance={"bias": -v["bias"]}),
            "covariance: 'bias' holds a negative",
        ),
        (lambda m, model, v: m.refresh(model, covariance={}), "covariance: empty"),
        (
            lambda m, model, v: m.refresh(model, covariance=v, jitter=0.0),
            "jitter: must be a number > 0",
        ),
        (
            lambda m, model, v: MemorablePast(3, use="fromp").refresh(model, covariance=v),
            "memory: empty",
        ),
        (
            lambda m, model, v: MemorablePast(3).refresh(model, covariance=v),
            "only use='fromp' refreshes",
        ),
        (lambda m, model, v: m.loss(model(m.inputs)[:4], 10, torch.arange(4)), "rows=None"),
    ],
)
def test_fromp_refusals_name_the_argument(call: Callable, message: str) -> None:
    memory, model, variances, _ = fromp_memory()
    if "rows" in message:
        memory.refresh(model, covariance=variances)
    with pytest.raises((ValueError, TypeError), match=message):
        call(memory, model, variances)
