"""`lora_plus`: LoRA+ (PEFT's `loraplus_lr_ratio`): every LoRA B learns at `MEGATRON_LORA_PLUS_RATIO` times A's rate.

What it changes (docs/architecture.md section 3):
- `megatron.core.optimizer.get_megatron_optimizer` (and the copy Megatron-LM's `megatron.training.training`
  imports by name, so `setup_model_and_optimizer` picks it up with no change to the user's script): with a
  ratio other than 1 it adds Megatron's own parameter-group override for the B factors before the optimizer
  is built (`config_overrides` on 0.16+, `scale_lr_cond` / `lr_mult` on 0.13-0.15;
  `megatron_lora_patch.lora.training.lora_plus` says how). With ratio 1, the default, the call is untouched.

Torch and Megatron are imported inside the wrapper, so importing this module stays cheap.
"""

from __future__ import annotations

import types

from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import Patcher, PatchSpec

TRAINING_MODULE = "megatron.training.training"


def _get_megatron_optimizer(wrapped, instance, args, kwargs):
    """Megatron's optimizer build, with the B factors' learning rate scaled when LoRA+ is on."""
    from megatron_lora_patch.lora.config import active_with_labels

    config, labels = active_with_labels()
    if config.plus_ratio == 1.0:
        return wrapped(*args, **kwargs)
    from megatron_lora_patch.lora.training.lora_plus import build_optimizer

    return build_optimizer(wrapped, args, kwargs, config.plus_ratio, labels["plus_ratio"])


def patch_optimizer(patcher: Patcher, optimizer: types.ModuleType) -> None:
    """Wrap the builder in its package and in Megatron-LM's training module (imported by name there)."""
    patcher.wrap(optimizer, "get_megatron_optimizer", _get_megatron_optimizer, reexported_by=(TRAINING_MODULE,))


SPEC = PatchSpec(
    name="lora_plus",
    summary="LoRA+: LoRA B factors at MEGATRON_LORA_PLUS_RATIO times A's learning rate, through Megatron's "
    "optimizer param-group overrides",
    hooks={"megatron.core.optimizer": patch_optimizer},
    versions=tested_range(),
    default=True,
)
