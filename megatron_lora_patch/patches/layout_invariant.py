"""`layout_invariant`: bitwise-identical LoRA training across TP = 1/2/4 (with or without SP),
DP = 1/2/4/8, PP = 1/2/... and (MoE, tp 1/2/4) EP = 1/2/4 x ETP = 1/2 with a fixed global batch and micro batch
size (opt-in).

docs/architecture.md section 7; the TP techniques from Megatron-LM #4740 (dense full training
there), extended to the LoRA branch, data and pipeline parallelism. Turn it on in every rank,
before training, with `megatron_lora_patch.apply(..., enable={"layout_invariant": True})` or
`MEGATRON_LORA_PATCH_LAYOUT_INVARIANT=1` (the old name `tp_invariant` still works, with a
deprecation warning); it changes world size 1 too (same code path).

What it changes (the hooks are `megatron_lora_patch.integrations.layout_invariant`; the mode's library is
`megatron_lora_patch.layout_invariant`, its `tensor_parallel` subpackage the per-layer math):
- `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl`: base + LoRA on the
  local shards in fixed-shape chunks, every sum over a sharded dimension in one canonical segment
  tree finished over TP by an all-gather of activation-sized partials; no rank holds a full base
  weight (`layout_invariant.tensor_parallel.linear`, `segmented`, `shares`); replaces the `lora_linear`
  adapter call inside those layers while on. `MLP.__init__` marks a gated fc1's stride.
- `tensor_parallel.vocab_parallel_cross_entropy` (and its re-export) and the language module's
  `fused_vocab_parallel_cross_entropy`: one reduction over the whole vocabulary.
- `MegatronOptimizer.get_grad_norm` / `clip_grad_norm`, `ChainedOptimizer.get_grad_norm`:
  float64 norm of the logical grads, summed exactly over parameters and pipeline stages.
- `DistributedDataParallel.__init__` / `_make_backward_post_hook` / `zero_grad_buffer` /
  `finish_grad_sync` and `schedules.backward_step`: each microbatch's grad goes into the lane
  of its global microbatch index; the lanes and the DP partials are summed in one canonical
  tree (an all-gather replaces DDP's all-reduce / reduce-scatter) (`layout_invariant.lanes`).
- `SequentialMLP.forward`, `MoEAllGatherTokenDispatcher.dispatch_postprocess`,
  `MoEAlltoAllTokenDispatcher.dispatch_preprocess`: each local expert
  runs on each microbatch's tokens (its sequence shards joined) in fixed-size chunks; its grads go into
  the lanes of their global microbatches, combined over all lanes under ep > 1 (`layout_invariant.experts`,
  `layout_invariant.expert_lanes`);
  the router probabilities are applied on `linear_fc2`'s input with a canonical grad (`layout_invariant.expert_probs`).
- `lora.grad_sync.set_complete_domains({"tp", "expert_tp"})`: replicated factors (dense and
  expert) leave the finalize SUM (their grads are complete on every rank).

Not covered (refused with one line before any step): MoE at tp > 4 or with tp not dividing etp * ep, etp > 2
unless etp = tp, etp > tp without ep, top-k > 2,
aux / z losses, token dropping, grouped GEMM, the flex dispatcher, shared experts, linear biases in MoE
models; context parallelism, virtual
pipeline stages, overlapped grad reduction, several distributed-optimizer instances, DP sizes
not dividing 8, dropout, LoRA dropout, label smoothing, trainable tied embeddings under PP,
the legacy (non per-token) loss, deferred embedding wgrad. Transformer Engine linears are not
routed through this path (local specs only). Megatron-Core >= 0.14.
"""

from __future__ import annotations

from megatron_lora_patch.integrations import layout_invariant as hooks
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

SPEC = PatchSpec(
    name="layout_invariant",
    summary="layout-invariant mode: world-size-1 GEMM order, full-vocabulary cross entropy, exact float64 grad "
    "norm, microbatch grads summed in one canonical tree; LoRA training bitwise identical across TP x DP x PP "
    "(costs compute and memory)",
    hooks={
        "megatron.core.tensor_parallel.layers": hooks.patch_layers,
        "megatron.core.transformer.mlp": hooks.patch_mlp,
        "megatron.core.tensor_parallel": hooks.patch_cross_entropy,
        "megatron.core.models.common.language_module.language_module": hooks.patch_language_module,
        "megatron.core.optimizer.optimizer": hooks.patch_optimizer,
        "megatron.core.distributed.distributed_data_parallel": hooks.patch_ddp,
        "megatron.core.pipeline_parallel.schedules": hooks.patch_schedules,
        "megatron.core.transformer.moe.experts": hooks.patch_experts,
        "megatron.core.transformer.moe.token_dispatcher": hooks.patch_token_dispatcher,
    },
    versions=tested_range("0.14"),
    default=False,
)
