"""`finalize_grads`: after Megatron's `finalize_model_grads`, SUM replicated LoRA factor grads over their domain.

What it changes (docs/architecture.md sections 3-4; the logic is `megatron_lora_patch.integrations.finalize_grads`):
- `megatron.core.distributed.finalize_model_grads` (the function and the package re-export
  Megatron-LM binds into `config.finalize_model_grads_func`): Megatron's finalize with its
  arguments unchanged, then `lora.grad_sync.sum_replicated_adapter_grads(model)`.
- The schedules' `forward_backward_*`: note a training step finalize must cover; a
  `config.finalize_model_grads_func` bound before the patch is swapped during the call.
- `MixedPrecisionOptimizer.prepare_grads` / `FP32Optimizer.prepare_grads`: refuse (strict)
  or warn once about grads no finalize covered after the last backward (SkyRL #223).
- `tensor_parallel.param_is_not_tensor_parallel_duplicate` (grad norm, zero count, and its
  copy bound in `clip_grads`): a replicated factor counts on rank 0 of ITS domain group.
"""

from __future__ import annotations

from megatron_lora_patch.integrations import finalize_grads as finalize
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

SPEC = PatchSpec(
    name="finalize_grads",
    summary="after finalize_model_grads, SUM replicated LoRA factor grads over their TP / expert-TP domain; "
    "flag steps that skip finalize; count replicated factors once in the grad norm",
    hooks={
        "megatron.core.distributed": finalize.patch_distributed,
        "megatron.core.pipeline_parallel.schedules": finalize.patch_schedules,
        "megatron.core.optimizer.optimizer": finalize.patch_optimizer,
        "megatron.core.tensor_parallel": finalize.patch_duplicate_predicate,
        "megatron.core.optimizer.clip_grads": finalize.rebind_clip_grads_predicate,
    },
    versions=tested_range(),
    default=True,
)
