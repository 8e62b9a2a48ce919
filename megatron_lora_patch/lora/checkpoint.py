"""Deprecated path of `megatron_lora_patch.save_adapters` / `load_adapters` (moved to `lora.checkpoints`)."""

from megatron_lora_patch.lora._moved import forward

_MODULE = forward(__name__, "megatron_lora_patch.lora.checkpoints.checkpoint",
                  "megatron_lora_patch.save_adapters / load_adapters")


def __getattr__(name: str):
    return getattr(_MODULE, name)
