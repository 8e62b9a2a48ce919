"""`loss_normalization`: the step loss is summed loss / GLOBAL trainable-token count (docs/architecture.md section 5).

Megatron-Core does this when `config.calculate_per_token_loss` is on; off (the default),
each rank divides by its own token count and DDP averages over DP: a mean of per-rank
means, wrong whenever ranks or microbatches hold different numbers of trainable tokens.
What it changes (the logic is `megatron_lora_patch.integrations.loss_normalization`):
- `TransformerConfig.__post_init__` sets `calculate_per_token_loss = True`;
- `DistributedDataParallel.__init__` does the same for a config built before the patch and
  turns off `ddp_config.average_in_collective` (the collective must SUM);
- the schedule's loss step (`forward_step_calc_loss` from 0.14, `forward_step` in 0.13)
  checks each loss function's result: a legacy 2-tuple `(mean, report)` raises (strict) or
  warns once and keeps Megatron's legacy mean-of-means gradients.
The reported loss is untouched.
"""

from __future__ import annotations

from megatron_lora_patch.integrations import loss_normalization
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

SPEC = PatchSpec(
    name="loss_normalization",
    summary="global token normalization: calculate_per_token_loss on before DDP is built, "
    "legacy 2-tuple loss functions detected at the first microbatch",
    hooks={
        "megatron.core.transformer.transformer_config": loss_normalization.patch_transformer_config,
        "megatron.core.distributed.distributed_data_parallel": loss_normalization.patch_ddp,
        "megatron.core.pipeline_parallel.schedules": loss_normalization.patch_schedules,
    },
    versions=tested_range(),
    default=True,
)
