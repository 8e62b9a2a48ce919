"""How the LoRA term rides the base layer's own linear call and collectives.

Hook point: the module globals `linear_with_frozen_weight` and
`linear_with_grad_accumulation_and_async_allreduce` of
`megatron.core.tensor_parallel.layers`, which `ColumnParallelLinear.forward` and
`RowParallelLinear.forward` look up on every call in 0.13-0.16 (whether `_forward_impl`
is an instance attribute or a method). Everything the layer's forward decides (copy to
the TP region, `explicit_expert_comm`, bias handling, `gather_output`, the row
reduction) stays Megatron's. A context variable, set by the wrapped layer `forward`,
tells the function wrapper which adapter (if any) the current call belongs to.

- column-parallel: the function is about to gather the input over the sequence (SP) or
  to all-reduce the input grad (`allreduce_dgrad`). The wrapper does that step once,
  with Megatron's own mappings, BEFORE the base matmul (`gather_from_sequence_parallel_region`:
  AG forward / RS backward; `copy_to_tensor_model_parallel_region`: identity / AR backward)
  and feeds the same tensor to base and LoRA, so the ONE dgrad reduce-scatter /
  all-reduce carries base + LoRA input grads.
- row-parallel: the function returns the pre-reduction partial; the wrapper adds the
  LoRA partial to it, so Megatron's single all-reduce / reduce-scatter reduces both,
  and on explicit-expert-comm paths both stay a partial sum for the dispatcher.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME

if TYPE_CHECKING:  # the adapter (and its config / init) loads with the first model, not with the patch
    from megatron_lora_patch.lora.adapters.adapter import LoraAdapter

_current_adapter: contextvars.ContextVar = contextvars.ContextVar("megatron_lora_adapter", default=None)


def adapter_of(layer: Any) -> Optional[LoraAdapter]:
    """The adapter attached to `layer`, or None."""
    return getattr(layer, "_modules", {}).get(ADAPTER_NAME)


def layer_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of a parallel linear's `forward`: exposes its adapter to the linear call.

    A layer without an adapter, outside any adapter's call, leaves the variable alone (the
    frozen-only layers of a model pay one dict lookup, not a set / reset)."""
    adapter = adapter_of(instance)
    if adapter is None and _current_adapter.get() is None:
        return wrapped(*args, **kwargs)
    token = _current_adapter.set(adapter)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _current_adapter.reset(token)


@functools.lru_cache(maxsize=None)
def _parameter_names(function: Callable) -> Optional[Tuple[str, ...]]:
    """`function`'s parameter names in order when every one can be passed by name, else None."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
        return None
    return tuple(p.name for p in parameters)


def _call_arguments(function: Callable, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (what `Signature.bind(...).arguments` gives, without
    defaults), from the names resolved once per function: binding costs microseconds per call."""
    names = _parameter_names(function)
    if names is None or len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)  # raises the usual TypeError
    call = dict(zip(names, args))
    call.update(kwargs)
    return call


def linear_call(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of Megatron's linear functions: base output plus the LoRA term.

    The base matmul consumes the down-projection's first output (its input grad then takes the
    LoRA input grad in place) and the up-projection adds into the base output in place: the
    output is the fresh result of Megatron's linear function, which saves only its input and
    weight (autograd would raise, not mis-compute, if a version saved it)."""
    adapter: Optional[LoraAdapter] = _current_adapter.get()
    if adapter is None:
        return wrapped(*args, **kwargs)
    # One adapter term per layer forward: any further call inside it is plain.
    _current_adapter.set(None)
    call = _call_arguments(wrapped, args, kwargs)
    # DoRA scales the bias-free output (PEFT leaves the bias alone): the bias is added after the rescale.
    bias = None
    if adapter.magnitude is not None:
        bias, call["bias"] = call.get("bias"), None
    if adapter.parallel_mode == "row":
        call["input"], hidden = adapter.row_down(call["input"], fuse_dgrad=True)
        output = adapter.up(hidden, wrapped(**call), in_place=True)
    else:
        output = column_call(wrapped, call, adapter)
    output = adapter.dora_rescale(output, call["weight"])
    return output if bias is None else output + bias


def column_call(linear: Callable, call: dict, adapter: LoraAdapter) -> Any:
    """Column-parallel: one input collective shared by the base matmul and the LoRA branch."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    local_input = call["input"]
    group = adapter.tp_group
    keep_local = None
    if call.get("sequence_parallel"):
        total_input = gather_from_sequence_parallel_region(local_input, tensor_parallel_output_grad=True, group=group)
        keep_local = local_input if adapter.sp_input == "regather" else None
    elif call.get("allreduce_dgrad"):
        total_input = copy_to_tensor_model_parallel_region(local_input, group=group)
    else:
        total_input = local_input
    base_input, hidden = adapter.column_down(total_input, keep_local, fuse_dgrad=True)
    call.update(input=base_input, sequence_parallel=False, allreduce_dgrad=False)
    return adapter.up(hidden, linear(**call), in_place=True)
