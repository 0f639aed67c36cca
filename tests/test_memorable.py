"""The memorable past against known answers.

A softmax regression without bias whose posterior mean is 0 predicts the uniform distribution
for every input, and its prediction variance is proportional to ‖x‖² (the Jacobian of the
logits is x): an input of 0 has no variance and scores exactly 0, and among inputs c·u the
score grows with c. So the memorable examples of the constructed task are known, and in
which order, whatever the score's form (probabilities or logits, diagonal or cross-class).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.groups import DiagonalAffineGroup
from liegroup_blr.memorable import MemorablePast
from liegroup_blr.posterior import Posterior, PosteriorEntry
from liegroup_blr.predictive import predictive_log_probs

K, D = 3, 4


def softmax_regression(mean: torch.Tensor, scale: float) -> tuple[nn.Module, Posterior]:
    """nn.Linear(D, K, bias=False) and the diagonal-affine posterior N(mean, scale²) of its
    weight (A = 1, base N(0, scale²))."""
    model = nn.Linear(D, K, bias=False)
    element = torch.stack((torch.ones(K, D), mean))
    entry = PosteriorEntry(element, DiagonalAffineGroup(), Normal(0.0, scale), torch.Size((K, D)))
    return model, Posterior({"weight": entry})


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


def test_sensitivity_selection_keeps_the_examples_known_to_score_highest_in_order() -> None:
    x, y, rows = constructed_task()
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    for per_task in (5, 3):
        memory = MemorablePast(per_task)
        chosen = memory.add_task(model, post, x, y, samples=4)
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
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    memory = MemorablePast(5, selection="random")
    chosen = memory.add_task(model, post, x, y, generator=torch.Generator().manual_seed(7))
    # nothing is scored: the choice is the generator's first permutation
    expected = torch.randperm(30, generator=torch.Generator().manual_seed(7))[:5]
    assert torch.equal(chosen, expected)
    assert torch.equal(memory.inputs, x[expected]) and torch.all(memory.scores.isnan())


def test_stored_predictions_are_the_posterior_predictive() -> None:
    """A posterior of negligible width predicts softmax(W x) at its mean; a zero input gets the
    uniform distribution from every sample."""
    x, y, _ = constructed_task()
    mean = torch.randn(K, D, generator=torch.Generator().manual_seed(1))
    model, post = softmax_regression(mean, scale=1e-7)
    before = model.weight.detach().clone()
    memory = MemorablePast(30)
    chosen = memory.add_task(model, post, x, y, samples=3)
    expected = torch.softmax(x[chosen] @ mean.T, dim=-1)
    assert torch.allclose(memory.probabilities, expected, atol=1e-5)
    zero = (x[chosen] == 0).all(1)
    assert torch.allclose(memory.probabilities[zero], torch.full((int(zero.sum()), K), 1 / K))
    assert torch.equal(model.weight, before)  # the model's own values are back
    # a wide posterior: the model average of lgb.predictive over the same draws
    model, post = softmax_regression(mean, scale=3.0)
    torch.manual_seed(2)
    wide = MemorablePast(30)
    chosen = wide.add_task(model, post, x, y, samples=16)  # the Jacobian form draws nothing
    torch.manual_seed(2)
    average = predictive_log_probs(model, [x[chosen]], post, samples=16).exp()
    assert torch.allclose(wide.probabilities, average, atol=1e-6)
    assert not torch.allclose(wide.probabilities, expected, atol=1e-2)


def test_tasks_are_appended_with_their_index() -> None:
    x, y, rows = constructed_task()
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    memory = MemorablePast(2)
    memory.add_task(model, post, x, y)
    memory.add_task(model, post, 2 * x, y)
    assert len(memory) == 4 and memory.num_tasks == 2
    assert memory.tasks.tolist() == [0, 0, 1, 1]
    assert torch.equal(memory.inputs[2:], 2 * x[rows[:2]])
    narrow = nn.Linear(D, 2, bias=False)  # a head of another width
    element = torch.stack((torch.ones(2, D), torch.zeros(2, D)))
    entry = PosteriorEntry(element, DiagonalAffineGroup(), Normal(0.0, 0.3), torch.Size((2, D)))
    with pytest.raises(ValueError, match="same number of classes"):
        memory.add_task(narrow, Posterior({"weight": entry}), x, y % 2)


def with_predictions(probabilities: torch.Tensor) -> MemorablePast:
    """A memory holding the given stored predictions (inputs and labels immaterial)."""
    n = len(probabilities)
    return MemorablePast.from_state_dict(
        {
            "per_task": n,
            "selection": "sensitivity",
            "num_tasks": 1,
            "inputs": torch.zeros(n, D),
            "targets": probabilities.argmax(-1),
            "tasks": torch.zeros(n, dtype=torch.long),
            "probabilities": probabilities,
            "scores": torch.ones(n),
        }
    )


def test_penalty_is_the_mean_kl_from_the_stored_predictions() -> None:
    memory = with_predictions(torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]]))
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1], [0.2, 0.8]])
    logits = q.log().requires_grad_()
    kl = [
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
        math.log(1 / 0.9),  # 0 · log 0 = 0
        0.0,
    ]
    penalty = memory.penalty(logits)
    assert penalty.item() == pytest.approx(sum(kl) / 3, rel=1e-6)
    penalty.backward()  # ∂R/∂logits = (softmax(logits) − p̄)/|B|
    assert torch.allclose(logits.grad, (q - memory.probabilities) / 3, atol=1e-7)
    rows = torch.tensor([2, 0])
    assert memory.penalty(q[rows].log(), rows).item() == pytest.approx(
        (kl[2] + kl[0]) / 2, rel=1e-6
    )
    assert memory.penalty(memory.probabilities.clamp_min(1e-30).log()).item() == pytest.approx(
        0.0, abs=1e-6
    )
    underflow = torch.tensor([[0.0, -math.inf], [-math.inf, 0.0], [0.0, -math.inf]])
    assert math.isinf(memory.penalty(underflow).item())  # q = 0 where p > 0
    assert memory.penalty(underflow[[0, 0]], torch.tensor([1, 1])).item() == 0.0  # p = q = (1, 0)
    with pytest.raises(ValueError, match="inputs\\[rows\\]"):
        memory.penalty(logits[:2])
    with pytest.raises(ValueError, match="empty"):
        MemorablePast(3).penalty(logits)


def test_state_dict_save_and_load_round_trip(tmp_path: Path) -> None:
    x, y, _ = constructed_task()
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    memory = MemorablePast(4)
    generator = torch.Generator().manual_seed(3)
    memory.add_task(model, post, x, y, generator=generator)
    memory.add_task(model, post, -x, y, generator=generator)
    path = tmp_path / "memory.pt"
    memory.save(path)
    loaded = MemorablePast.load(path)
    assert (loaded.per_task, loaded.selection, loaded.num_tasks) == (4, "sensitivity", 2)
    for name in ("inputs", "targets", "tasks", "probabilities", "scores"):
        assert torch.equal(getattr(loaded, name), getattr(memory, name)), name
    logits = torch.randn(8, K)
    assert torch.equal(loaded.penalty(logits), memory.penalty(logits))
    again = MemorablePast(4)
    again.load_state_dict(memory.state_dict())
    assert torch.equal(again.probabilities, memory.probabilities)
    with pytest.raises(ValueError, match="per_task=4"):
        MemorablePast(5).load_state_dict(memory.state_dict())
    with pytest.raises(ValueError, match="selection='sensitivity'"):
        MemorablePast(4, selection="random").load_state_dict(memory.state_dict())
    with pytest.raises(ValueError, match="missing"):
        again.load_state_dict({"per_task": 4, "selection": "sensitivity"})


def test_an_optimizer_is_read_as_its_posterior() -> None:
    torch.manual_seed(0)
    x, y, _ = constructed_task()
    model = nn.Linear(D, K, bias=False)
    optimizer = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.1, data_size=30)
    memory = MemorablePast(5)
    chosen = memory.add_task(model, optimizer, x, y)
    post = optimizer.posterior(model)
    assert torch.equal(memory.scores, lgb.sensitivity(model, post, x, y)[chosen])


@pytest.mark.parametrize(
    ("args", "message"),
    [((0,), "per_task"), ((2.5,), "per_task"), ((3, "loss"), "selection")],
)
def test_refusals_name_the_argument(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemorablePast(*args)
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    x, y, _ = constructed_task()
    with pytest.raises(ValueError, match="samples"):
        MemorablePast(3).add_task(model, post, x, y, samples=0)
