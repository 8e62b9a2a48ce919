"""The `lora_correct` plugin: the production patches (the CPU host support is the separate
`cpu_testbed` plugin, `plugins/cpu_testbed.py`)."""

from __future__ import annotations

from megatron_lora_patch.patches import (
    finalize_grads,
    layout_invariant,
    lora_checkpoint,
    lora_linear,
    lora_plus,
    loss_normalization,
    null_tokenizer,
)
from megatron_lora_patch.runtime.hookspecs import impl
from megatron_lora_patch.runtime.patching import PatchSpec

#: The patch declarations this plugin contributes, in application order.
PATCHES = (
    lora_linear, lora_checkpoint, finalize_grads, loss_normalization, null_tokenizer, layout_invariant, lora_plus,
)
PATCH_NAMES = tuple(module.SPEC.name for module in PATCHES)


@impl
def megatron_lora_patch_patches() -> list[PatchSpec]:
    return [module.SPEC for module in PATCHES]


@impl
def megatron_lora_patch_env_variables() -> list[str]:
    """The LoRA variables (`lora.config`); the runtime owns its own flags."""
    from megatron_lora_patch.lora.config import env_variables

    return list(env_variables())


@impl
def megatron_lora_patch_configure() -> None:
    """Parse and check every LoRA variable now, once, whether or not `lora_linear` is enabled
    (a value the user set is a mistake either way); the model build uses this parse."""
    from megatron_lora_patch.lora.config import configure_from_env
    from megatron_lora_patch.runtime.errors import install_excepthook

    install_excepthook()  # a LoraConfigError here or at model build prints as one line
    configure_from_env()
