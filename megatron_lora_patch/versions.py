"""The installed Megatron-Core version and each patch's tested range."""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from typing import Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "megatron-core"


class VersionError(ValueError):
    """A version or version range that cannot be parsed."""


@functools.lru_cache(maxsize=None)
def installed_megatron_core() -> Optional[Version]:
    """From the distribution metadata; a source checkout falls back to `megatron.core.package_info`.

    The fallback is read only when `megatron.core` is already imported, so asking for the
    version never imports Megatron. Cached: the installed version does not change in a process.
    """
    try:
        text = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        package_info = sys.modules.get("megatron.core.package_info")
        if package_info is None and "megatron.core" in sys.modules:
            import megatron.core.package_info as package_info  # type: ignore[no-redef]
        if package_info is None:
            return None
        text = package_info.__version__
    return parse_version(text, DISTRIBUTION)


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
        return f"{patch_name}: megatron-core is not installed (tested range {tested})"
    if not specifier.contains(installed, prereleases=True):
        return f"{patch_name}: megatron-core {installed} is outside the tested range {tested}"
    return None
