"""The memorable past against known answers.

A softmax regression without bias whose posterior mean is 0 predicts the uniform distribution
for every input, and its prediction variance is proportional to ‖x‖² (the Jacobian of the
logits is x): an input of 0 has no variance and scores exactly 0, and among inputs c·u the
score grows with c. So the memorable examples of the constructed task are known, and in
which order, whatever the score's form (probabilities or logits, diagonal or cross-class).

The regularisers are checked against closed forms: the K-prior is exact for generalised
linear models (linear and multinomial logistic regression end at the joint MAP of two
tasks), FROMP's per-example kernel is exact where the joint kernel is diagonal, and both have
zero gradient at the old model (no double counting); replay is the control that fails these.
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
from liegroup_blr.memorable import MemorablePast
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


def test_fromp_equals_the_weight_space_prior_where_its_kernel_is_exact() -> None:
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
    memory = MemorablePast(d, "random", "fromp", likelihood="gaussian", noise_variance=s2)
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


def test_fromp_value_and_gradient_are_the_closed_form_of_the_stored_kernel() -> None:
    # Softmax regression with posterior N(W, s²I): the logits' covariance of x is s²‖x‖² I_K,
    # so K_j⁻¹ = I / (s²‖x_j‖² + ε), ε = 1e-6 · s² · mean‖x_j‖² over the kept examples.
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(K, D, generator=gen).double()
    x, y = torch.randn(20, D, generator=gen).double(), torch.randint(0, K, (20,), generator=gen)
    s = 0.3
    model, post = softmax_regression(W, scale=s, dtype=torch.float64)
    memory = MemorablePast(8, "lambda", "fromp")
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
    """A filled memory of every use and likelihood (fromp on the constructed posterior)."""
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(K, D, generator=gen).to(dtype)
    x, labels = torch.randn(10, D, generator=gen).to(dtype), torch.randint(0, K, (10,))
    values = torch.randn(10, K, generator=gen).to(dtype)
    model, post = softmax_regression(W, scale=0.4, dtype=dtype)
    out = {}
    for use in ("kprior", "fromp", "replay"):
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
            out[use, likelihood] = memory
    return out


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("use", ["kprior", "fromp", "replay"])
def test_gradients_equal_finite_differences(use: str, likelihood: str) -> None:
    memory = memories()[use, likelihood]
    gen = torch.Generator().manual_seed(6)
    f = torch.randn(6, K, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: memory.loss(f, data_size=7.0), (f,))
    rows = torch.tensor([4, 1, 4])
    g = torch.randn(3, K, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g: memory.loss(g, 7.0, rows), (g,))


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
@pytest.mark.parametrize("use", ["kprior", "fromp", "replay"])
def test_only_replay_pulls_at_the_old_model(use: str, likelihood: str) -> None:
    # no double counting: K-prior and FROMP have zero gradient at θ = θ_old
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
@pytest.mark.parametrize("use", ["kprior", "fromp", "replay"])
def test_state_dict_save_and_load_round_trip(use: str, tmp_path: Path) -> None:
    x, y, _ = constructed_task()
    model, post = softmax_regression(torch.randn(K, D), scale=0.3)
    memory = MemorablePast(4, "sensitivity", use)
    generator = torch.Generator().manual_seed(3)
    memory.add_task(model, posterior=post, inputs=x, targets=y, generator=generator)
    memory.add_task(model, posterior=post, inputs=-x, targets=y, generator=generator)
    path = tmp_path / "memory.pt"
    memory.save(path)
    loaded = MemorablePast.load(path)
    settings = (loaded.per_task, loaded.selection, loaded.use, loaded.likelihood)
    assert settings == (4, "sensitivity", use, "categorical") and loaded.num_tasks == 2
    for name in ("inputs", "targets", "tasks", "scores", "outputs_old", "kernel_inverse"):
        assert torch.equal(getattr(loaded, name), getattr(memory, name)), name
    assert (memory.kernel_inverse.shape == (8, K, K)) == (use == "fromp")
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


def test_lie_group_blr_optimizers_give_fromp_its_kernel() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(40, D), torch.randint(0, K, (40,))
    model = nn.Linear(D, K)
    affine = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.1, data_size=40)
    memory = MemorablePast(6, "lambda", "fromp")
    chosen = memory.add_task(
        model, posterior=affine, inputs=x, targets=y
    )  # method auto: the Jacobian form
    V = lgb.memory.prediction_variance(model, affine, x[chosen], cross_class=True).double()
    V = V + 1e-6 * V.diagonal(dim1=-2, dim2=-1).mean() * torch.eye(K, dtype=torch.float64)
    identity = torch.eye(K, dtype=torch.float64).expand(6, K, K)
    assert torch.allclose(memory.kernel_inverse.double() @ V, identity, atol=1e-4)

    model = nn.Linear(D, K)
    multiplicative = lgb.MultiplicativeBLR(model.parameters(), lr=0.1, data_size=40, init="auto")
    memory = MemorablePast(6, "sensitivity", "fromp")  # the Monte Carlo kernel
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
    [("sensitivity", "kprior", "use selection='lambda'"), ("lambda", "fromp", "use use='kprior'")],
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
