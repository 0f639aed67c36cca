"""Group axioms, exponential maps, actions and geoopt hooks of the built-in Lie groups.

Oracles are independent of the code under test: hand-derived formulas evaluated with numpy,
the affine group as 2×2 matrices (``torch.linalg.matrix_exp`` / ``inv`` / matrix products),
``torch.func.jacrev`` + ``torch.linalg.slogdet`` for log|det J|, and ``math.expm1`` for
``exprel``.

Exactness checks run in float64. Generated entries are bounded (reals in [−3, 3], positive
parts e^{[−2, 2]}, algebra vectors in [−2, 2]), so every intermediate is below ~e^6·3 ≈ 1.2e3
and a handful of roundings costs at most ~1e3 · 2.2e-16 · 10 ≈ 2e-12 absolute: ``TOL``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.func
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import Tensor

from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    LieGroup,
    MultiplicativeGroup,
    exprel,
)

F64 = torch.float64
TOL = {"rtol": 1e-11, "atol": 1e-11}
EXACT = {"rtol": 0.0, "atol": 0.0}
SETTINGS = settings(max_examples=20, deadline=None)

GROUP_NAMES = ("additive", "multiplicative", "signed", "affine")


def make_group(name: str) -> LieGroup:
    return {
        "additive": AdditiveGroup,
        "multiplicative": lambda: MultiplicativeGroup(signed=False),
        "signed": lambda: MultiplicativeGroup(signed=True),
        "affine": DiagonalAffineGroup,
    }[name]()


# ------------------------------------------------------------------ strategies
SHAPES = hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3)
REALS = st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False)
LOGS = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False)


def _array(data: st.DataObject, shape: tuple[int, ...], elements: st.SearchStrategy) -> Tensor:
    arr = data.draw(hnp.arrays(np.float64, shape, elements=elements))
    return torch.as_tensor(np.asarray(arr, dtype=np.float64))


def _positive(data: st.DataObject, shape: tuple[int, ...]) -> Tensor:
    return _array(data, shape, LOGS).exp()


def draw_element(data: st.DataObject, group: LieGroup, shape: tuple[int, ...]) -> Tensor:
    """A group element drawn directly from its domain (not through exp)."""
    if isinstance(group, AdditiveGroup):
        return _array(data, shape, REALS)
    if isinstance(group, MultiplicativeGroup):
        return _positive(data, tuple(group.element_shape(shape)))
    assert isinstance(group, DiagonalAffineGroup)
    return torch.stack((_positive(data, shape), _array(data, shape, REALS)))


def draw_algebra(data: st.DataObject, group: LieGroup, shape: tuple[int, ...]) -> Tensor:
    return _array(data, tuple(group.algebra_shape(shape)), LOGS)


def draw_base(data: st.DataObject, group: LieGroup, shape: tuple[int, ...]) -> Tensor:
    base_shape = tuple(group.base_shape(shape))
    if group.positive_base:
        return _positive(data, base_shape)
    return _array(data, base_shape, REALS)


def close(actual: Tensor, expected: Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual, expected, **(tol or TOL))


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES)
def test_shapes_round_trip(name: str, shape: tuple[int, ...]) -> None:
    group = make_group(name)
    two = (2, *shape)
    expected_element = {"additive": shape, "multiplicative": shape, "signed": two, "affine": two}
    expected_base = {"additive": shape, "multiplicative": shape, "signed": two, "affine": shape}
    assert group.element_shape(shape) == torch.Size(expected_element[name])
    assert group.algebra_shape(shape) == torch.Size(expected_element[name])
    assert group.base_shape(shape) == torch.Size(expected_base[name])
    assert group.param_shape(group.element_shape(shape)) == torch.Size(shape)
    e = group.identity(shape, dtype=F64)
    assert e.shape == group.element_shape(shape) and e.dtype == F64
    assert group.algebra_zeros_like(e).shape == group.algebra_shape(shape)


@pytest.mark.parametrize("name", ["signed", "affine"])
def test_param_shape_rejects_unstacked_elements(name: str) -> None:
    group = make_group(name)
    with pytest.raises(ValueError):
        group.param_shape((3, 4))
    with pytest.raises(ValueError):
        group.param_shape(())
    with pytest.raises(ValueError):  # geoopt's public shape check
        group.assert_check_point(torch.ones(3, 4))
    assert group.check_point(torch.ones(2, 4))


# ------------------------------------------------------------------ group axioms
@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_compose_is_associative(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    g, h, k = (draw_element(data, group, shape) for _ in range(3))
    close(group.compose(group.compose(g, h), k), group.compose(g, group.compose(h, k)))


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_identity_is_neutral(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    g = draw_element(data, group, shape)
    e = group.identity(shape, dtype=F64)
    assert group.check_element(e) == (True, None)
    # Multiplying by 1 and adding 0 is exact in floating point.
    close(group.compose(e, g), g, **EXACT)
    close(group.compose(g, e), g, **EXACT)


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_inverse(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    g = draw_element(data, group, shape)
    e = group.identity(shape, dtype=F64)
    g_inv = group.inverse(g)
    assert group.check_element(g_inv)[0]
    close(group.compose(g, g_inv), e)
    close(group.compose(g_inv, g), e)
    close(group.inverse(g_inv), g)


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES)
def test_exp_of_zero_is_identity(name: str, shape: tuple[int, ...]) -> None:
    group = make_group(name)
    zero = torch.zeros(group.algebra_shape(shape), dtype=F64)
    close(group.exp(zero), group.identity(shape, dtype=F64), **EXACT)


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_exp_of_negation_is_inverse(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    X = draw_algebra(data, group, shape)
    e = group.identity(shape, dtype=F64)
    close(group.compose(group.exp(X), group.exp(-X)), e)
    close(group.exp(-X), group.inverse(group.exp(X)))


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(
    shape=SHAPES,
    data=st.data(),
    s=st.floats(-1.0, 1.0, allow_nan=False),
    t=st.floats(-1.0, 1.0, allow_nan=False),
)
def test_exp_is_a_one_parameter_subgroup(
    name: str, shape: tuple[int, ...], data: st.DataObject, s: float, t: float
) -> None:
    """exp(sX)·exp(tX) = exp((s+t)X): a property of the true exponential map only."""
    group = make_group(name)
    X = draw_algebra(data, group, shape)
    close(group.compose(group.exp(s * X), group.exp(t * X)), group.exp((s + t) * X))


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_exp_matches_hand_formula(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    X = draw_algebra(data, group, shape)
    x = X.numpy()
    if name == "additive":
        expected = x
    elif name in ("multiplicative", "signed"):
        expected = np.exp(x)
    else:
        u, v = x[0], x[1]
        # expm1(u)/u, or its series 1 + u/2 + u²/6 (truncation < 1e-24) where |u| < 1e-8:
        # subnormal u carry too few bits for the quotient (expm1(5e-324)/5e-324 = 2 in numpy).
        small = np.abs(u) < 1e-8
        safe = np.where(small, 1.0, u)
        phi = np.where(small, 1 + u / 2 + u * u / 6, np.expm1(safe) / safe)
        expected = np.stack((np.exp(u), v * phi))
    close(group.exp(X), torch.as_tensor(expected))


# ------------------------------------------------------------------ action
@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_action_is_a_group_action(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    g, h = draw_element(data, group, shape), draw_element(data, group, shape)
    x = draw_base(data, group, shape)
    close(group.act(g, group.act(h, x)), group.act(group.compose(g, h), x))
    close(group.act(group.identity(shape, dtype=F64), x), x, **EXACT)
    close(group.act(group.inverse(g), group.act(g, x)), x)


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_action_matches_hand_formula(
    name: str, shape: tuple[int, ...], data: st.DataObject
) -> None:
    group = make_group(name)
    g, x = draw_element(data, group, shape), draw_base(data, group, shape)
    gn, xn = g.numpy(), x.numpy()
    expected = {
        "additive": lambda: gn + xn,
        "multiplicative": lambda: gn * xn,
        "signed": lambda: gn * xn,
        "affine": lambda: gn[0] * xn + gn[1],
    }[name]()
    close(group.act(g, x), torch.as_tensor(expected))


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_log_abs_det_is_additive(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    g, h = draw_element(data, group, shape), draw_element(data, group, shape)
    lad = group.log_abs_det
    close(lad(group.compose(g, h)), lad(g) + lad(h))
    close(lad(group.identity(shape, dtype=F64)), torch.zeros((), dtype=F64), **EXACT)
    close(lad(group.inverse(g)), -lad(g))
    assert lad(g).shape == torch.Size()


@pytest.mark.parametrize("name", GROUP_NAMES)
@settings(max_examples=20, deadline=None)
@given(shape=SHAPES, data=st.data())
def test_log_abs_det_is_that_of_the_action_jacobian(
    name: str, shape: tuple[int, ...], data: st.DataObject
) -> None:
    group = make_group(name)
    g, x = draw_element(data, group, shape), draw_base(data, group, shape)
    jac = torch.func.jacrev(lambda y: group.act(g, y))(x)
    n = x.numel()
    sign, logabs = torch.linalg.slogdet(jac.reshape(n, n))
    assert sign != 0
    close(group.log_abs_det(g), logabs)


# ------------------------------------------------------------------ affine as matrices
def affine_matrix(g: Tensor) -> Tensor:
    """[[A, b], [0, 1]] per coordinate, shape (*shape, 2, 2)."""
    m = torch.zeros((*g.shape[1:], 2, 2), dtype=g.dtype)
    m[..., 0, 0], m[..., 0, 1], m[..., 1, 1] = g[0], g[1], 1.0
    return m


@settings(max_examples=30, deadline=None)
@given(shape=SHAPES, data=st.data())
def test_affine_exp_is_the_matrix_exponential(shape: tuple[int, ...], data: st.DataObject) -> None:
    group = DiagonalAffineGroup()
    X = draw_algebra(data, group, shape)
    algebra = torch.zeros((*shape, 2, 2), dtype=F64)
    algebra[..., 0, 0], algebra[..., 0, 1] = X[0], X[1]
    got = affine_matrix(group.exp(X))
    # scipy's expm (scaling and squaring + Padé 13) is accurate to a few ulp of ‖exp‖ ≤ e^4.
    reference = np.stack([scipy.linalg.expm(m) for m in algebra.reshape(-1, 2, 2).numpy()])
    close(got, torch.as_tensor(reference).reshape(got.shape), rtol=1e-13, atol=1e-14)
    # torch's matrix_exp picks a truncated Taylor degree from ‖M‖₁; at its switch points the
    # float64 error reaches ~2.5e-11 (e.g. u = v = 1/32), hence the looser tolerance here.
    close(got, torch.linalg.matrix_exp(algebra), rtol=1e-10, atol=1e-10)


@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_affine_structure_is_matrix_algebra(shape: tuple[int, ...], data: st.DataObject) -> None:
    group = DiagonalAffineGroup()
    g, h = draw_element(data, group, shape), draw_element(data, group, shape)
    x = draw_base(data, group, shape)
    close(affine_matrix(group.compose(g, h)), affine_matrix(g) @ affine_matrix(h))
    close(affine_matrix(group.inverse(g)), torch.linalg.inv(affine_matrix(g)))
    homogeneous = torch.stack((x, torch.ones_like(x)), dim=-1).unsqueeze(-1)
    moved = (affine_matrix(g) @ homogeneous).squeeze(-1)
    close(group.act(g, x), moved[..., 0])


# ------------------------------------------------------------------ exprel near 0
def _threshold(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps ** 0.25


SMALL_U = [0.0, 1e-300, -1e-300, 1e-30, -1e-30, 1e-12, -1e-12, 1e-8, -1e-8]
SMALL_U += [1e-4, -1e-4, 1e-2, -1e-2]
# just below / above where a Taylor branch might switch to expm1(u)/u
SMALL_U += [
    s * _threshold(d) * f for d in (torch.float32, F64) for s in (1, -1) for f in (0.99, 1.01)
]


def _rounded(u: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(u, dtype=dtype))


def _exprel_oracle(u: float) -> float:
    return 1.0 if u == 0 else math.expm1(u) / u


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("u", SMALL_U)
def test_exprel_is_accurate_near_zero(u: float, dtype: torch.dtype) -> None:
    ut = torch.tensor(u, dtype=dtype)
    expected = _exprel_oracle(_rounded(u, dtype))  # float64 oracle at the rounded input
    value = exprel(ut)
    assert value.dtype == dtype and torch.isfinite(value)
    # expm1 and one division: a few ulp of a value ≈ 1.
    eps = torch.finfo(dtype).eps
    assert abs(float(value) - expected) <= 4 * eps * expected


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("u", SMALL_U)
def test_affine_exp_is_accurate_near_zero(u: float, dtype: torch.dtype) -> None:
    group = DiagonalAffineGroup()
    v = -1.75  # exactly representable
    X = torch.tensor([[u], [v]], dtype=dtype)
    e = group.exp(X)
    assert torch.isfinite(e).all() and e.dtype == dtype
    ur = _rounded(u, dtype)
    eps = torch.finfo(dtype).eps
    assert abs(float(e[0, 0]) - math.exp(ur)) <= 4 * eps * math.exp(ur)
    expected_b = v * _exprel_oracle(ur)
    assert abs(float(e[1, 0]) - expected_b) <= 4 * eps * abs(expected_b)


def _exprel_derivative_oracle(u: float) -> float:
    """φ'(u) = Σ_k (k+1) u^k / (k+2)!, summed to k = 15 (truncation < 1e-30 for |u| ≤ 0.04)."""
    return sum((k + 1) * u**k / math.factorial(k + 2) for k in range(16))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("u", [u for u in SMALL_U if abs(u) <= 0.04])
def test_exprel_derivative_near_zero(u: float, dtype: torch.dtype) -> None:
    ut = torch.tensor(u, dtype=dtype)
    d = torch.func.grad(exprel)(ut)
    assert torch.isfinite(d)
    # On an expm1(u)/u branch the derivative e^u/u − expm1(u)/u² cancels two O(1/|u|) terms;
    # for |u| ≥ eps^{1/4} that costs ≤ ~2·eps^{3/4} relative. 4·eps^{3/4}: 2.6e-5 / 7e-12.
    rtol = 4 * torch.finfo(dtype).eps ** 0.75
    expected = _exprel_derivative_oracle(_rounded(u, dtype))
    assert abs(float(d) - expected) <= rtol * expected


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exprel_derivative_at_zero_is_one_half(dtype: torch.dtype) -> None:
    assert float(torch.func.grad(exprel)(torch.tensor(0.0, dtype=dtype))) == pytest.approx(
        0.5, rel=4 * torch.finfo(dtype).eps
    )
    # and through the affine exponential: ∂b/∂u at (u, v) = (0, v) is v·φ'(0) = v/2.
    group = DiagonalAffineGroup()
    X = torch.tensor([[0.0], [3.0]], dtype=dtype)
    jac = torch.func.jacrev(group.exp)(X)  # (2, 1, 2, 1)
    assert float(jac[1, 0, 0, 0]) == pytest.approx(1.5, rel=4 * torch.finfo(dtype).eps)
    assert float(jac[1, 0, 1, 0]) == pytest.approx(1.0, rel=4 * torch.finfo(dtype).eps)
    assert float(jac[0, 0, 0, 0]) == pytest.approx(1.0, rel=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exprel_matches_expm1_away_from_zero(dtype: torch.dtype) -> None:
    us = [-30.0, -5.0, -1.0, -0.3, 0.3, 1.0, 5.0, 30.0]
    values = exprel(torch.tensor(us, dtype=dtype))
    eps = torch.finfo(dtype).eps
    for u, value in zip(us, values.tolist(), strict=True):
        expected = _exprel_oracle(_rounded(u, dtype))
        # e^u itself is ill-conditioned in u (condition |u|); 4 ulp + |u|·ulp.
        assert abs(value - expected) <= (4 + abs(u)) * eps * expected


# ------------------------------------------------------------------ readout / point estimate
@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_point_estimate_of_from_point(
    name: str, shape: tuple[int, ...], data: st.DataObject
) -> None:
    group = make_group(name)
    if name == "multiplicative":
        theta = _positive(data, shape)
    else:
        theta = _array(data, shape, REALS)
    g = group.from_point(theta)
    assert g.shape == group.element_shape(shape)
    assert group.check_element(g) == (True, None)
    estimate = group.point_estimate(g)
    assert estimate.shape == theta.shape
    if name == "signed":
        # (|θ|₊ + offset) − (|θ|₋ + offset): one rounding of a value ≤ |θ| + offset.
        offset = 1e-5
        close(g[0], theta.clamp(min=0) + offset, **EXACT)
        close(g[1], (-theta).clamp(min=0) + offset, **EXACT)
        bound = 2 * torch.finfo(F64).eps * (theta.abs() + offset)
        assert ((estimate - theta).abs() <= bound).all()
    else:
        close(estimate, theta, **EXACT)


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_point_estimate_by_hand(name: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    group = make_group(name)
    g = draw_element(data, group, shape)
    expected = {
        "additive": lambda: g,
        "multiplicative": lambda: g,
        "signed": lambda: g[0] - g[1],
        "affine": lambda: g[1],
    }[name]()
    close(group.point_estimate(g), expected, **EXACT)


def test_signed_readout_and_reference_point() -> None:
    group = MultiplicativeGroup(signed=True)
    x = torch.tensor([[3.0, 0.5], [1.0, 2.5]], dtype=F64)
    close(group.readout(x), torch.tensor([2.0, -2.0], dtype=F64), **EXACT)
    close(group.reference_point((2,), dtype=F64), torch.ones(2, 2, dtype=F64), **EXACT)
    close(MultiplicativeGroup(signed=False).readout(x), x, **EXACT)
    close(DiagonalAffineGroup().reference_point((3,), dtype=F64), torch.zeros(3, dtype=F64))


def test_from_point_options_and_errors() -> None:
    theta = torch.tensor([-2.0, 0.0, 1.5], dtype=F64)
    g = MultiplicativeGroup(signed=True).from_point(theta, offset=0.25)
    close(g, torch.tensor([[0.25, 0.25, 1.75], [2.25, 0.25, 0.25]], dtype=F64), **EXACT)
    with pytest.raises(ValueError, match="theta"):
        MultiplicativeGroup(signed=False).from_point(theta)
    a = DiagonalAffineGroup().from_point(theta, scale=0.125)
    close(a, torch.stack((torch.full_like(theta, 0.125), theta)), **EXACT)
    # from_point detaches: the element is a fresh leaf, not a view of theta
    leaf = theta.clone().requires_grad_()
    for group in (AdditiveGroup(), DiagonalAffineGroup(), MultiplicativeGroup(signed=True)):
        assert not group.from_point(leaf).requires_grad


def test_parts_names() -> None:
    g2 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)
    p = MultiplicativeGroup(signed=True).parts(g2)
    assert list(p) == ["g+", "g-"]
    close(p["g+"], g2[0], **EXACT)
    close(p["g-"], g2[1], **EXACT)
    p = DiagonalAffineGroup().parts(g2)
    assert list(p) == ["A", "b"]
    close(p["A"], g2[0], **EXACT)
    close(p["b"], g2[1], **EXACT)
    assert list(MultiplicativeGroup(signed=False).parts(g2)) == ["g"]
    assert list(AdditiveGroup().parts(g2)) == ["m"]
    close(AdditiveGroup().parts(g2)["m"], g2, **EXACT)


# ------------------------------------------------------------------ check_element
BAD = [0.0, -1.0, -1e-300, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("bad", BAD)
def test_multiplicative_check_element_rejects(signed: bool, bad: float) -> None:
    group = MultiplicativeGroup(signed=signed)
    g = group.identity((3,), dtype=F64) * 2.0
    assert group.check_element(g) == (True, None)
    assert group.check_point_on_manifold(g)
    g.view(-1)[-1] = bad
    ok, reason = group.check_element(g)
    assert not ok and isinstance(reason, str) and reason
    assert not group.check_point_on_manifold(g)


@pytest.mark.parametrize("bad", BAD)
def test_affine_check_element_rejects_bad_scale(bad: float) -> None:
    group = DiagonalAffineGroup()
    g = torch.tensor([[1.0, 2.0], [-5.0, 0.0]], dtype=F64)  # negative shifts are fine
    assert group.check_element(g) == (True, None)
    g[0, 1] = bad
    ok, reason = group.check_element(g)
    assert not ok and isinstance(reason, str) and reason
    assert not group.check_point_on_manifold(g)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_shift_is_rejected(bad: float) -> None:
    affine = DiagonalAffineGroup()
    g = torch.tensor([[1.0, 2.0], [0.0, bad]], dtype=F64)
    assert not affine.check_element(g)[0]
    additive = AdditiveGroup()
    assert additive.check_element(torch.tensor([-4.0, 0.0], dtype=F64)) == (True, None)
    assert not additive.check_element(torch.tensor([0.0, bad], dtype=F64))[0]


# ------------------------------------------------------------------ geoopt hooks
@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_egrad2rgrad_override_equals_generic_vjp(
    name: str, shape: tuple[int, ...], data: st.DataObject
) -> None:
    group = make_group(name)
    x = draw_element(data, group, shape)
    u = _array(data, tuple(x.shape), REALS)
    close(group.egrad2rgrad(x, u), LieGroup.egrad2rgrad(group, x, u))


@pytest.mark.parametrize("name", GROUP_NAMES)
@SETTINGS
@given(shape=SHAPES, data=st.data())
def test_retraction_is_the_exponential_update(
    name: str, shape: tuple[int, ...], data: st.DataObject
) -> None:
    group = make_group(name)
    x, u = draw_element(data, group, shape), draw_algebra(data, group, shape)
    step = group.compose(x, group.exp(u))
    close(group.retr(x, u), step, **EXACT)
    close(group.expmap(x, u), step, **EXACT)
    y, v = group.retr_transp(x, u, u)
    close(y, step, **EXACT)
    close(v, u, **EXACT)
    close(group.proju(x, u), u, **EXACT)
    assert group.check_point_on_manifold(group.retr(x, u))
