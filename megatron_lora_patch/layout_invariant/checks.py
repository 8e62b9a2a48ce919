"""What the layout-invariant mode refuses, checked when Megatron's DDP wraps a model chunk, before
any step (docs/architecture.md section 7). Each refusal is one line naming the fix.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.tree import check_dp_size


def _refuse(problem: str) -> None:
    raise LayoutInvariantUnsupported(f"layout_invariant: {problem}")


def check_parallelism(config: Any, ddp_config: Any) -> None:
    """Context / virtual-pipeline parallelism, MoE (`check_moe`), DP sizes off the lanes, overlapped or
    multi-instance grad reduction."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() > 1:
        _refuse("context parallelism splits attention's softmax sums across ranks (its combine order changes "
                "with cp); run the mode with context_parallel_size=1")
    if getattr(config, "num_moe_experts", None):
        check_moe(config)
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


#: MoE settings the mode does not cover: (config field, value it must have, why and what to set).
_MOE_SETTINGS = (
    ("moe_grouped_gemm", False, "grouped GEMMs size their work by the tokens each rank received; set "
     "moe_grouped_gemm=False (SequentialMLP)"),
    ("moe_expert_capacity_factor", None, "token dropping keeps a per-rank capacity; set "
     "moe_expert_capacity_factor=None"),
    ("moe_pad_expert_input_to_capacity", False, "padding to capacity follows per-rank counts; turn it off"),
    ("moe_apply_probs_on_input", False, "set moe_apply_probs_on_input=False"),
    ("moe_shared_expert_intermediate_size", None, "shared experts are not proven bit-exact yet; drop them"),
    ("add_bias_linear", False, "Megatron scales an expert's fc2 bias by the router probability inside the MLP, "
     "which the mode takes over (the probabilities' grad); set add_bias_linear=False"),
    ("moe_router_enable_expert_bias", False, "the expert-bias update is not proven bit-exact yet; turn it off"),
)


def expert_layout_problem(tp: int, etp: int, ep: int) -> Optional[str]:
    """Why the mode cannot run MoE at these tensor / expert-tensor / expert parallel sizes, or None
    (docs/architecture.md section 7: proven at tp 1, 2, 4 with etp 1, 2 and etp = tp)."""
    if tp > 4:
        return (f"MoE at tensor_model_parallel_size={tp} is not proven (tp 1, 2 and 4 are); run MoE models at "
                "tensor_model_parallel_size <= 4")
    if (etp * ep) % tp:
        return (f"MoE at tp={tp} with etp={etp}, ep={ep} sends one microbatch's sequence shards to different copies "
                "of an expert; make expert_tensor_parallel_size * expert_model_parallel_size a multiple of tp")
    if etp > 2 and etp != tp:
        return (f"expert tensor parallelism etp={etp} is not proven (etp 1, 2 and etp = tp are); set "
                "expert_tensor_parallel_size to 1, 2 or tensor_model_parallel_size")
    if etp > tp and ep == 1:
        return ("etp > tp without expert parallelism is not proven (etp = tp is, and etp 2 with ep >= 2); set "
                "expert_model_parallel_size >= 2 or expert_tensor_parallel_size=tensor_model_parallel_size")
    return None


def check_moe(config: Any) -> None:
    """MoE (docs/architecture.md section 7): SequentialMLP experts behind the allgather / alltoall dispatcher,
    at the sizes `expert_layout_problem` accepts, top-k <= 2, no aux / z loss, no token dropping, no linear
    biases."""
    from megatron.core import parallel_state

    problem = expert_layout_problem(parallel_state.get_tensor_model_parallel_world_size(),
                                    parallel_state.get_expert_tensor_parallel_world_size(),
                                    parallel_state.get_expert_model_parallel_world_size())
    if problem:
        _refuse(problem)
    _check_shared_outer()
    if config.moe_router_topk > 2:
        _refuse(f"top-{config.moe_router_topk} routing sums 3+ expert outputs per token in an ep-dependent "
                "order; use moe_router_topk <= 2")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(config, name, None)
        if any(value if isinstance(value, (list, tuple)) else [value]):
            _refuse(f"{name}={value} adds a loss whose per-rank statistics change with ep; "
                    f"set {name}=0")
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        _refuse(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: the chunked experts read the "
                "allgather or alltoall dispatcher's segments; set moe_token_dispatcher_type='allgather' or 'alltoall'")
    problem = moe_settings_problem(config)
    if problem:
        _refuse(problem)


def moe_settings_problem(config: Any) -> Optional[str]:
    """Every MoE setting of `config` (a `TransformerConfig`, or anything with its field names, such as the
    oracle's model spec) that the mode does not cover, with why and what to set; None if there is none."""
    problems = [
        f"{name}={getattr(config, name)!r}: {why}"
        for name, wanted, why in _MOE_SETTINGS
        if getattr(config, name, wanted) != wanted
    ]
    return "; ".join(problems) or None


def _check_shared_outer() -> None:
    """Shared outer expert factors are dense parameters that every expert uses: their grads would reach the
    expert lanes from a dense grad buffer (lora/layers/shared_outer.py refuses it too, but only when the mode
    is applied before the adapters are attached)."""
    from megatron_lora_patch.lora.config import active

    if active().expert_shared_outer:
        _refuse("shared outer expert factors (MEGATRON_LORA_EXPERT_SHARED_OUTER) are not proven bit-exact; "
                "unset MEGATRON_LORA_EXPERT_SHARED_OUTER or turn the layout_invariant patch off")


def check_training(config: Any, module: Any) -> None:
    """Loss normalization, dropout, DoRA and trainable tied embeddings under pipeline parallelism."""
    from megatron.core import parallel_state

    from megatron_lora_patch.lora.adapters.metadata import adapter_info

    if not config.calculate_per_token_loss:
        _refuse("without calculate_per_token_loss each microbatch loss is divided by the per-rank microbatch "
                "count, which changes with dp; enable the loss_normalization patch (or calculate_per_token_loss)")
    if getattr(config, "hidden_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        _refuse("dropout draws its masks per rank and per local microbatch; set hidden_dropout=0 and "
                "attention_dropout=0")
    if any(getattr(adapter_info(param), "factor", None) == "m" for param in module.parameters()):
        _refuse("DoRA's magnitudes are not proven bit-exact (the mode's TP-invariant linears have no DoRA rescale); "
                "set MEGATRON_LORA_DORA=0 or turn the layout_invariant patch off")
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if pipelined and any(param.requires_grad and getattr(param, "shared_embedding", False)
                         for param in module.parameters()):
        _refuse("a trainable tied embedding gets its grad summed across the first and last pipeline stage "
                "(another order than at pp=1); untie it, freeze it, or use pp=1")
