"""The plugin interface: what a `megatron_lora_patch.plugins` entry point may implement.

Plugins mark implementations with `megatron_lora_patch.runtime.hookspecs.impl`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

import pluggy

PROJECT = "megatron_lora_patch"
ENTRY_POINT_GROUP = "megatron_lora_patch.plugins"

spec = pluggy.HookspecMarker(PROJECT)
impl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from megatron_lora_patch.runtime.patching import PatchSpec


@dataclasses.dataclass(frozen=True)
class Settings:
    """What plugins see in `megatron_lora_patch_configure`."""

    plugins: tuple[str, ...]
    strict: bool
    enabled: Mapping[str, bool]


@spec
def megatron_lora_patch_patches() -> "list[PatchSpec]":
    """Return the patches this plugin contributes (cheap: no torch / Megatron imports)."""


@spec
def megatron_lora_patch_configure(settings: "Settings") -> None:
    """React to the resolved settings (enabled patches, strict) before any patch is applied."""


@spec
def megatron_lora_patch_env_variables() -> "list[str]":
    """Return the names of the MEGATRON_LORA_* environment variables this plugin reads, so the
    runtime can reject an unknown one (a typo) with a "did you mean"."""
