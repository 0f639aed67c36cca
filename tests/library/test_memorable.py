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
        chosen = memory.add_task(model, post, x, y)
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


def test_tasks_are_appended_with_their_index() -> None:
    x, y, rows = constructed_task()
    model, post = softmax_regression(torch.zeros(K, D), scale=0.3)
    memory = MemorablePast(2)
    memory.add_task(model, post, x, y)
    memory.add_task(model, post, 2 * x, y)
    assert len(memory) == 4 and memory.num_tasks == 2
    assert memory.tasks.tolist() == [0, 0, 1, 1]
    assert torch.equal(memory.inputs[2:], 2 * x[rows[:2]])
    assert torch.equal(memory.targets, y[rows[:2] + rows[:2]])


def test_replay_loss_is_the_mean_cross_entropy_of_the_rows_with_their_labels() -> None:
    x, y, _ = constructed_task()
    memory = MemorablePast(30, selection="random")
    memory.add_task(nn.Identity(), None, x, y, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(torch.randn(30, K, generator=torch.Generator().manual_seed(1)), dim=-1)
    logits = q.log().requires_grad_()
    expected = -sum(math.log(q[i, memory.targets[i]]) for i in range(30)) / 30
    loss = memory.loss(logits)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()  # ∂R/∂logits = (softmax(logits) − onehot(y))/|B|
    onehot = nn.functional.one_hot(memory.targets, K)
    assert torch.allclose(logits.grad, (q - onehot) / 30, atol=1e-7)
    rows = torch.tensor([4, 0, 4])
    picked = -sum(math.log(q[i, memory.targets[i]]) for i in (4, 0, 4)) / 3
    assert memory.loss(q[rows].log(), rows).item() == pytest.approx(picked, rel=1e-6)
    with pytest.raises(ValueError, match="inputs\\[rows\\]"):
        memory.loss(logits[:2])
    with pytest.raises(ValueError, match="empty"):
        MemorablePast(3).loss(logits)


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
    for name in ("inputs", "targets", "tasks", "scores"):
        assert torch.equal(getattr(loaded, name), getattr(memory, name)), name
    logits = torch.randn(8, K)
    assert torch.equal(loaded.loss(logits), memory.loss(logits))
    again = MemorablePast(4)
    again.load_state_dict(memory.state_dict())
    assert torch.equal(again.inputs, memory.inputs)
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
