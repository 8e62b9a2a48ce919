"""The known bugs the oracle's sensitivity mutations re-introduce, one function each: LoRA's replicated-factor grad
sum, adapter construction, its forward / backward collectives and LoRA+. Gradient sync's bugs (DP, token
normalization, grad norm, param gather) are in `known_bugs_sync`; MoE's, MLA's, DoRA's and packed data's in theirs.

Each `install(patcher)` bends exactly one invariant of docs/architecture.md section 4 or 5, at
the place where the real bug lived, through the given `Patcher` (reverted when the job ends);
`finalize_with_*` are `finalize_model_grads_func` replacements. They are module-level
functions because jobs are pickled to spawned ranks. `oracle.mutations` names them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Tuple

from megatron_lora_patch.runtime.patching import Patcher

# -- replicated-factor grad SUM (lora.grad_sync) -------------------------------------------


def _without_replicated(predicate: Callable[[Any], bool]) -> Callable:
    """A `replicated_adapter_params` wrapper that drops the factors `predicate(info)` selects.

    `bucket_replicated_adapter_grads` looks the generator up in its module at call time,
    so the dropped factors keep their per-rank partial grads (the SUM never happens).
    """

    def wrapper(wrapped, instance, args, kwargs) -> Iterator[Tuple[Any, Any]]:
        return ((param, info) for param, info in wrapped(*args, **kwargs) if not predicate(info))

    return wrapper


def _is_dense_column_a(info) -> bool:
    return info.domain == "tp" and info.factor == "A"


def _is_dense_row_b(info) -> bool:
    return info.domain == "tp" and info.factor == "B"


def _is_expert(info) -> bool:
    return info.domain == "expert_tp"


def skip_tp_sum_column_a(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.training import grad_sync

    patcher.wrap(grad_sync, "replicated_adapter_params", _without_replicated(_is_dense_column_a))


def skip_tp_sum_row_b(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.training import grad_sync

    patcher.wrap(grad_sync, "replicated_adapter_params", _without_replicated(_is_dense_row_b))


def skip_expert_tp_sum(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.training import grad_sync

    patcher.wrap(grad_sync, "replicated_adapter_params", _without_replicated(_is_expert))


def _average_after_sum(wrapped, instance, args, kwargs):
    """SUM as usual, then divide by the domain size: an AVG all-reduce."""
    import torch.distributed

    from megatron_lora_patch.lora.training import grad_sync

    chunks = list(args[0] if args else kwargs["model_chunks"])
    issued = wrapped(chunks)
    for param, info in grad_sync.replicated_adapter_params(chunks):
        grad = grad_sync.grad_of(param)
        if grad is not None:
            grad.div_(torch.distributed.get_world_size(info.group))
    return issued


def avg_instead_of_sum(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.training import grad_sync

    patcher.wrap(grad_sync, "sum_replicated_adapter_grads", _average_after_sum)


# -- adapter construction (lora.adapter, lora.attach) --------------------------------------


def _init_then(fix: Callable[[Any, Any, dict], None]) -> Callable:
    """A `LoraAdapter.__init__` wrapper running `fix(adapter, layer, kwargs)` after the real init."""

    def wrapper(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        import torch

        with torch.no_grad():
            fix(instance, args[0] if args else kwargs["layer"], kwargs)

    return wrapper


def _tp_world(adapter) -> int:
    from megatron.core.utils import get_pg_size

    return get_pg_size(adapter.tp_group)


def _qkv_b_sharded_as_q_k_v(adapter, layer, kwargs) -> None:
    """qkv B cut contiguously from `[all q | all k | all v]` instead of Megatron's per-group packing."""
    import torch
    from megatron.core.utils import get_pg_rank

    from megatron_lora_patch.lora.adapters import adapter as adapter_module
    from megatron_lora_patch.lora.adapters.layouts import qkv_mixed_to_separate, shard

    if not adapter.module_name.endswith("linear_qkv"):
        return
    config = layer.config
    _, logical_b = adapter_module.logical_factors(
        kwargs["config"], adapter.module_name, adapter.expert_index, layer.input_size, layer.output_size
    )
    q, k, v = qkv_mixed_to_separate(logical_b, config.num_attention_heads, config.num_query_groups, config.kv_channels)
    wrong = shard(torch.cat([q, k, v]), 0, get_pg_rank(adapter.tp_group), _tp_world(adapter))
    adapter.B.copy_(wrong)


def wrong_qkv_packing(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.adapters.adapter import LoraAdapter

    patcher.wrap(LoraAdapter, "__init__", _init_then(_qkv_b_sharded_as_q_k_v))


def _row_a_bound_from_local_fan_in(adapter, layer, kwargs) -> None:
    """Kaiming bound 1/sqrt(in / tp) of the local shard: the same draw, scaled by sqrt(tp)."""
    if adapter.parallel_mode == "row":
        adapter.A.mul_(math.sqrt(_tp_world(adapter)))


def xavier_fan_in_local_shard(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.adapters.adapter import LoraAdapter

    patcher.wrap(LoraAdapter, "__init__", _init_then(_row_a_bound_from_local_fan_in))


def _expert_factors_on_dense_dp(adapter, layer, kwargs) -> None:
    """allreduce=True puts expert factors in DDP's dense buffers: broadcast and summed over dense DP."""
    if adapter.is_expert:
        adapter.A.allreduce = True
        adapter.B.allreduce = True


def expert_grads_over_dense_dp(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.adapters.adapter import LoraAdapter

    patcher.wrap(LoraAdapter, "__init__", _init_then(_expert_factors_on_dense_dp))


def _seeded_per_rank(wrapped, instance, args, kwargs):
    """The logical factors drawn from `seed + global rank` (torch.manual_seed(seed + rank) style)."""
    import torch.distributed

    config = args[0] if args else kwargs.pop("config")
    config = dataclasses.replace(config, seed=config.seed + torch.distributed.get_rank())
    return wrapped(config, *args[1:], **kwargs)


def rank_local_random_init(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.adapters import adapter

    patcher.wrap(adapter, "logical_factors", _seeded_per_rank)


def _plain_split(wrapped, instance, args, kwargs) -> int:
    return 1


def swiglu_gate_up_mismatch(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.layers import attach

    patcher.wrap(attach, "_out_stride", _plain_split)


# -- LoRA forward / backward collectives (lora.linear, lora.adapter) -----------------------


def _column_lora_on_local_input(wrapped, instance, args, kwargs):
    """The base linear does its own input collective; LoRA reads the rank-local input.

    Without SP the copy-to-TP-region all-reduce of the input grad then carries only the
    base's dx: each rank adds its own partial LoRA dx on top.
    """
    linear, call, adapter = args
    if call.get("sequence_parallel"):
        raise ValueError("lora_input_grad_outside_collective models the non-SP path; use tp2 without sp")
    local_input = call["input"]
    return linear(**call) + adapter.column_term(local_input, None)


def lora_input_grad_outside_collective(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.layers import linear

    patcher.wrap(linear, "column_call", _column_lora_on_local_input)


def _expert_row_term_all_reduced(wrapped, instance, args, kwargs):
    """An expert row LoRA term made whole (all-reduced over expert TP) before the dispatcher sums it
    (the base partial it is added to stays partial, as on the correct path). Wraps `LoraAdapter.up`,
    where every row term meets its base output."""
    if not (instance.is_expert and instance.parallel_mode == "row"):
        return wrapped(*args, **kwargs)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    hidden, base_output = args[0], (args[1] if len(args) > 1 else kwargs.get("base_output"))
    term = reduce_from_tensor_model_parallel_region(wrapped(hidden), group=instance.tp_group)
    return term if base_output is None else base_output + term


def full_output_on_partial_sum_expert_path(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.adapters.adapter import LoraAdapter

    patcher.wrap(LoraAdapter, "up", _expert_row_term_all_reduced)


# -- LoRA+ (lora.training.lora_plus) --------------------------------------------------------


def _a_factor(wrapped, instance, args, kwargs) -> bool:
    """The factor LoRA+ speeds up is A, not B."""
    from megatron_lora_patch.lora.adapters.metadata import adapter_info

    param = args[0] if args else kwargs["param"]
    info = adapter_info(param)
    return info is not None and info.factor == "A"


def lora_plus_ratio_on_a(patcher: Patcher) -> None:
    from megatron_lora_patch.lora.training import lora_plus

    patcher.wrap(lora_plus, "is_plus_factor", _a_factor)
