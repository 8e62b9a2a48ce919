"""The LoRA term's autograd functions, written for memory traffic (docs/architecture.md section 4).

A rank-r LoRA term costs few FLOPs but touches the layer's [tokens, in] input and [tokens, out]
output: at r << in, out its cost is the passes over those tensors, not the GEMMs. These
functions make each pass count:

- `add_up_projection`: `base + s * h B^T` as the GEMM's own epilogue (`addmm` with
  `alpha = s`: the scale never touches an output-sized tensor), in place into the base
  output when the caller owns it; backward hands the output grad to the base unchanged and
  computes dB as `(h^T dY)^T` (the layout in which the skinny GEMM streams dY once).
- `down_projection`: `h = x A^T`. With `fuse_dgrad`, it also returns the tensor the base
  matmul must consume instead of x; its backward then receives the base's input grad and
  adds `dh A` into it in place (one GEMM with accumulation) instead of autograd summing
  two input-sized tensors.
- `_DownProjectionRegather`: the sequence-parallel `sp_input="regather"` variant.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F


def apply_mask(activation: torch.Tensor, mask: Optional[torch.Tensor], dropout: float) -> torch.Tensor:
    """Inverted dropout with a given keep-mask (None: no dropout)."""
    return activation if mask is None else activation * mask / (1.0 - dropout)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _owns_storage(tensor: torch.Tensor) -> bool:
    """True when writing into `tensor` in place changes nothing but `tensor` (no view, no overlap)."""
    return tensor._base is None and tensor.is_contiguous()


def _covers_its_storage(grad: torch.Tensor) -> bool:
    """A fresh grad, or a contiguous reshape of one (what a matmul's backward hands over for a 3-D
    input): writing into it in place touches no other tensor's elements."""
    base = grad._base
    return grad.is_contiguous() and (base is None or (base.is_contiguous() and base.numel() == grad.numel()))


def add_up_projection(base_output: Optional[torch.Tensor], hidden: torch.Tensor, lora_b: torch.Tensor,
                      scale: float, in_place: bool = False) -> torch.Tensor:
    """`base_output + scale * hidden B^T` in one GEMM (or the bare up-projection when `base_output`
    is None). `in_place`: the caller owns `base_output` (a fresh output of the base matmul that no
    autograd node saved), so the sum is written into it; autograd raises if that was not true."""
    if base_output is None:
        flat = torch.mm(_flat(hidden), lora_b.t()).mul_(scale)
        return flat.view(*hidden.shape[:-1], flat.shape[-1])
    return _UpProjection.apply(base_output, hidden, lora_b, scale, in_place and _owns_storage(base_output))


class _UpProjection(torch.autograd.Function):
    """`base + s * h B^T`: forward one `addmm` (into `base` when `in_place`), backward no
    output-sized temporary (the output grad passes to `base` as is)."""

    @staticmethod
    def forward(ctx, base_output, hidden, lora_b, scale, in_place):
        ctx.save_for_backward(hidden, lora_b)
        ctx.scale = scale
        if in_place:
            _flat(base_output).addmm_(_flat(hidden), lora_b.t(), alpha=scale)
            ctx.mark_dirty(base_output)
            return base_output
        return torch.addmm(_flat(base_output), _flat(hidden), lora_b.t(), alpha=scale).view(base_output.shape)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, lora_b = ctx.saved_tensors
        grad_hidden, grad_b = up_projection_grads(grad_output, hidden, lora_b, ctx.scale, *ctx.needs_input_grad[1:3])
        return grad_output if ctx.needs_input_grad[0] else None, grad_hidden, grad_b, None, None


def up_projection_grads(grad_output: torch.Tensor, hidden: torch.Tensor, lora_b: torch.Tensor, scale: float,
                        need_hidden: bool, need_b: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dh, dB) of `s * h B^T` for the output grad dY (None where not needed)."""
    flat_grad = _flat(grad_output)
    grad_hidden = torch.mm(flat_grad, lora_b).mul_(scale).view(hidden.shape) if need_hidden else None
    # (h^T dY)^T, not dY^T h: the [r, out] product streams dY row-major once (2x faster on CPU).
    grad_b = torch.mm(_flat(hidden).t(), flat_grad).mul_(scale).t().contiguous() if need_b else None
    return grad_hidden, grad_b


def down_projection(x: torch.Tensor, lora_a: torch.Tensor, mask: Optional[torch.Tensor], dropout: float,
                    fuse_dgrad: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the tensor the base matmul consumes, `h = dropout(x) A^T`).

    `fuse_dgrad` (no dropout only): the first is a view of x whose grad (the base's input grad)
    receives `dh A` in place; otherwise it is x itself and autograd sums the two input grads."""
    if fuse_dgrad and mask is None:
        return _SharedInputDownProjection.apply(x, lora_a)
    return x, _DownProjection.apply(apply_mask(x, mask, dropout), lora_a)


def _grad_a(grad_hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _flat(grad_hidden).t().mm(_flat(x))


class _DownProjection(torch.autograd.Function):
    """`h = x A^T` whose input grad is a fresh tensor, not a view.

    Why: x also feeds the base matmul, so autograd sums two input grads. It adds the second
    into the first in place only if the first owns its storage alone; `F.linear`'s generated
    backward hands x a view (reshape of a 2-D grad), which forces an out-of-place add: one more
    input-sized tensor per layer in backward.
    """

    @staticmethod
    def forward(ctx, x, lora_a):
        ctx.save_for_backward(x, lora_a)
        return torch.matmul(x, lora_a.t())

    @staticmethod
    def backward(ctx, grad_hidden):
        x, lora_a = ctx.saved_tensors
        grad_x = torch.matmul(grad_hidden, lora_a) if ctx.needs_input_grad[0] else None
        return grad_x, _grad_a(grad_hidden, x) if ctx.needs_input_grad[1] else None


class _SharedInputDownProjection(torch.autograd.Function):
    """`(x, x A^T)`: the first output (a view of x, autograd's rule for a returned input) feeds
    the base matmul, so backward gets the base's input grad and accumulates `dh A` into it."""

    @staticmethod
    def forward(ctx, x, lora_a):
        ctx.save_for_backward(x, lora_a)
        return x, torch.matmul(x, lora_a.t())

    @staticmethod
    def backward(ctx, grad_base_input, grad_hidden):
        x, lora_a = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _accumulate_dgrad(grad_base_input, grad_hidden, lora_a, x.shape)
        return grad_x, _grad_a(grad_hidden, x) if ctx.needs_input_grad[1] else None


def _accumulate_dgrad(grad_base_input: Optional[torch.Tensor], grad_hidden: torch.Tensor, lora_a: torch.Tensor,
                      shape: torch.Size) -> torch.Tensor:
    """`grad_base_input + dh A`: in place when the base's fresh input grad allows it (no double
    backward, not a window into a larger tensor), else out of place."""
    flat_hidden = _flat(grad_hidden)
    if grad_base_input is None:
        return torch.mm(flat_hidden, lora_a).view(shape)
    if _covers_its_storage(grad_base_input) and not torch.is_grad_enabled():
        _flat(grad_base_input).addmm_(flat_hidden, lora_a)
        return grad_base_input
    return torch.addmm(_flat(grad_base_input), flat_hidden, lora_a).view(shape)


class _DownProjectionRegather(torch.autograd.Function):
    """`h = dropout(total) A^T` saving the local sequence shard instead of `total`.

    Backward: the input grad goes to `total` (so it joins the base's grad in the one
    reduce-scatter of `gather_from_sequence_parallel_region`), and dA re-gathers the
    local shard with Megatron's `_gather_along_first_dim`: one extra all-gather, the
    same trade as Megatron's trainable-weight linear.
    """

    @staticmethod
    def forward(ctx, total, lora_a, local, mask, dropout, group):
        ctx.save_for_backward(local, lora_a, mask)
        ctx.dropout, ctx.group = dropout, group
        return F.linear(apply_mask(total, mask, dropout), lora_a)

    @staticmethod
    def backward(ctx, grad_hidden):
        from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

        local, lora_a, mask = ctx.saved_tensors
        total = apply_mask(_gather_along_first_dim(local, ctx.group), mask, ctx.dropout)
        grad_total = apply_mask(grad_hidden.matmul(lora_a), mask, ctx.dropout)
        return grad_total, _grad_a(grad_hidden, total), None, None, None, None


def regather_down_projection(total: torch.Tensor, lora_a: torch.Tensor, local: torch.Tensor,
                             mask: Optional[torch.Tensor], dropout: float, group: Any) -> torch.Tensor:
    """`h = dropout(total) A^T` keeping only `local` for backward (`sp_input="regather"`)."""
    return _DownProjectionRegather.apply(total, lora_a, local, mask, dropout, group)
