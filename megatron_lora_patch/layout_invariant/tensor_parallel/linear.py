"""Column- and row-parallel linears (base + LoRA) on the local weight shards, bitwise TP-invariant.

Installed on `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl`
(a method from Megatron-Core 0.14): the layer's own `forward` still decides the input
mapping, `gather_output`, the bias and the row reduction; only the matmul changes
(`layout_invariant.tensor_parallel.segmented`; docs/architecture.md section 7).

- column: the input (sequence-gathered under SP; its backward then keeps the local slice,
  since the input grad is complete on every rank; without SP no dgrad all-reduce runs, for
  the same reason) times this rank's weight shard, plus the LoRA branch `s (x A^T) B_r^T`:
  the rank's own output columns, no collective. Backward tree-combines the per-rank
  partial input grads (`dY W`, `dY B`) over TP, so the replicated A gets its complete grad
  on every rank.
- row: the input shard times the weight shard, per segment of K, tree-combined over TP
  (with the LoRA hidden `x A_r^T`), then this rank's share of the output columns placed in
  zeros, so Megatron's SUM that follows assembles the full output exactly; the replicated B
  gets its complete grad on every rank.

No rank gathers a base weight (or a LoRA factor): every GEMM runs on local shards in
fixed-size chunks, each rank doing 1 / TP of the GEMM work; the collectives move
activation-sized partial sums only.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from megatron_lora_patch.layout_invariant.tensor_parallel import TPInvariantUnsupported, segmented
from megatron_lora_patch.layout_invariant.tensor_parallel.collectives import share_grad
from megatron_lora_patch.lora.layers.linear import adapter_of

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
    expert = getattr(layer, "is_expert", False)
    if expert and torch.distributed.get_world_size(layer.tp_group) > 1 and not _dispatcher_reduced(layer):
        raise TPInvariantUnsupported(
            "tp_invariant: an expert layer under expert TP without Megatron's explicit expert communication "
            "is not covered; set expert_tensor_parallel_size=1"
        )
    if getattr(layer, "disable_grad_reduce", False):
        raise TPInvariantUnsupported("tp_invariant: layers built with disable_grad_reduce=True are not supported")


def _dispatcher_reduced(layer: Any) -> bool:
    """An expert layer whose input grad (column) or output (row) the token dispatcher sums over the
    expert TP group (Megatron's `explicit_expert_comm`), instead of the layer itself."""
    return getattr(layer, "explicit_expert_comm", False)


def _check_adapter(adapter: Any) -> None:
    if adapter.dropout and adapter.training:
        raise TPInvariantUnsupported(
            "tp_invariant: LoRA dropout draws per-rank masks on sharded inputs, which differ across TP degrees; "
            "set the LoRA dropout to 0 in the TP-invariant mode"
        )


def _lora(layer: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor, float]]:
    """(A, the B the LoRA term multiplies, s) of the layer's adapter, local shards (B block-masked for
    separate projections, as in the default mode), or None without an adapter."""
    adapter = adapter_of(layer)
    if adapter is None:
        return None
    _check_adapter(adapter)
    return adapter.A, adapter.up_weight(), adapter.scale


def _stride(layer: Any, tensor: torch.Tensor) -> int:
    return max(getattr(tensor, "partition_stride", 1), getattr(layer, OUT_STRIDE_ATTRIBUTE, 1))


def column_linear(layer: Any, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  sequence_parallel: bool) -> torch.Tensor:
    """This rank's output columns of the world-size-1 output (base + LoRA), from its own shards."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    _check_supported(layer)
    group = layer.tp_group
    if sequence_parallel:
        # tensor_parallel_output_grad=False: backward keeps the local slice of the complete input grad.
        total = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=False, group=group)
    else:
        total = input  # non-SP: no dgrad all-reduce; every rank computes the complete input grad
    if _dispatcher_reduced(layer):
        # the dispatcher's reduce-scatter sums the input grad over ETP: each rank keeps its share of it
        total = share_grad(total, group)
    flat = segmented.column_linear(total.reshape(-1, total.shape[-1]), weight, bias, _lora(layer),
                                   _stride(layer, weight), group)
    return flat.view(*total.shape[:-1], flat.shape[-1])


def row_linear(layer: Any, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """This rank's columns of the world-size-1 output (base + LoRA), zeros elsewhere: Megatron's
    reduction that follows assembles the full output."""
    _check_supported(layer)
    flat = segmented.row_linear(input.reshape(-1, input.shape[-1]), weight, _lora(layer), layer.tp_group)
    return flat.view(*input.shape[:-1], flat.shape[-1])


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
