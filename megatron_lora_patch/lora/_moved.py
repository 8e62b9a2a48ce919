"""Old import paths kept for one release after a move (CHANGELOG "Deprecated"): each warns once, in one line,
naming the public name to use, then behaves as the module it moved to."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType


def forward(old: str, new: str, public: str) -> ModuleType:
    """Warn that module `old` moved to `new` (use `public`) and return `new`, imported."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {public}",
                  FutureWarning, stacklevel=3)
    return importlib.import_module(new)
