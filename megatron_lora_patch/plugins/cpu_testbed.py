"""The `cpu_testbed` plugin: Megatron-Core on a CPU host with gloo (the `cpu_compat` patch).

Apart from `lora_correct` so that a production run never loads it: the oracle, the tests and
anyone who wants Megatron on CPU name it (`MEGATRON_PLUGINS=lora_correct,cpu_testbed`, or
`apply(plugins=["lora_correct", "cpu_testbed"])`). Naming the plugin is the opt-in, so its
patch is on by default (and a no-op where CUDA is available).
"""

from __future__ import annotations

from megatron_lora_patch.patches import cpu_compat
from megatron_lora_patch.runtime.hookspecs import impl
from megatron_lora_patch.runtime.patching import PatchSpec

PLUGIN_NAME = "cpu_testbed"

#: The patch declarations this plugin contributes.
PATCHES = (cpu_compat,)
PATCH_NAMES = tuple(module.SPEC.name for module in PATCHES)


@impl
def megatron_lora_patch_patches() -> list[PatchSpec]:
    return [module.SPEC for module in PATCHES]
