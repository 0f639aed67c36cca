"""Deprecated: the memory maps are :mod:`liegroup_blr.memory_maps`; this module re-exports
its public names, with a ``DeprecationWarning`` on import, for one release."""

from __future__ import annotations

import warnings

from .memory_maps import *  # noqa: F403  (the same public names)
from .memory_maps import LOO_FORMS as LOO_FORMS
from .memory_maps import __all__ as __all__

warnings.warn(
    "liegroup_blr.memory is deprecated: the memory maps are liegroup_blr.memory_maps; import "
    "from it (the same names)",
    DeprecationWarning,
    stacklevel=2,
)
