"""The `lora_correct` plugin: this package's own patches (DESIGN.md section 3)."""

from __future__ import annotations

import importlib

from megatron_lora_patch.hookspecs import impl
from megatron_lora_patch.patching import PatchSpec

#: Patch modules under `megatron_lora_patch.patches`, in application order.
PATCH_MODULES: tuple[str, ...] = ("cpu_compat", "lora_linear", "lora_checkpoint", "finalize_grads", "loss_normalization", "null_tokenizer", "tp_invariant")


@impl
def megatron_lora_patch_patches() -> list[PatchSpec]:
    return [importlib.import_module(f"megatron_lora_patch.patches.{name}").SPEC for name in PATCH_MODULES]
