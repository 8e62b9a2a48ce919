"""Each TP rank computes only its share of a TP-invariant linear's output (docs/architecture.md section 7).

The mode needs every output element computed exactly as at TP = 1. An element of `x W^T` is a
dot product over the full K, so any rank can compute any output column bit for bit, provided
it runs the same GEMM shape on the same values: CPU and GPU kernels choose their blocking
(hence the summation order) from the shapes. So the output columns are cut into a fixed
partition that depends on the width alone, never on the TP degree: each stride part (SwiGLU
fc1: gate, up) into `SEGMENTS` equal segments, each segment into chunks of at most
`CHUNK_COLUMNS`. TP rank r of n owns segments r * S / n ... (r + 1) * S / n of every part
(exactly Megatron's shard of the column layer's output) and computes only those chunks, one
GEMM per chunk: 1 / n of the GEMM work, where computing the full output cost n times that.

- column layer (`keep=True`): the owned columns ARE this rank's output shard;
- row layer (`keep=False`): the owned columns are placed into a zero output of full width,
  so Megatron's SUM over TP that follows assembles the full output (`x + 0 == x`, exact in any
  reduction order).

Backward runs over the complete output grad (all-gathered in the column case, where each rank
holds its columns' grad; already complete in the row case, whose reduction's backward is the
identity): input grad `dY W`, weight, bias and LoRA grads as full contractions in the TP = 1
order, identical on every rank. Forward work is a share, backward work stays full.
"""

from __future__ import annotations

import functools
from math import gcd
from typing import Any, Optional, Tuple

import torch
import torch.distributed

from megatron_lora_patch.lora.adapters.kernels import up_projection_grads
from megatron_lora_patch.tp_invariant import TPInvariantUnsupported
from megatron_lora_patch.tp_invariant.collectives import all_gather_logical

#: Segments per stride part: Megatron's shard boundaries at TP 1, 2, 4 and 8 fall on segment edges.
SEGMENTS = 8
#: Widest chunk one GEMM computes (wide enough to run at full GEMM speed, narrow enough to
#: split a segment of a real model into several).
CHUNK_COLUMNS = 256


@functools.lru_cache(maxsize=None)
def owned_chunks(width: int, stride: int, world: int, rank: int) -> Tuple[Tuple[int, int], ...]:
    """The `(start, stop)` output columns (world-size-1 layout) TP rank `rank` of `world` computes,
    in the order of its output shard: a partition of each stride part that no TP degree changes.
    Cached: every forward call of a layer asks for the same few shapes."""
    part = width // stride
    segments = gcd(part, SEGMENTS)
    if width % stride or segments % world:
        raise TPInvariantUnsupported(
            f"tp_invariant: an output of {width} columns (stride {stride}) does not split into whole segments "
            f"for TP {world}: run the TP-invariant mode at a TP degree dividing {segments}, or turn tp_invariant off"
        )
    size = part // segments
    mine = range(rank * segments // world, (rank + 1) * segments // world)
    return tuple((base + start, base + min(start + CHUNK_COLUMNS, size))
                 for base in (p * part + s * size for p in range(stride) for s in mine)
                 for start in range(0, size, CHUNK_COLUMNS))


def _chunk_output(x, weight, bias, hidden, lora_b, scale, start, stop) -> torch.Tensor:
    """Columns `start:stop` of `x W^T + b + s h B^T`: a fresh [tokens, stop - start] GEMM output,
    the same shape (hence the same summation order) on every TP degree."""
    rows = weight[start:stop]
    out = torch.mm(x, rows.t()) if bias is None else torch.addmm(bias[start:stop], x, rows.t())
    if hidden is not None:
        out.addmm_(hidden, lora_b[start:stop].t(), alpha=scale)
    return out


class _OwnedColumnsLinear(torch.autograd.Function):
    """`x W^T + b (+ s h B^T)` on 2-D tensors, forward restricted to the owned columns."""

    @staticmethod
    def forward(ctx, x, weight, bias, hidden, lora_b, scale, share):
        chunks, keep, stride, group = share
        ctx.save_for_backward(x, weight, hidden, lora_b)
        ctx.scale, ctx.keep, ctx.stride, ctx.group = scale, keep, stride, group
        parts = [_chunk_output(x, weight, bias, hidden, lora_b, scale, *chunk) for chunk in chunks]
        if keep:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        out = x.new_zeros(x.shape[0], weight.shape[0])
        for (start, stop), part in zip(chunks, parts):
            out[:, start:stop] = part
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, hidden, lora_b = ctx.saved_tensors
        if ctx.keep:  # each rank holds its columns' grad: the complete one, in the TP = 1 layout
            grad = all_gather_logical(grad.contiguous(), -1, ctx.stride, ctx.group)
        needs = ctx.needs_input_grad
        grad_x = grad.mm(weight) if needs[0] else None
        grad_weight = grad.t().mm(x) if needs[1] else None
        grad_bias = grad.sum(dim=0) if needs[2] else None
        grad_hidden, grad_b = (None, None) if hidden is None else up_projection_grads(
            grad, hidden, lora_b, ctx.scale, needs[3], needs[4])
        return grad_x, grad_weight, grad_bias, grad_hidden, grad_b, None, None


def owned_columns_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         lora: Optional[Tuple[torch.Tensor, torch.Tensor, float]],
                         stride: int, group: Any, keep: bool) -> torch.Tensor:
    """This rank's share of `x W^T + b + s h B^T` (`lora = (h, full B, s)`), 2-D `x` with the full K and
    the full `weight` / `bias` / B: its output shard (`keep`) or the full width, zeros outside the share."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    hidden, lora_b, scale = (None, None, 0.0) if lora is None else lora
    chunks = owned_chunks(weight.shape[0], stride, world, rank)
    keep = keep or world == 1  # at world size 1 the share is the whole output: zeros would only add a pass
    return _OwnedColumnsLinear.apply(x, weight, bias, hidden, lora_b, scale, (chunks, keep, stride, group))
