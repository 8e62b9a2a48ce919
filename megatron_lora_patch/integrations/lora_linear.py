"""The hooks the `lora_linear` patch installs: each routes one Megatron-Core target to the LoRA
code of this package (`linear`, `attach`, `metadata`, `recompute`, `te`; docs/architecture.md section 4).
"""

from __future__ import annotations

LINEAR_FUNCTIONS = ("linear_with_frozen_weight", "linear_with_grad_accumulation_and_async_allreduce")


def patch_layers(patcher, layers) -> None:
    """Layer forwards announce their adapter; the module-global linear functions add the LoRA term."""
    from megatron_lora_patch.lora.layers.linear import layer_forward, linear_call

    for function_name in LINEAR_FUNCTIONS:
        patcher.wrap(layers, function_name, linear_call)
    patcher.wrap(layers.ColumnParallelLinear, "forward", layer_forward)
    patcher.wrap(layers.RowParallelLinear, "forward", layer_forward)


def _copy_adapter_metadata(wrapped, instance, args, kwargs):
    """Megatron's mixed-precision optimizers copy a param's TP attributes onto its fp32 main
    copy; the adapter metadata travels with them, because grad-norm code reads it there."""
    from megatron_lora_patch.lora.adapters.metadata import adapter_info, tag

    result = wrapped(*args, **kwargs)
    destination, source = (list(args) + [kwargs.get("destination_tensor"), kwargs.get("source_tensor")])[:2]
    info = adapter_info(source)
    if info is not None:
        tag(destination, info)
    return result


def patch_tensor_parallel(patcher, tensor_parallel) -> None:
    """Adapter metadata follows a param onto its fp32 main copy."""
    # The optimizers call it as `tensor_parallel.copy_tensor_model_parallel_attributes`.
    patcher.wrap(tensor_parallel, "copy_tensor_model_parallel_attributes", _copy_adapter_metadata)


def _attach_after_init(wrapped, instance, args, kwargs):
    """Adapters attach once the model is built: only then are the linears' qualified names known."""
    from megatron_lora_patch.lora.layers.attach import attach_adapters

    wrapped(*args, **kwargs)
    attach_adapters(instance)


def patch_gpt_model(patcher, gpt_model) -> None:
    """A constructed `GPTModel` gets its adapters and a frozen base."""
    patcher.wrap(gpt_model.GPTModel, "__init__", _attach_after_init)


def patch_hybrid_model(patcher, hybrid_model) -> None:
    """`HybridModel` (0.18+; `MambaModel` derives from it) gets its adapters like `GPTModel`."""
    patcher.wrap(hybrid_model.HybridModel, "__init__", _attach_after_init)


def patch_mamba_model(patcher, mamba_model) -> None:
    """`MambaModel` up to 0.17 (its own class then; from 0.18 a `HybridModel`, attached through that hook)."""
    if not any(base.__name__ == "HybridModel" for base in mamba_model.MambaModel.__mro__):
        patcher.wrap(mamba_model.MambaModel, "__init__", _attach_after_init)


def patch_transformer_block(patcher, transformer_block) -> None:
    """Full activation recompute: checkpointed layers get an input that requires grad."""
    from megatron_lora_patch.lora.training.recompute import checkpointed_forward

    if hasattr(transformer_block.TransformerBlock, "_checkpointed_forward"):  # up to 0.17
        patcher.wrap(transformer_block.TransformerBlock, "_checkpointed_forward", checkpointed_forward)
    else:  # 0.18+: `megatron.core.recompute.checkpointed_forward`, imported by name
        patcher.wrap(transformer_block, "checkpointed_forward", checkpointed_forward)


def patch_hybrid_block(patcher, hybrid_block) -> None:
    """The same for the hybrid block (0.18+)."""
    from megatron_lora_patch.lora.training.recompute import checkpointed_forward

    patcher.wrap(hybrid_block, "checkpointed_forward", checkpointed_forward)


TE_FORWARDS = {
    "TELinear": "linear_forward",
    "TELayerNormColumnParallelLinear": "layernorm_linear_forward",
    "TEGroupedLinear": "grouped_linear_forward",
}


def patch_transformer_engine(patcher, extensions) -> None:
    """Wrap the TE linears' forwards; nothing to do where TE is absent (the names are stubs then)."""
    if not getattr(extensions, "HAVE_TE", False):
        return
    from megatron_lora_patch.lora.layers import te

    for class_name, wrapper_name in TE_FORWARDS.items():
        cls = getattr(extensions, class_name, None)
        if isinstance(cls, type):
            patcher.wrap(cls, "forward", getattr(te, wrapper_name))
