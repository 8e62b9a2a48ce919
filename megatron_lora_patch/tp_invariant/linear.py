"""Column- and row-parallel linears (base + LoRA) computed as the world-size-1 GEMMs.

Installed on `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl`
(a method from Megatron-Core 0.14): the layer's own `forward` still decides the input
mapping, `gather_output`, the bias and the row reduction; only the matmul changes.

- column: the input (sequence-gathered under SP; its backward then keeps the local
  slice, since the input grad is complete on every rank) times the gathered full weight,
  in the TP = 1 layout, plus the LoRA branch `s * (x A^T) B^T` with the gathered full B;
  the rank computes only its own output columns (`tp_invariant.shares`). Backward
  all-gathers the output grad, so the input grad `dy W` and `dy B` run over the full
  output width in the TP = 1 order: no partial dgrad, no all-reduce / reduce-scatter of
  it, and the replicated A gets its complete grad on every rank.
- row: the input gathered along K, the gathered full weight, and the LoRA branch with
  the gathered full A: full-K GEMMs, each rank computing its share of the output columns
  into a zero output, so Megatron's SUM that follows assembles the full output exactly;
  the replicated B gets its complete grad on every rank.

Compute: forward GEMMs are split across the ranks as in the default mode (in fixed-width
chunks); backward GEMMs run at full size on every rank (TP times the work of a shard). The
full weights, biases and LoRA factors are gathered once and cached (`tp_invariant.cache`: the
frozen base until its shard changes, the factors once per optimizer step); only the
activations (row input, column output grad) are gathered per call.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from megatron_lora_patch.lora.adapters.kernels import down_projection
from megatron_lora_patch.lora.layers.linear import adapter_of
from megatron_lora_patch.tp_invariant import TPInvariantUnsupported
from megatron_lora_patch.tp_invariant.cache import cached_gather
from megatron_lora_patch.tp_invariant.collectives import gather_logical
from megatron_lora_patch.tp_invariant.shares import owned_columns_linear

#: Attribute a patch sets on a column layer whose shards interleave two halves (SwiGLU fc1)
#: when the weight's own `partition_stride` does not say so.
OUT_STRIDE_ATTRIBUTE = "tp_invariant_out_stride"


def _linear_arguments(
    input,
    weight,
    bias=None,
    gradient_accumulation_fusion=False,
    allreduce_dgrad=False,
    sequence_parallel=False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    tp_group=None,
    **unknown,
) -> dict:
    """Megatron's linear-function arguments by name (0.14-0.16 pass them as keywords)."""
    if grad_output_buffer is not None:
        raise TPInvariantUnsupported(
            "tp_invariant: defer_embedding_wgrad_compute is not supported; turn it off with the TP-invariant mode"
        )
    return {"input": input, "weight": weight, "bias": bias, "sequence_parallel": sequence_parallel}


def _check_supported(layer: Any) -> None:
    expert = getattr(layer, "is_expert", False) or getattr(layer, "explicit_expert_comm", False)
    if expert and torch.distributed.get_world_size(layer.tp_group) > 1:  # etp = 1: layout_invariant.experts
        raise TPInvariantUnsupported(
            "tp_invariant: expert tensor parallelism (etp > 1) is not covered; set expert_tensor_parallel_size=1"
        )
    if getattr(layer, "disable_grad_reduce", False):
        raise TPInvariantUnsupported("tp_invariant: layers built with disable_grad_reduce=True are not supported")


def _check_adapter(adapter: Any) -> None:
    if adapter.dropout and adapter.training:
        raise TPInvariantUnsupported(
            "tp_invariant: LoRA dropout draws per-rank masks on sharded inputs, which differ across TP degrees; "
            "set the LoRA dropout to 0 in the TP-invariant mode"
        )


def _share_of_linear(total: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     lora: Optional[Tuple[Any, torch.Tensor, torch.Tensor]], stride: int, group: Any,
                     keep: bool) -> torch.Tensor:
    """This rank's share (`tp_invariant.shares`) of `total W^T + b` plus, with `lora = (adapter, full A,
    full B)`, `s (total A^T) B^T`, every contraction over the full K, on the 2-D view of `total` (CPU
    kernels pick their path from the strides, and a size-1 batch dim can carry any stride: TP = 1 and
    TP = n hand over different ones). The down-projection is the default mode's kernel: the LoRA
    input grad accumulates into the base's in place."""
    flat_input = total.reshape(-1, total.shape[-1])
    up = None
    if lora is not None:
        adapter, lora_a, lora_b = lora
        _check_adapter(adapter)
        flat_input, hidden = down_projection(flat_input, lora_a, None, 0.0, fuse_dgrad=True)
        up = (hidden, lora_b, adapter.scale)
    flat = owned_columns_linear(flat_input, weight, bias, up, stride, group, keep)
    return flat.view(*total.shape[:-1], flat.shape[-1])


def _stride(layer: Any, tensor: torch.Tensor) -> int:
    return max(getattr(tensor, "partition_stride", 1), getattr(layer, OUT_STRIDE_ATTRIBUTE, 1))


def _full_up_weight(layer: Any, adapter: Any, group: Any) -> torch.Tensor:
    """The column adapter's full B as the LoRA term uses it (`LoraAdapter.up_weight`: block-masked for
    separate projections), from the cached gathers of its shards and of its mask."""
    stride = _stride(layer, adapter.B)
    full_b = cached_gather(adapter.B, 0, stride, group)
    return full_b if adapter.block_mask is None else full_b * cached_gather(adapter.block_mask, 0, stride, group)


def column_linear(layer: Any, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  sequence_parallel: bool) -> torch.Tensor:
    """This rank's output columns of the world-size-1 output (base + LoRA), computed alone."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    _check_supported(layer)
    group = layer.tp_group
    if sequence_parallel:
        # tensor_parallel_output_grad=False: backward keeps the local slice of the complete input grad.
        total = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=False, group=group)
    else:
        total = input  # non-SP: no dgrad all-reduce; every rank computes the complete input grad
    stride = _stride(layer, weight)
    full_bias = None if bias is None else cached_gather(bias, 0, stride, group)
    adapter = adapter_of(layer)
    lora = None if adapter is None else (adapter, adapter.A, _full_up_weight(layer, adapter, group))
    return _share_of_linear(total, cached_gather(weight, 0, stride, group), full_bias, lora, stride, group, keep=True)


def row_linear(layer: Any, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """This rank's columns of the world-size-1 output (base + LoRA), zeros elsewhere: Megatron's
    reduction that follows assembles the full output."""
    _check_supported(layer)
    group = layer.tp_group
    total = gather_logical(input, -1, 1, group)
    adapter = adapter_of(layer)
    lora = None if adapter is None else (adapter, cached_gather(adapter.A, 1, 1, group), adapter.up_weight())
    return _share_of_linear(total, cached_gather(weight, 1, 1, group), None, lora, 1, group, keep=False)


def column_forward_impl(wrapped, instance, args, kwargs):
    """wrapt wrapper of `ColumnParallelLinear._forward_impl`."""
    call = _linear_arguments(*args, **kwargs)
    return column_linear(instance, call["input"], call["weight"], call["bias"], call["sequence_parallel"])


def row_forward_impl(wrapped, instance, args, kwargs):
    """wrapt wrapper of `RowParallelLinear._forward_impl` (Megatron adds the row bias after the reduction)."""
    call = _linear_arguments(*args, **kwargs)
    if call["bias"] is not None:
        raise TPInvariantUnsupported("tp_invariant: a bias inside the row-parallel matmul is not supported")
    return row_linear(instance, call["input"], call["weight"])
