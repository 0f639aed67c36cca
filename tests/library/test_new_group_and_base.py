"""A group and a base distribution defined in this file alone, registered from here: the
library samples the base, takes its Fisher information, and gives memory maps, the KL to a
prior and posterior files for both, with no change to the library.

``Scaling`` is the group of positive scalings acting on *any* base, θ = A ⊙ ξ; ``Logistic``
is the logistic distribution, whose location-family Fisher information is 1/(3s²)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Distribution, Normal, constraints
from torch.distributions.utils import broadcast_all

import liegroup_blr as lgb
from liegroup_blr.distributions import (
    base_family,
    fisher_information,
    from_name,
    register_base,
    sample_into,
)
from liegroup_blr.fisher import fisher_closed_form, fisher_monte_carlo
from liegroup_blr.groups import (
    DiagonalAffineGroup,
    LieGroup,
    register_group,
    registered_group,
)
from liegroup_blr.groups.base import Shape
from liegroup_blr.kl import has_closed_form, kl_divergence, kl_gradient
from liegroup_blr.memory_maps import memory_map
from liegroup_blr.posterior import Posterior, PosteriorEntry

F64 = torch.float64


class Logistic(Distribution):
    r"""The logistic distribution: :math:`\log p(x) = -z - 2\log(1 + e^{-z}) - \log s`,
    :math:`z = (x - \mu)/s`; mean μ, variance :math:`s^2\pi^2/3`."""

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}  # noqa: RUF012
    support = constraints.real
    has_rsample = True

    def __init__(self, loc: float | Tensor = 0.0, scale: float | Tensor = 1.0) -> None:
        self.loc, self.scale = broadcast_all(loc, scale)
        super().__init__(self.loc.shape, validate_args=False)

    @property
    def mean(self) -> Tensor:
        return self.loc

    @property
    def variance(self) -> Tensor:
        return self.scale**2 * math.pi**2 / 3

    def log_prob(self, value: Tensor) -> Tensor:
        z = (value - self.loc) / self.scale
        return -z - 2 * F.softplus(-z) - self.scale.log()

    def icdf(self, value: Tensor) -> Tensor:
        return self.loc + self.scale * (value.log() - torch.log1p(-value))

    def rsample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = ()) -> Tensor:
        u = torch.rand(self._extended_shape(torch.Size(sample_shape)), dtype=self.loc.dtype)
        return self.icdf(u.clamp(1e-12, 1 - 1e-12))


register_base(
    Logistic,
    ("loc", "scale"),
    location_fisher=lambda b: 1 / (3 * float(b.scale) ** 2),
    centre=lambda b: float(b.loc),
    name="logistic",
    build=lambda scale: Logistic(0.0, scale),
)


@register_group
class Scaling(LieGroup):
    """Positive scalings of any base: g = A > 0, g · ξ = A ⊙ ξ, exp(X) = e^X."""

    name = "Scaling"
    elementwise = True

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        return torch.ones(shape, dtype=dtype, device=device)

    def exp(self, X: Tensor) -> Tensor:
        return X.exp()

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return g * h

    def inverse(self, g: Tensor) -> Tensor:
        return g.reciprocal()

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        return g * x

    def log_abs_det(self, g: Tensor) -> Tensor:
        return g.log().sum()


# ------------------------------------------------------------------------- the base
def test_the_registered_base_is_built_by_name_sampled_and_has_its_fisher_information() -> None:
    base = from_name("logistic", 2.0)
    assert isinstance(base, Logistic) and float(base.scale) == 2.0
    draws = sample_into(base, torch.empty(200_000, dtype=F64), torch.Generator().manual_seed(0))
    var = 4 * math.pi**2 / 3
    assert abs(float(draws.mean())) < 4 * math.sqrt(var / len(draws))
    assert float(draws.var()) == pytest.approx(var, rel=0.02)
    assert fisher_information(base) == (1 / 12, None)
    closed = fisher_closed_form(lgb.groups.AdditiveGroup(), base, ())
    assert closed is not None and float(closed) == pytest.approx(1 / 12)
    torch.manual_seed(1)
    estimate = fisher_monte_carlo(lgb.groups.AdditiveGroup(), base, (), num_samples=200_000)
    assert float(estimate) == pytest.approx(1 / 12, rel=0.02)  # the fact is the truth


def test_a_base_without_the_fact_goes_to_monte_carlo_and_bases_are_registered_once() -> None:
    assert fisher_closed_form(DiagonalAffineGroup(), Logistic(0.0, 1.0), ()) is None  # no scale
    assert base_family(Logistic(0.0, 1.0)) is base_family(Logistic(0.0, 3.0))

    class Logistic2(Logistic):  # a subclass keeps its parent's facts, not its file entry
        pass

    assert base_family(Logistic2()) is base_family(Logistic())
    assert base_family(Logistic2(), exact=True) is None
    Clash = type("Logistic", (Distribution,), {})
    with pytest.raises(ValueError, match="registered under the name 'Logistic'"):
        register_base(Clash, ("loc",))
    with pytest.raises(ValueError, match=r"cls: expected a torch\.distributions"):
        register_base(int, ("loc",))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ the group
def _pair(seed: int, shape: tuple[int, ...] = (3, 4)) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.empty(shape, dtype=F64).uniform_(0.5, 2.0, generator=gen)
    h = torch.empty(shape, dtype=F64).uniform_(0.5, 2.0, generator=gen)
    return g, h


def test_the_kl_to_a_prior_of_the_new_group_is_its_closed_form() -> None:
    """KL(N(0, (Aσ)²) ‖ N(0, (A_h σ)²)) = Σ −log r + (r² − 1)/2, r = A/A_h, and its algebra
    gradient (entropy included) r² − 1, by Monte Carlo through the library."""
    G, base = Scaling(), Normal(torch.tensor(0.0, dtype=F64), torch.tensor(0.7, dtype=F64))
    g, h = _pair(0)
    assert not has_closed_form(G, base)
    r = g / h
    exact = (-(r.log()) + (r.square() - 1) / 2).sum()
    torch.manual_seed(0)
    estimate = kl_divergence(G, base, g, h, num_samples=20_000)
    assert float(estimate) == pytest.approx(float(exact), rel=0.03)
    torch.manual_seed(0)
    grad = kl_gradient(G, base, g, h, num_samples=20_000)
    torch.testing.assert_close(grad, r.square() - 1, rtol=0.05, atol=0.03)
    torch.testing.assert_close(kl_divergence(G, base, g, g, num_samples=100), g.new_zeros(()))


def test_the_new_group_trains_toward_a_prior_it_was_given() -> None:
    """A posterior of the new group and base as the prior (the generic rule, its KL by
    Monte Carlo): with no data term the element returns toward the prior's, from 4 times
    away, until the distance is within its noise (16 draws per step, a decaying step)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.ones(5, dtype=F64))
    base, shape = Logistic(0.0, 0.5), torch.Size((5,))
    prior = Posterior(
        {0: PosteriorEntry(torch.full(shape, 2.0, dtype=F64), Scaling(), base, shape)}
    )
    opt = lgb.LieGroupBLR(
        [w],
        Scaling(),
        base,
        lr=0.5,
        momentum=0.5,
        data_size=10,
        prior=prior,
        mc_samples=16,
        init=lambda p: torch.full_like(p, 0.5),
        seed=2,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k / 100))

    def closure() -> Tensor:
        opt.zero_grad()
        loss = w.sum() * 0.0
        loss.backward()
        return loss

    start = (opt.state[w]["element"].log() - math.log(2.0)).norm()
    for _ in range(400):
        opt.step(closure)
        sched.step()
    end = (opt.state[w]["element"].log() - math.log(2.0)).norm()
    assert float(end) < 0.1 * float(start)


def test_memory_maps_of_the_new_group_equal_the_affine_group_s_on_the_same_law() -> None:
    """Scaling(A) on N(1, σ²) and DiagonalAffine(A, 0) on N(1, σ²) are the same law,
    θ ~ N(A, (Aσ)²): their Jacobian-form memory maps agree."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(20, 4, dtype=F64), torch.randint(0, 3, (20,))
    base = Normal(torch.tensor(1.0, dtype=F64), torch.tensor(0.3, dtype=F64))
    scaling: dict[str | int, PosteriorEntry] = {}
    affine: dict[str | int, PosteriorEntry] = {}
    for name, p in model.named_parameters():
        A = torch.rand(p.shape, dtype=F64) + 0.5
        scaling[name] = PosteriorEntry(A, Scaling(), base, p.shape)
        affine[name] = PosteriorEntry(
            torch.stack((A, torch.zeros_like(A))), DiagonalAffineGroup(), base, p.shape
        )
    ours = memory_map(model, Posterior(scaling), x, y, method="jacobian")
    theirs = memory_map(model, Posterior(affine), x, y, method="jacobian")
    torch.testing.assert_close(ours.scores, theirs.scores)
    torch.testing.assert_close(ours.variances, theirs.variances)
    sampled = memory_map(model, Posterior(scaling), x, y)  # "auto": not Gaussian-like
    assert sampled.scores.shape == ours.scores.shape and bool(torch.isfinite(sampled.scores).all())


def test_the_default_coordinate_variance_differentiates_the_action() -> None:
    """Var θ = A² Var ξ for θ = A ⊙ ξ, also for a base whose mean is not implemented (the
    action is linear: the point it is differentiated at does not matter)."""

    class NoMean(Logistic):
        @property
        def mean(self) -> Tensor:
            raise NotImplementedError

    A = torch.rand(2, 3, dtype=F64) + 0.5
    for base in (Logistic(0.5, 2.0), NoMean(0.5, 2.0)):
        var = 4 * math.pi**2 / 3
        torch.testing.assert_close(Scaling().coordinate_variance(A, base), A.square() * var)


def test_a_file_of_the_new_group_and_base_loads_without_passing_them(tmp_path: Path) -> None:
    g = torch.rand(2, 3, dtype=F64) + 0.5
    post = Posterior({"w": PosteriorEntry(g, Scaling(), Logistic(0.5, 2.0), torch.Size((2, 3)))})
    post.save(tmp_path / "post.pt")
    back = Posterior.load(tmp_path / "post.pt")
    entry = back["w"]
    assert type(entry.group) is Scaling and type(entry.base) is Logistic
    assert (float(entry.base.loc), float(entry.base.scale)) == (0.5, 2.0)
    torch.testing.assert_close(entry.element, g, rtol=0, atol=0)
    assert registered_group("Scaling") is Scaling


def test_groups_are_registered_once_by_name() -> None:
    Clash = type("Scaling", (LieGroup,), {})
    with pytest.raises(ValueError, match="registered under the name 'Scaling'"):
        register_group(Clash)
    with pytest.raises(ValueError, match="cls: expected a LieGroup subclass"):
        register_group(int)  # type: ignore[arg-type]
