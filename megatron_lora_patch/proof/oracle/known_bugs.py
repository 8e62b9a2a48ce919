"""The known bugs the oracle's sensitivity mutations re-introduce, one function each.

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


# -- DP sync, token normalization, grad norm -----------------------------------------------


def _scaled_by_dp_size(wrapped, instance, args, kwargs):
    """DDP pre-scales every bucket by 1/(its DP group size), as if averaging, on top of 1/num_tokens."""
    import inspect

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    group = bound.arguments["data_parallel_group"]
    bound.arguments["gradient_scaling_factor"] /= group.size()
    return wrapped(*bound.args, **bound.kwargs)


def ddp_average_on_top(patcher: Patcher) -> None:
    from megatron.core.distributed import param_and_grad_buffer

    patcher.wrap(param_and_grad_buffer._ParamAndGradBuffer, "__init__", _scaled_by_dp_size)


def _optimized_with_model_params(optimizer) -> Iterator[Tuple[Any, Any]]:
    """(model param, the param whose grad the norm reads): the fp32 main copy under bf16/fp16,
    which does not carry the adapter metadata."""
    if hasattr(optimizer, "float16_groups"):
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            yield from zip(model_group, main_group)
        for group in optimizer.fp32_from_fp32_groups:
            yield from ((param, param) for param in group)
    else:
        yield from ((param, param) for param in optimizer.get_parameters())


def _replicated_counted_on_every_rank(wrapped, instance, args, kwargs):
    """Grad-norm inputs as if replicated factors carried `tensor_model_parallel=True`."""
    from megatron_lora_patch.lora.adapters.metadata import adapter_info

    grads = wrapped(*args, **kwargs)
    counted = {id(grad) for grad in grads}
    for model_param, main_param in _optimized_with_model_params(instance):
        info = adapter_info(model_param)
        grad = main_param.grad
        if info is not None and info.replicated and grad is not None and id(grad) not in counted:
            grads.append(grad)
    return grads


def grad_norm_metadata_on_replicated(patcher: Patcher) -> None:
    from megatron.core.optimizer import optimizer

    # Megatron-Core 0.19 renamed it `get_grads_for_grad_norm(grad_norm_group=None)`.
    renamed = hasattr(optimizer.MegatronOptimizer, "get_grads_for_grad_norm")
    name = "get_grads_for_grad_norm" if renamed else "get_main_grads_for_grad_norm"
    patcher.wrap(optimizer.MegatronOptimizer, name, _replicated_counted_on_every_rank)


def _finalize_dividing_by(token_group, model, num_tokens, args, kwargs):
    """Megatron's finalize without its token scaling, then 1/num_tokens summed over `token_group` only."""
    import torch.distributed
    from megatron.core import distributed, parallel_state

    result = distributed.finalize_model_grads(model, None, *args, **kwargs)
    if num_tokens is None:
        return result
    torch.distributed.broadcast(  # the count lives on the last pipeline stage, as in finalize
        num_tokens,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    if token_group is not None:
        torch.distributed.all_reduce(num_tokens, group=token_group)
    if num_tokens > 0:
        for chunk in model:
            chunk.scale_gradients(1.0 / num_tokens)
    return result


def finalize_with_rank_local_token_count(model, num_tokens=None, *args, **kwargs):
    """finalize_model_grads_func that normalizes by this rank's own token count."""
    return _finalize_dividing_by(None, model, num_tokens, args, kwargs)


def finalize_with_dp_only_token_count(model, num_tokens=None, *args, **kwargs):
    """finalize_model_grads_func that sums the token count over DP but not over CP."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    return _finalize_dividing_by(group, model, num_tokens, args, kwargs)


def finalize_with_local_trained_fully_grads(model, num_tokens=None, *args, **kwargs):
    """finalize_model_grads_func after which the fully trained weights (`modules_to_save`) keep their own
    DP rank's grad, scaled by 1/num_tokens but never summed over DP (a weight trained outside DDP's buffers)."""
    from megatron.core import distributed

    from megatron_lora_patch.lora.layers.trained_fully import is_trained_fully

    local = [
        (param, param.main_grad.clone()) for chunk in model for param in chunk.parameters() if is_trained_fully(param)
    ]
    result = distributed.finalize_model_grads(model, num_tokens, *args, **kwargs)  # all-reduces num_tokens in place
    for param, grad in local:
        param.main_grad.copy_(grad if num_tokens is None else grad / num_tokens.clamp(min=1))
    return result


def _no_word_embedding_grad_all_reduce(*args, **kwargs) -> None:
    """The tied embedding's grads stay per stage: the first stage's embedding and the last stage's copy drift."""


def skip_tied_embedding_grad_sync(patcher: Patcher) -> None:
    """Megatron's all-reduce of the tied word-embedding grads over first and last stage never runs."""
    import importlib

    module = importlib.import_module(
        "megatron.core.distributed.finalize_model_grads"
    )  # the package attr is the function
    patcher.replace(module, "_allreduce_word_embedding_grads", _no_word_embedding_grad_all_reduce)


# -- DDP's overlapped param all-gather (lora.training.param_sync) ----------------------------


def _fire_no_adapter_pre_hooks(linear) -> None:
    """The adapters' forward pre-hooks never run: their params are not gathered before use."""


def adapter_pre_hooks_not_fired(patcher: Patcher) -> None:
    """The adapted linears' pre-hook fires nothing (its callee, looked up at call time, is a no-op)."""
    from megatron_lora_patch.lora.training import param_sync

    patcher.replace(param_sync, "fire_adapter_pre_hooks", _fire_no_adapter_pre_hooks)
