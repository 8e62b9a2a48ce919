"""The known bugs of gradient sync the oracle's mutations re-introduce: DP averaging, token normalization, the grad
norm's replicated params, the tied embedding's grad sync and DDP's overlapped param all-gather.

As in `oracle.known_bugs` (the bugs of LoRA's own sharding, construction and collectives): each `install(patcher)`
bends one invariant of docs/architecture.md section 4 or 5 where the real bug lived; `finalize_with_*` are
`finalize_model_grads_func` replacements; all are module-level functions because jobs are pickled to spawned ranks.
"""

from __future__ import annotations

from typing import Any, Iterator, Tuple

from megatron_lora_patch.runtime.patching import Patcher

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
