"""Vocab-parallel cross entropy on the gathered logits, reduced over the full vocabulary.

Megatron sums `exp(logits)` per rank over its vocab shard and all-reduces the partial
sums, so the softmax denominator depends on the TP degree. Here the logits are
all-gathered (backward: this rank's slice of the complete logit grad) and Megatron's own
`VocabParallelCrossEntropy` math runs once over the whole vocabulary `[0, V)`, the same
on every rank and at TP = 1.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lora_patch.layout_invariant.tensor_parallel import TPInvariantUnsupported
from megatron_lora_patch.layout_invariant.tensor_parallel.collectives import gather_logical


class _FullVocabCrossEntropy(torch.autograd.Function):
    """Megatron's `_VocabParallelCrossEntropy` for one rank holding the whole vocabulary."""

    @staticmethod
    def forward(ctx, logits, target):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as math

        # Megatron's math works in place: give it its own float32 copy, never the caller's logits.
        logits, logits_max = math.calculate_logits_max(logits.to(torch.float32, copy=True))
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = math.calculate_predicted_logits(
            logits, target, logits_max, 0, logits.size(-1)
        )
        softmax, loss = math.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as math

        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = math.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        grad_input = math.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output
        )
        return grad_input, None


def cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  group: Optional[Any] = None) -> torch.Tensor:
    """Per-token loss `[s, b]` from vocab-parallel logits `[s, b, V/tp]`, TP-invariant."""
    from megatron.core import parallel_state

    if label_smoothing:
        raise TPInvariantUnsupported("tp_invariant: label smoothing is not supported; set label_smoothing to 0")
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    full_logits = gather_logical(vocab_parallel_logits, -1, 1, group)
    return _FullVocabCrossEntropy.apply(full_logits, target)


def vocab_parallel_cross_entropy(wrapped, instance, args, kwargs):
    """wrapt wrapper of `tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0)`
    (0.19+: a fourth argument `tp_group`, the group the logits are split over)."""
    return _plain_call(*args, **kwargs)


def _plain_call(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    return cross_entropy(vocab_parallel_logits, target, label_smoothing, group=tp_group)


def fused_vocab_parallel_cross_entropy(wrapped, instance, args, kwargs):
    """wrapt wrapper of `fused_vocab_parallel_cross_entropy(logits, target, tp_group)`."""
    return _fused_call(*args, **kwargs)


def _fused_call(vocab_parallel_logits, target, tp_group=None):
    return cross_entropy(vocab_parallel_logits, target, group=tp_group)
