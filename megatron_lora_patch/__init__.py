"""megatron-lora-patch: topology-correct LoRA for Megatron-Core, applied by import-time patches.

The public API is what this module names in `__all__` (docs/api.md); internal modules may move, these names
do not. This package is imported by the start-up `.pth` hook, so importing it must stay cheap: every name is
loaded on first use.
"""

__version__ = "0.1.0"

#: public name -> (module that defines it, attribute; None: the module itself)
_PUBLIC = {
    "apply": ("megatron_lora_patch.runtime.registry", "apply"),
    "revert": ("megatron_lora_patch.runtime.registry", "revert"),
    "status": ("megatron_lora_patch.runtime.registry", "status"),
    "SkipPatch": ("megatron_lora_patch.runtime.registry", "SkipPatch"),
    "save_adapters": ("megatron_lora_patch.lora.checkpoints.checkpoint", "save_adapters"),
    "load_adapters": ("megatron_lora_patch.lora.checkpoints.checkpoint", "load_adapters"),
    "export_peft": ("megatron_lora_patch.lora.exchange.transfer", "export_peft"),
    "import_peft": ("megatron_lora_patch.lora.exchange.transfer", "import_peft"),
    "handoff": ("megatron_lora_patch.handoff", None),
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):  # no `typing` or `importlib` at import time: this module is on the start-up path
    if name not in _PUBLIC:
        raise AttributeError(f"module 'megatron_lora_patch' has no attribute {name!r}")
    import importlib

    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


def __dir__():
    return sorted([*globals(), *_PUBLIC])


def _map_checkout_patches() -> None:
    """Imported from a source checkout (never installed, or installed editable), the patches are the repository's
    top-level `patches/`, not a subpackage here: map `megatron_lora_patch.patches` to it (`_checkout`). An
    installed wheel holds `patches/__init__.py` in this directory, so there this costs one `stat`, imports nothing."""
    import os  # on the start-up path `site` has loaded it already

    here = os.path.dirname(__file__)
    checkout_patches = os.path.join(os.path.dirname(here), "patches")
    if not os.path.isfile(os.path.join(here, "patches", "__init__.py")) and os.path.isfile(
        os.path.join(checkout_patches, "__init__.py")
    ):
        from megatron_lora_patch import _checkout

        _checkout.install(checkout_patches)


_map_checkout_patches()
del _map_checkout_patches
