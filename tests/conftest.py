"""Fixtures every folder of tests can ask for, made from ``tests/shared.py`` (a module that
needs them at import time imports them from there), and the slow mark of the tests that
``tests/selection.py`` lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch import Tensor, nn

from tests import selection, shared


@pytest.fixture(scope="session")
def tiny_config() -> Callable[..., dict[str, Any]]:
    """The tiny driver config's builder: ``tiny_config(schedule={"epochs": 2})``."""
    return shared.tiny_config


@pytest.fixture
def problem() -> tuple[nn.Module, Tensor, Tensor]:
    """A fresh small tanh network (float64) and its classification batch."""
    return shared.make_problem()


@pytest.fixture(scope="session")
def make_optimizer() -> Callable[..., Any]:
    """An optimizer by rule name with small hyperparameters:
    ``make_optimizer("affine", model.parameters(), lr=0.5)``."""

    def make(name: str, params: Any, **options: Any) -> Any:
        return shared.FACTORIES[name](params, **options)

    return make


# ------------------------------------------------------------------ the fast selection
@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests tests/selection.py lists as slow are marked so."""
    for item in items:
        if selection.is_listed(item.nodeid):
            item.add_marker(pytest.mark.slow)
