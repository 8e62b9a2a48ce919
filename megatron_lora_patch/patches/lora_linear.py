"""`lora_linear`: LoRA adapters on Megatron's tensor-parallel linear layers (docs/architecture.md section 4).

Targets (the hooks are `megatron_lora_patch.integrations.lora_linear`):
- `megatron.core.tensor_parallel.layers`: the layer `forward`s announce their adapter
  and the module-global linear functions add the LoRA term on the base layer's own
  collectives (see `megatron_lora_patch.lora.layers.linear` for why this hook point).
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
- `megatron.core.extensions.transformer_engine` (only where Transformer Engine imports):
  `TELinear.forward` (TEColumnParallelLinear, TERowParallelLinear),
  `TELayerNormColumnParallelLinear.forward` and `TEGroupedLinear.forward` add the LoRA
  term beside TE's fused module; TE does its TP comm inside, so that branch has small
  collectives of its own (`megatron_lora_patch.lora.layers.te`; not verified on a TE machine yet).
"""

from __future__ import annotations

from megatron_lora_patch.integrations import lora_linear as hooks
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

SPEC = PatchSpec(
    name="lora_linear",
    summary="LoRA adapters on Column/RowParallelLinear riding the base layer's collectives; base frozen",
    hooks={
        "megatron.core.tensor_parallel.layers": hooks.patch_layers,
        "megatron.core.tensor_parallel": hooks.patch_tensor_parallel,
        "megatron.core.models.gpt.gpt_model": hooks.patch_gpt_model,
        "megatron.core.models.hybrid.hybrid_model": hooks.patch_hybrid_model,
        "megatron.core.models.mamba.mamba_model": hooks.patch_mamba_model,
        "megatron.core.transformer.transformer_block": hooks.patch_transformer_block,
        "megatron.core.models.hybrid.hybrid_block": hooks.patch_hybrid_block,
        "megatron.core.extensions.transformer_engine": hooks.patch_transformer_engine,
    },
    versions=tested_range(),
    default=True,
)
