"""The installed Megatron-Core version and each patch's tested range."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "megatron-core"


class VersionError(ValueError):
    """A version or version range that cannot be parsed."""


def installed_megatron_core() -> Optional[Version]:
    """The version of the Megatron-Core this process runs.

    Once `megatron.core` is imported (every patch target is inside it, so always when a patch
    hook fires): its own `package_info.__version__`, which is right for a source checkout on
    `sys.path` with or without a different wheel installed. Before that, the distribution
    metadata stands in (what an import would most likely load). Never cached: the answer
    changes when Megatron gets imported. Asking never imports Megatron itself.
    """
    if "megatron.core" in sys.modules:
        try:
            package_info = importlib.import_module("megatron.core.package_info")
            return parse_version(package_info.__version__, "megatron.core.package_info")
        except (ImportError, AttributeError):
            pass  # an unusual layout: fall back to the metadata
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
