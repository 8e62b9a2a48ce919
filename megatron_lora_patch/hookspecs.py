"""The plugin interface: what a `megatron_lora_patch.plugins` entry point may implement.

Plugins mark implementations with `megatron_lora_patch.hookspecs.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

PROJECT = "megatron_lora_patch"
ENTRY_POINT_GROUP = "megatron_lora_patch.plugins"

_spec = pluggy.HookspecMarker(PROJECT)
impl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from megatron_lora_patch.patching import PatchSpec
    from megatron_lora_patch.runtime import Settings


@_spec
def megatron_lora_patch_patches() -> "list[PatchSpec]":
    """Return the patches this plugin contributes (cheap: no torch / Megatron imports)."""


@_spec
def megatron_lora_patch_configure(settings: "Settings") -> None:
    """React to the resolved settings (enabled patches, strict) before any patch is applied."""


@_spec
def megatron_lora_patch_env_variables() -> "list[str]":
    """Return the names of the MEGATRON_LORA_* environment variables this plugin reads, so the
    runtime can reject an unknown one (a typo) with a "did you mean"."""
