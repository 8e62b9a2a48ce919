"""Deprecated path of `megatron_lora_patch.export_peft` / `import_peft` (moved to `lora.exchange`)."""

from megatron_lora_patch.lora._moved import forward

_MODULE = forward(__name__, "megatron_lora_patch.lora.exchange.transfer",
                  "megatron_lora_patch.export_peft / import_peft")


def __getattr__(name: str):
    return getattr(_MODULE, name)
