"""The `lora_correct` plugin: the production patches (the CPU host support is the separate
`cpu_testbed` plugin, `cpu_testbed/plugin.py`)."""

from __future__ import annotations

import importlib
from megatron_lora_patch.hookspecs import impl
from megatron_lora_patch.patching import PatchSpec

#: Patch modules under `megatron_lora_patch.patches`, in application order.
PATCH_MODULES: tuple[str, ...] = (
    "lora_linear", "lora_checkpoint", "finalize_grads", "loss_normalization", "null_tokenizer", "layout_invariant",
)


@impl
def megatron_lora_patch_patches() -> list[PatchSpec]:
    return [importlib.import_module(f"megatron_lora_patch.patches.{name}").SPEC for name in PATCH_MODULES]


@impl
def megatron_lora_patch_env_variables() -> list[str]:
    """The LoRA variables (`lora.config`); the runtime owns its own flags."""
    from megatron_lora_patch.lora.config import env_variables

    return list(env_variables())


@impl
def megatron_lora_patch_configure() -> None:
    """Parse and check every LoRA variable now, once, whether or not `lora_linear` is enabled
    (a value the user set is a mistake either way); the model build uses this parse."""
    from megatron_lora_patch.errors import install_excepthook
    from megatron_lora_patch.lora.config import configure_from_env

    install_excepthook()  # a LoraConfigError here or at model build prints as one line
    configure_from_env()
