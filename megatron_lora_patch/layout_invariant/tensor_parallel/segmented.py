"""Column- and row-parallel linears (base + LoRA) on the LOCAL weight shards, every sum over a
sharded dimension in the canonical segment order (docs/architecture.md section 7).

Both work on 2-D tensors; `layout_invariant.tensor_parallel.shares` fixes the chunks (GEMM shapes) and the tree.

- column (`W [out, in]`, bias and `B [out, r]` sharded on out, `A [r, in]` replicated, `x` the
  full input): forward computes this rank's output chunks `x W_c^T + b_c + s h B_c^T` with
  `h = x A^T` (no collective). Backward contracts over out, which TP splits: per segment the
  chained partials of `dY_c W_c` and `dY_c B_c`, the segment tree, ONE `tree_all_gather`; then
  `dh = s tree(dY B)`, `grad_x = tree(dY W) + dh A` and `dA = dh^T x`, complete on every rank.
  `dW`, `db`, `dB`: this rank's chunks, local.
- row (`W [out, in]` and `A [r, in]` sharded on in, `B [out, r]` replicated, `x` this rank's
  shard of the input): forward contracts over in: per segment the chained partials of
  `x_c W_c^T` and `x_c A_c^T`, the tree, ONE `tree_all_gather`, then `y = tree(x W^T) + s h B^T`
  with `h = tree(x A^T)`. Each rank returns its share of y's columns placed in zeros, so
  Megatron's SUM (all-reduce or reduce-scatter) that follows assembles y exactly (`y + 0 == y`);
  that SUM's backward hands every rank the complete dY. Backward: `grad_x`, `dA`, `dW` per
  chunk of this rank's shard, `dB` complete.

`row_sums(t, group)`: the sums over the sharded last dimension of `t` (each rank holds its shard),
in the same canonical order (chained chunk sums per segment, the tree, one `tree_all_gather`), the
same bits on every rank and at every TP degree.

Sliced operands are copied to contiguous chunks so that every GEMM sees the same shape and
strides at every TP degree. Partial sums are formed in float32 for half-precision inputs
(`accumulation_dtype`) and rounded to the input dtype once at the end.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant.tensor_parallel.collectives import column_share, tree_all_gather
from megatron_lora_patch.layout_invariant.tensor_parallel.shares import TreeSum, local_chunks, local_segments


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial sums are formed in: float32 for half precision, the dtype itself otherwise."""
    return torch.promote_types(dtype, torch.float32)


def _chain(total: Optional[torch.Tensor], product: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`total + product` in `dtype` (the chained sum inside one segment); `product` alone first."""
    return product.to(dtype) if total is None else total.add_(product)


def _trees(*needed: bool) -> List[Optional[TreeSum]]:
    return [TreeSum() if need else None for need in needed]


def _add(trees: List[Optional[TreeSum]], totals: list) -> None:
    """One segment's value of each needed term into its tree."""
    for tree, total in zip(trees, totals):
        if tree is not None:
            tree.add(total)


def _finish(trees: List[Optional[TreeSum]], group: Any) -> List[Optional[torch.Tensor]]:
    """Every tree (None: not needed) finished over TP, with ONE all-gather for all of them."""
    partials = [tree.result() for tree in trees if tree is not None]
    full = iter(tree_all_gather(partials, group) if partials else [])
    return [None if tree is None else next(full) for tree in trees]


def _world(group: Any) -> tuple:
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _column_chunk(x, weight, bias, hidden, lora_b, scale, start, stop) -> torch.Tensor:
    rows = weight[start:stop]
    out = torch.mm(x, rows.t()) if bias is None else torch.addmm(bias[start:stop], x, rows.t())
    if hidden is not None:
        out.addmm_(hidden, lora_b[start:stop].t(), alpha=scale)
    return out


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale, layout):
        stride, group = layout
        world, _ = _world(group)
        ctx.segments = local_segments(weight.shape[0] * world, stride, world)
        ctx.scale, ctx.group = scale, group
        hidden = None if lora_a is None else torch.mm(x, lora_a.t())
        ctx.save_for_backward(x, weight, lora_a, lora_b, hidden)
        chunks = local_chunks(weight.shape[0] * world, stride, world)
        parts = [_column_chunk(x, weight, bias, hidden, lora_b, scale, *chunk) for chunk in chunks]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b, hidden = ctx.saved_tensors
        needs, scale, dtype = ctx.needs_input_grad, ctx.scale, accumulation_dtype(x.dtype)
        lora = lora_a is not None and (needs[0] or needs[3])
        grad_weight = torch.empty_like(weight) if needs[1] else None
        grad_bias = grad.new_empty(weight.shape[0]) if needs[2] else None
        grad_b = torch.empty_like(lora_b) if needs[4] else None
        trees = _trees(needs[0], lora)  # over out: dY W, dY B
        for segment in ctx.segments:
            totals = [None, None]
            for start, stop in segment:
                part = grad[:, start:stop].contiguous()  # dY_c
                if needs[0]:
                    totals[0] = _chain(totals[0], torch.mm(part, weight[start:stop]), dtype)
                if lora:
                    totals[1] = _chain(totals[1], torch.mm(part, lora_b[start:stop]), dtype)
                if grad_weight is not None:
                    torch.mm(part.t(), x, out=grad_weight[start:stop])
                if grad_bias is not None:
                    grad_bias[start:stop] = part.sum(dim=0)
                if grad_b is not None:
                    grad_b[start:stop] = torch.mm(hidden.t(), part).mul_(scale).t()
            _add(trees, totals)
        base, hidden_grad = _finish(trees, ctx.group)
        grad_a = None
        if lora:
            hidden_grad = hidden_grad.mul_(scale).to(x.dtype)
            grad_a = torch.mm(hidden_grad.t(), x) if needs[3] else None
            if needs[0]:
                base.add_(torch.mm(hidden_grad, lora_a))
        grad_x = base.to(x.dtype) if needs[0] else None
        return grad_x, grad_weight, grad_bias, grad_a, grad_b, None, None


class _RowLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scale, group):
        world, _ = _world(group)
        dtype = accumulation_dtype(x.dtype)
        ctx.chunks = local_chunks(x.shape[1] * world, 1, world)
        ctx.scale = scale
        trees = _trees(True, lora_a is not None)  # over in: x W^T, x A^T
        for segment in local_segments(x.shape[1] * world, 1, world):
            totals = [None, None]
            for start, stop in segment:
                part = x[:, start:stop].contiguous()  # x_c
                totals[0] = _chain(totals[0], torch.mm(part, weight[:, start:stop].contiguous().t()), dtype)
                if lora_a is not None:
                    totals[1] = _chain(totals[1], torch.mm(part, lora_a[:, start:stop].contiguous().t()), dtype)
            _add(trees, totals)
        output, hidden = _finish(trees, group)
        if hidden is not None:
            hidden = hidden.to(x.dtype)
            output.add_(torch.mm(hidden, lora_b.t()), alpha=scale)
        ctx.save_for_backward(x, weight, lora_a, lora_b, hidden)
        output = output.to(x.dtype)
        return column_share(output, group)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b, hidden = ctx.saved_tensors
        needs, scale = ctx.needs_input_grad, ctx.scale
        grad = grad.contiguous()  # the complete dY, the same on every rank
        lora = lora_a is not None
        grad_hidden = torch.mm(grad, lora_b).mul_(scale) if lora and (needs[0] or needs[2]) else None
        grad_b = torch.mm(hidden.t(), grad).mul_(scale).t().contiguous() if lora and needs[3] else None
        grad_x = torch.empty_like(x) if needs[0] else None
        grad_weight = torch.empty_like(weight) if needs[1] else None
        grad_a = torch.empty_like(lora_a) if lora and needs[2] else None
        for start, stop in ctx.chunks:
            if grad_x is not None:
                part = torch.mm(grad, weight[:, start:stop].contiguous())
                if lora:
                    part.addmm_(grad_hidden, lora_a[:, start:stop].contiguous())
                grad_x[:, start:stop] = part
            if grad_weight is not None or grad_a is not None:
                x_chunk = x[:, start:stop].contiguous()
                if grad_weight is not None:
                    grad_weight[:, start:stop] = torch.mm(grad.t(), x_chunk)
                if grad_a is not None:
                    grad_a[:, start:stop] = torch.mm(grad_hidden.t(), x_chunk)
        return grad_x, grad_weight, grad_a, grad_b, None, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  lora: Optional[tuple], stride: int, group: Any) -> torch.Tensor:
    """This rank's output shard of `x W^T + b (+ s (x A^T) B^T)`, `lora = (A, B shard, s)`, 2-D full `x`."""
    lora_a, lora_b, scale = (None, None, 0.0) if lora is None else lora
    return _ColumnLinear.apply(x.contiguous(), weight, bias, lora_a, lora_b, scale, (stride, group))


def row_linear(x: torch.Tensor, weight: torch.Tensor, lora: Optional[tuple], group: Any) -> torch.Tensor:
    """This rank's share (zeros elsewhere) of `x W^T (+ s (x A^T) B^T)`, `lora = (A shard, B, s)`, 2-D
    input shard `x`."""
    lora_a, lora_b, scale = (None, None, 0.0) if lora is None else lora
    return _RowLinear.apply(x.contiguous(), weight, lora_a, lora_b, scale, group)


def row_sums(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """`tensor.sum(-1)` over the logical last dimension whose local shard `tensor` (2-D) is, in the canonical
    segment order: complete and identical on every rank, the same bits at every TP degree. Summed in
    `tensor.dtype` itself (not promoted to float32 as the linears' partials are)."""
    world, _ = _world(group)
    tree = TreeSum()
    for segment in local_segments(tensor.shape[1] * world, 1, world):
        total = None
        for start, stop in segment:
            total = _chain(total, tensor[:, start:stop].contiguous().sum(dim=1), tensor.dtype)
        tree.add(total)
    (full,) = tree_all_gather([tree.result()], group)
    return full
