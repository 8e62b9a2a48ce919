"""`lora_linear`: LoRA adapters on Megatron's tensor-parallel linear layers (docs/architecture.md section 4).

Targets (each hook below routes one of them to the LoRA code of this package: `lora.layers.linear`,
`lora.layers.attach`, `lora.adapters.metadata`, `lora.training.recompute`, `lora.layers.te`):
- `megatron.core.tensor_parallel.layers`: the layer `forward`s announce their adapter
  and the module-global linear functions add the LoRA term on the base layer's own
  collectives (see `megatron_lora_patch.lora.layers.linear` for why this hook point).
- `megatron.core.tensor_parallel.copy_tensor_model_parallel_attributes`: the adapter metadata
  follows a param onto the fp32 main copy Megatron's mixed-precision optimizers make (grad-norm
  code reads it there).
- `megatron.core.models.gpt.gpt_model`: when a `GPTModel` finishes construction, the
  adapters are attached to its targeted linears (their qualified names are known only
  then) and the base model is frozen, so an unchanged model provider trains LoRA only.
  Configuration: `megatron_lora_patch.lora.config.set_active(...)` or the
  `MEGATRON_LORA_*` environment variables.
- `megatron.core.models.hybrid.hybrid_model` (0.18+): the same for `HybridModel` (and
  `MambaModel`, its subclass there); `megatron.core.models.mamba.mamba_model` for the
  `MambaModel` of 0.13-0.17, a class of its own.
- `megatron.core.transformer.transformer_block` and (0.18+) `...models.hybrid.hybrid_block`:
  under full activation recompute the checkpointed layers get an input that requires
  grad, else the frozen embedding leaves them without any gradient (see
  `megatron_lora_patch.lora.training.recompute`).
- `megatron.core.transformer.multi_latent_attention`: MLA's `get_query_key_value_tensors` and the
  module-global `gather_from_tensor_model_parallel_region`: under TP the local spec's gather of the
  column-parallel kv down projection gets the missing TP SUM of the RoPE key's grad
  (`megatron_lora_patch.lora.layers.mla_rope_key` says why; Megatron leaves it a partial sum).
- `megatron.core.extensions.transformer_engine` (only where Transformer Engine imports):
  `TELinear.forward` (TEColumnParallelLinear, TERowParallelLinear),
  `TELayerNormColumnParallelLinear.forward` and `TEGroupedLinear.forward` add the LoRA
  term beside TE's fused module; TE does its TP comm inside, so that branch has small
  collectives of its own (`megatron_lora_patch.lora.layers.te`; not verified on a TE machine yet).
"""

from __future__ import annotations

from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

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


def patch_multi_latent_attention(patcher, mla_module) -> None:
    """The RoPE key's grad of the local spec's column-parallel kv down projection is summed over TP."""
    from megatron_lora_patch.lora.layers import mla_rope_key

    patcher.wrap(mla_module.MLASelfAttention, "get_query_key_value_tensors", mla_rope_key.query_key_value)
    patcher.wrap(mla_module, "gather_from_tensor_model_parallel_region", mla_rope_key.gather)


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


SPEC = PatchSpec(
    name="lora_linear",
    summary="LoRA adapters on Column/RowParallelLinear riding the base layer's collectives; base frozen",
    hooks={
        "megatron.core.tensor_parallel.layers": patch_layers,
        "megatron.core.tensor_parallel": patch_tensor_parallel,
        "megatron.core.models.gpt.gpt_model": patch_gpt_model,
        "megatron.core.models.hybrid.hybrid_model": patch_hybrid_model,
        "megatron.core.models.mamba.mamba_model": patch_mamba_model,
        "megatron.core.transformer.transformer_block": patch_transformer_block,
        "megatron.core.models.hybrid.hybrid_block": patch_hybrid_block,
        "megatron.core.transformer.multi_latent_attention": patch_multi_latent_attention,
        "megatron.core.extensions.transformer_engine": patch_transformer_engine,
    },
    versions=tested_range(),
    default=True,
)
