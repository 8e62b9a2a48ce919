"""A source checkout: `megatron_lora_patch.patches` found in the repository's top-level `patches/`.

The patches live at the top of the repository (`patches/`, one module per patch). A wheel ships that directory
as `megatron_lora_patch.patches` (setuptools' package-dir mapping, setup.py), and an editable install's finder
maps the same name to the same directory. Run from a checkout that was never installed (the repository root on
`sys.path`) nothing maps it, so the package's `__init__` installs the finder below whenever its own directory
has no `patches/__init__.py` while the directory above it has one: a bare checkout, and an editable install too
(where it maps exactly what setuptools' finder maps), never an installed wheel, which holds the subpackage
inside the package. The finder answers for exactly `megatron_lora_patch.patches`; the patch modules are then
found through that package's `__path__`, the checkout's `patches/`."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

#: The one name the finder maps.
PATCHES = "megatron_lora_patch.patches"


class CheckoutPatchesFinder(importlib.abc.MetaPathFinder):
    """Maps `megatron_lora_patch.patches` to `directory` (the checkout's `patches/`), as setuptools' editable
    finder maps a package-dir entry."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != PATCHES:
            return None
        return importlib.util.spec_from_file_location(
            PATCHES, os.path.join(self.directory, "__init__.py"), submodule_search_locations=[self.directory]
        )


def install(directory: str) -> None:
    """Put the finder first on `sys.meta_path` (once): the patches then come from the same checkout as the
    package, even where a stale `megatron_lora_patch/patches/__pycache__` would make the path finder see a
    namespace package, or where an editable install of another checkout is on the path too."""
    if not any(isinstance(finder, CheckoutPatchesFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, CheckoutPatchesFinder(directory))
