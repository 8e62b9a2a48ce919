"""The installed Megatron-Core version and each patch's tested range."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from typing import Optional, Tuple

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "megatron-core"


class VersionError(ValueError):
    """A version or version range that cannot be parsed."""


def installed_megatron_core() -> Optional[Version]:
    """The version of the Megatron-Core this process runs.

    Once `megatron.core` is imported (every patch target is inside it, so always when a patch
    hook fires): its own `package_info.__version__`, which is right for a source checkout on
    `sys.path` with or without a different wheel installed. Before that, the `package_info.py` of the
    `megatron.core` an import would load (`resolved_megatron_core`), else the distribution metadata.
    Never cached: the answer changes when Megatron gets imported. Asking never imports Megatron itself.
    """
    if "megatron.core" in sys.modules:
        try:
            package_info = importlib.import_module("megatron.core.package_info")
            return parse_version(package_info.__version__, "megatron.core.package_info")
        except (ImportError, AttributeError):
            pass  # an unusual layout: fall back to the metadata
    else:
        resolved = resolved_megatron_core()
        if resolved is not None and resolved[0] is not None:
            return resolved[0]
    try:
        return parse_version(importlib.metadata.version(DISTRIBUTION), DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_version(text: str, what: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise VersionError(f"{what} has version {text!r}, which is not a PEP 440 version") from None


def parse_range(text: str, patch_name: str) -> SpecifierSet:
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise VersionError(
            f"patch {patch_name!r} declares tested range {text!r}, which is not a PEP 440 specifier "
            "(example: '>=0.13,<0.17')"
        ) from None


def out_of_range_reason(patch_name: str, tested: str, installed: Optional[Version]) -> Optional[str]:
    """None when the patch may apply; otherwise why not, naming patch, range and version."""
    specifier = parse_range(tested, patch_name)
    if installed is None:
        return f"patch {patch_name} cannot tell the megatron-core version (tested range {tested})"
    if not specifier.contains(installed, prereleases=True):
        return f"megatron-core {installed} is outside the tested range {tested} of patch {patch_name}"
    return None


def resolved_megatron_core() -> Optional[Tuple[Optional[Version], str]]:
    """(version, directory) of the `megatron.core` this process has imported, or else would import: the first
    `megatron/core` package on `sys.path` (a source checkout before the installed wheel, as the import itself
    finds it), located without importing Megatron, its version read from its own `package_info.py`. None: no
    Megatron-Core on the path; version None: a `package_info.py` that does not say."""
    module = sys.modules.get("megatron.core")
    if module is not None and getattr(module, "__file__", None):
        directory = os.path.dirname(module.__file__)
    else:
        spec = importlib.util.find_spec("megatron")  # a top-level name: finding it imports nothing
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
        found = [os.path.join(path, "core") for path in locations]
        directory = next((core for core in found if os.path.isfile(os.path.join(core, "__init__.py"))), None)
        if directory is None:
            return None
    return package_version(os.path.join(directory, "package_info.py")), directory


def package_version(path: str) -> Optional[Version]:
    """`__version__` of a Megatron-Core `package_info.py` (plain constants), run on its own, not as `megatron.core`."""
    try:
        spec = importlib.util.spec_from_file_location("_megatron_lora_patch_package_info", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return parse_version(module.__version__, path)
    except Exception:  # any failure of that file only means it does not say (the import itself would tell more)
        return None
