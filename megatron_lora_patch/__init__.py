"""megatron-lora-patch: topology-correct LoRA for Megatron-Core, applied by import-time patches.

This package is imported by the start-up `.pth` hook, so importing it must stay cheap:
the programmatic API (`apply`, `revert`, `status`) is loaded on first use.
"""

__version__ = "0.1.0"
__all__ = ["apply", "revert", "status", "SkipPatch"]


def __getattr__(name: str):  # no `typing` here: this module is on the start-up path
    if name in __all__:
        from megatron_lora_patch.runtime import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'megatron_lora_patch' has no attribute {name!r}")
