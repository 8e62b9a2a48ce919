"""The `cpu_testbed` plugin: Megatron-Core on a CPU host with gloo (the `cpu_compat` patch).

Apart from `lora_correct` so that a production run never loads it: the oracle, the tests and
anyone who wants Megatron on CPU name it (`MEGATRON_PLUGINS=lora_correct,cpu_testbed`, or
`apply(plugins=["lora_correct", "cpu_testbed"])`). Naming the plugin is the opt-in, so its
patch is on by default (and a no-op where CUDA is available).
"""

from __future__ import annotations

import importlib

from megatron_lora_patch.hookspecs import impl
from megatron_lora_patch.patching import PatchSpec

PLUGIN_NAME = "cpu_testbed"

#: Patch modules under `megatron_lora_patch.patches` this plugin contributes.
PATCH_MODULES: tuple[str, ...] = ("cpu_compat",)


@impl
def megatron_lora_patch_patches() -> list[PatchSpec]:
    return [importlib.import_module(f"megatron_lora_patch.patches.{name}").SPEC for name in PATCH_MODULES]
