"""What the layout-invariant mode refuses, checked when Megatron's DDP wraps a model chunk, before
any step (docs/architecture.md section 7). Each refusal is one line naming the fix.
"""

from __future__ import annotations

from typing import Any

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.tree import check_dp_size


def _refuse(problem: str) -> None:
    raise LayoutInvariantUnsupported(f"layout_invariant: {problem}")


def check_parallelism(config: Any, ddp_config: Any) -> None:
    """Context / expert / virtual-pipeline parallelism, DP sizes off the lanes, overlapped or
    multi-instance grad reduction."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() > 1:
        _refuse("context parallelism splits attention's softmax sums across ranks (its combine order changes "
                "with cp); run the mode with context_parallel_size=1")
    if parallel_state.get_expert_model_parallel_world_size() > 1 or getattr(config, "num_moe_experts", None):
        _refuse("MoE experts are not covered (token counts per expert rank change the GEMM shapes); "
                "turn the layout_invariant patch off for MoE models")
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        _refuse("virtual pipeline stages interleave microbatches across chunks; drop "
                "virtual_pipeline_model_parallel_size")
    if ddp_config.overlap_grad_reduce:
        _refuse("overlap_grad_reduce all-reduces buckets as they fill, in a DP-dependent order; set "
                "overlap_grad_reduce=False")
    if getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
        _refuse("several distributed-optimizer instances reduce in two levels; set "
                "num_distributed_optimizer_instances=1")
    check_dp_size(parallel_state.get_data_parallel_world_size())


def check_training(config: Any, module: Any) -> None:
    """Loss normalization, dropout and trainable tied embeddings under pipeline parallelism."""
    from megatron.core import parallel_state

    if not config.calculate_per_token_loss:
        _refuse("without calculate_per_token_loss each microbatch loss is divided by the per-rank microbatch "
                "count, which changes with dp; enable the loss_normalization patch (or calculate_per_token_loss)")
    if getattr(config, "hidden_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        _refuse("dropout draws its masks per rank and per local microbatch; set hidden_dropout=0 and "
                "attention_dropout=0")
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if pipelined and any(param.requires_grad and getattr(param, "shared_embedding", False)
                         for param in module.parameters()):
        _refuse("a trainable tied embedding gets its grad summed across the first and last pipeline stage "
                "(another order than at pp=1); untie it, freeze it, or use pp=1")
