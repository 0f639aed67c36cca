"""What a posterior carries to its consumers, and the API around it.

A :class:`~liegroup_blr.Posterior` records the temperature τ (and the data size N) it was
trained at, so the memory-map scores, the leave-one-out NLL and FROMP's kernel computed from
it, saved and reloaded or not, are those computed from the optimizer, bit for bit; a
version-1 file (no τ) loads with a warning. ``next_task(model=...)`` keys the prior by name,
``add_task`` takes keywords after the model, a Gaussian memory has a default selection, and
``data_size`` is keyword-only in every optimizer.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr import posterior_io
from liegroup_blr.groups import AdditiveGroup
from liegroup_blr.memorable import MemorablePast
from liegroup_blr.memory_maps import loo_nll, memory_map, prediction_variance
from liegroup_blr.posterior import Posterior
from tests.shared import closure_for

TAU, N = 0.1, 32


def trained(rule: str, temperature: float = TAU) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small classifier trained 3 steps at ``temperature``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = data()
    params = model.parameters()
    if rule == "affine":
        opt = lgb.AffineBLR(
            params, lr=0.1, scale_lr=0.05, data_size=N, temperature=temperature, seed=0
        )
    else:
        opt = lgb.MultiplicativeBLR(
            params, lr=1.0, data_size=N, temperature=temperature, init="auto", seed=0
        )

    for _ in range(3):
        opt.step(closure_for(opt, model, x, y))
    return model, opt


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=gen), torch.randint(0, 3, (N,), generator=gen)


def reloaded(post: Posterior, path: Path, **kw) -> Posterior:
    post.save(path)
    return Posterior.load(path, **kw)


def version_1(state_dict: dict) -> dict:
    """A state dict as version 1 wrote it: no temperature, no data size."""
    old = {k: v for k, v in state_dict.items() if k not in ("temperature", "data_size")}
    return {**old, "version": 1}


# ------------------------------------------------------------------ item 6: what it carries
def test_a_posterior_records_the_temperature_and_data_size_of_its_optimizer(tmp_path) -> None:
    model, opt = trained("affine")
    post = opt.posterior(model)
    assert (post.temperature, post.data_size) == (TAU, N)
    again = reloaded(post, tmp_path / "post.pt")
    assert (again.temperature, again.data_size) == (TAU, N)
    assert again.state_dict()["version"] == posterior_io.VERSION == 2
    assert post.with_point_at("mean").temperature == TAU
    assert post.to(dtype=torch.float64).data_size == N
    assert "temperature=0.1" in repr(post)
    # param groups at different temperatures record none
    groups = [
        {"params": model[0].parameters(), "temperature": 0.5},
        {"params": model[2].parameters(), "data_size": 64},
    ]
    mixed = lgb.AffineBLR(groups, lr=0.1, scale_lr=0.05, data_size=N, temperature=TAU)
    assert (mixed.posterior(model).temperature, mixed.posterior(model).data_size) == (None, None)


@pytest.mark.parametrize("rule", ["affine", "multiplicative"])
def test_a_reloaded_posterior_gives_the_optimizers_scores_loo_nll_and_kernel(
    rule: str, tmp_path: Path
) -> None:
    """Bit for bit, from the optimizer, its posterior and the posterior saved and loaded
    (the Jacobian form for the affine rule, 16 posterior samples for the multiplicative)."""
    model, opt = trained(rule)
    x, y = data()
    post = opt.posterior(model)
    loaded = reloaded(post, tmp_path / "post.pt")
    options = {"samples": 16} if rule == "multiplicative" else {}

    def each(fn, source, **kw):
        return fn(model, source, x, y, generator=torch.Generator().manual_seed(0), **options, **kw)

    for source in (post, loaded):
        assert torch.equal(each(lgb.sensitivity, source), each(lgb.sensitivity, opt))
        assert torch.equal(each(loo_nll, source), each(loo_nll, opt))
        a, b = each(memory_map, source, cross_class=True), each(memory_map, opt, cross_class=True)
        assert torch.equal(a.variances, b.variances) and torch.equal(a.scores, b.scores)
        # an explicit temperature wins, as it does over the optimizer's
        ones = each(lgb.sensitivity, source, temperature=1.0)
        assert torch.equal(ones, each(lgb.sensitivity, opt, temperature=1.0))
        assert not torch.equal(ones, each(lgb.sensitivity, opt))

    def remember(source, **options) -> tuple[torch.Tensor, MemorablePast]:
        memory = MemorablePast(6, "sensitivity", "fromp_logits")
        chosen = memory.add_task(
            model,
            posterior=source,
            inputs=x,
            targets=y,
            samples=16,
            generator=torch.Generator().manual_seed(0),
            **options,
        )
        return chosen, memory

    kernels = []
    for source in (opt, post, loaded):
        chosen, memory = remember(source)
        kernels.append((chosen, memory.scores, memory.kernel_inverse))
    for chosen, scores, kernel in kernels[1:]:
        assert torch.equal(chosen, kernels[0][0]) and torch.equal(scores, kernels[0][1])
        assert torch.equal(kernel, kernels[0][2])
    # read at τ = 1, K⁻¹ is 1/τ times this one: the test sees a lost temperature
    _, memory = remember(loaded, temperature=1.0)
    torch.testing.assert_close(memory.kernel_inverse, kernels[0][2] / TAU, rtol=1e-5, atol=0)


def test_a_version_1_file_loads_read_as_tau_1_with_a_warning_naming_tau(tmp_path) -> None:
    model, opt = trained("affine")
    x, y = data()
    old = version_1(opt.posterior(model).state_dict())
    path = tmp_path / "old.pt"
    torch.save(old, path)
    for load in (lambda: Posterior.from_state_dict(old), lambda: Posterior.load(path)):
        with pytest.warns(UserWarning, match=r"^Posterior: a version-1 file .* τ; read as τ = 1"):
            post = load()
        assert (post.temperature, post.data_size) == (1.0, None)
        expected = lgb.sensitivity(model, opt, x, y, temperature=1.0)
        assert torch.equal(lgb.sensitivity(model, post, x, y), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the τ given: no warning
        post = Posterior.load(path, temperature=TAU)
    assert post.temperature == TAU
    assert torch.equal(lgb.sensitivity(model, post, x, y), lgb.sensitivity(model, opt, x, y))
    assert post.state_dict()["version"] == 2  # saved again, it records τ


def test_an_unknown_version_is_refused_and_a_mixed_temperature_must_be_given() -> None:
    model, opt = trained("affine")
    x, y = data()
    state = opt.posterior(model).state_dict()
    with pytest.raises(ValueError, match=r"^state_dict: Posterior format version 3; .*1, 2$"):
        Posterior.from_state_dict({**state, "version": 3})
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number >= 0"):
        Posterior.from_state_dict({**state, "temperature": -1.0})
    post = Posterior.from_state_dict({**state, "temperature": None})
    with pytest.raises(ValueError, match=r"^temperature: .*different temperatures; pass"):
        lgb.sensitivity(model, post, x, y)
    given = lgb.sensitivity(model, post, x, y, temperature=TAU)
    assert torch.equal(given, lgb.sensitivity(model, opt, x, y))


# ------------------------------------------------------------------- item 7: the API
def test_next_task_with_the_model_keys_the_prior_by_name_and_trains_the_same() -> None:
    x, y = data()
    ends, priors = [], []
    for by_name in (True, False):
        model, opt = trained("affine")
        prior = opt.next_task(data_size=20, model=model) if by_name else opt.next_task(20)
        priors.append(prior)
        for _ in range(3):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        ends.append([p.detach().clone() for p in model.parameters()])
    named, positional = priors
    assert list(named) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(positional) == [0, 1, 2, 3]
    assert torch.equal(named["2.weight"].element, positional[2].element)
    assert (named.temperature, named.data_size) == (TAU, N)  # the finished task's N
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))


def test_next_task_refuses_a_bad_data_size_before_anything_changes() -> None:
    model, opt = trained("affine")
    with pytest.raises(ValueError, match=r"^data_size"):
        opt.next_task(data_size=-5, model=model)
    assert opt.param_groups[0]["data_size"] == N


def test_add_task_takes_keywords_after_the_model() -> None:
    model, opt = trained("affine")
    x, y = data()
    memory = MemorablePast(4)
    with pytest.raises(TypeError, match=r"^add_task: .* by position; write add_task\(model, "):
        memory.add_task(model, opt, x, y)  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"^add_task: .* by position"):
        memory.add_task(model, x, y)  # type: ignore[misc]
    assert len(memory) == 0
    rows = memory.add_task(model, posterior=opt, inputs=x, targets=y)
    assert len(rows) == 4 and len(memory) == 4


def test_a_gaussian_memory_has_a_default_selection_that_works(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, targets = torch.randn(20, 3), torch.randn(20, 2)
    memory = MemorablePast(5, likelihood="gaussian", noise_variance=0.5)
    assert memory.selection == "random"
    assert MemorablePast(5).selection == "lambda"
    rows = memory.add_task(
        model, inputs=x, targets=targets, generator=torch.Generator().manual_seed(0)
    )
    assert len(set(rows.tolist())) == 5 and torch.equal(memory.targets, targets[rows])
    loss = memory.loss(model(memory.inputs), data_size=20)
    assert float(loss.detach()) == 0.0  # the K-prior at the old model
    memory.save(tmp_path / "memory.pt")
    assert MemorablePast.load(tmp_path / "memory.pt").selection == "random"
    with pytest.raises(ValueError, match=r"^selection: 'lambda' .* use selection='random'"):
        MemorablePast(5, "lambda", likelihood="gaussian")
    with pytest.raises(ValueError, match=r"^likelihood"):
        MemorablePast(5, likelihood="poisson")


OPTIMIZERS = [lgb.AdditiveBLR, lgb.MultiplicativeBLR, lgb.AffineBLR, lgb.LieGroupBLR]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_data_size_is_keyword_only_in_every_optimizer(cls) -> None:
    kind = inspect.signature(cls).parameters["data_size"].kind
    assert kind is inspect.Parameter.KEYWORD_ONLY


def test_a_positional_data_size_gets_a_warning_naming_the_keyword_fix() -> None:
    p = [nn.Parameter(torch.zeros(3))]
    base = Normal(0.0, 0.1)
    with pytest.warns(
        FutureWarning, match=r"^AdditiveBLR: data_size, temperature, .*data_size=100"
    ):
        additive = lgb.AdditiveBLR(p, 0.05, 0.9, base, 100, 1.0, 2.0)
    with pytest.warns(FutureWarning, match=r"^LieGroupBLR: data_size .*LieGroupBLR\(\.\.\., data"):
        generic = lgb.LieGroupBLR(p, AdditiveGroup(), base, 0.05, 0.9, 100)
    for opt in (additive, generic):
        assert (opt.param_groups[0]["data_size"], opt.param_groups[0]["momentum"]) == (100, 0.9)
    assert additive.param_groups[0]["prior_precision"] == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # momentum and base by position stay as they were
        assert lgb.AdditiveBLR(p, 0.05, 0.5, base).param_groups[0]["momentum"] == 0.5
        lgb.LieGroupBLR(p, AdditiveGroup(), base, 0.05, 0.5, data_size=100)
    # 100 in momentum's place: the error says where N goes
    with pytest.raises(ValueError, match=r"^momentum: .*, got 100; .*AdditiveBLR\(\.\.\., data_"):
        lgb.AdditiveBLR(p, 0.05, 100)
    with pytest.raises(ValueError, match=r"^momentum: .*LieGroupBLR\(\.\.\., data_size=100\)$"):
        lgb.LieGroupBLR(p, AdditiveGroup(), base, 0.05, 100)
    with pytest.raises(TypeError, match="multiple values for argument 'data_size'"):
        lgb.AdditiveBLR(p, 0.05, 0.9, base, 100, data_size=50)
    with pytest.raises(TypeError, match="by position"):
        lgb.AdditiveBLR(p, 0.05, 0.9, base, 100, 1.0, 0.0, 1, 0.0)
    # required where it is used, with what it means, in one line
    with pytest.raises(ValueError, match=r"^data_size: the number of training examples N [^\n]*$"):
        lgb.AdditiveBLR(p, lr=0.05, prior_precision=1.0)
    with pytest.raises(ValueError, match=r"^data_size: the number of training examples N [^\n]*$"):
        lgb.LieGroupBLR(p, lgb.groups.DiagonalAffineGroup(), base, lr=0.05)


def test_prediction_variance_reads_the_posteriors_temperature() -> None:
    model, opt = trained("affine")
    x, _ = data()
    v = prediction_variance(model, opt.posterior(model), x)
    assert torch.equal(v, prediction_variance(model, opt, x))
    torch.testing.assert_close(v * TAU, prediction_variance(model, opt, x, temperature=1.0))
