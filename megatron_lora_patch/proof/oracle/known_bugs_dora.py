"""The known bugs of DoRA the oracle's sensitivity mutations re-introduce, one function each.

Like `known_bugs`: each `install(patcher)` bends one rule of DoRA (lora/adapters/dora.py) where it lives,
through the given `Patcher`, on a function its caller looks up at call time; module-level functions,
because jobs are pickled to spawned ranks. `oracle.mutations` names them.
"""

from __future__ import annotations

from megatron_lora_patch.proof.oracle.known_bugs import _without_replicated
from megatron_lora_patch.runtime.patching import Patcher


def _local_sum(wrapped, instance, args, kwargs) -> None:
    """No all-reduce: each TP rank keeps the sums of squares over its own input slice."""


def dora_row_norm_local(patcher: Patcher) -> None:
    """A row-parallel layer's DoRA norm over the local input slice only (not summed over TP)."""
    from megatron_lora_patch.lora.adapters import dora

    patcher.wrap(dora, "reduce_row_squares", _local_sum)


def _is_magnitude(info) -> bool:
    return info.factor == "m"


def dora_magnitude_outside_grad_sync(patcher: Patcher) -> None:
    """The replicated m of a row-parallel layer keeps its per-rank partial grad (no TP SUM)."""
    from megatron_lora_patch.lora.training import grad_sync

    patcher.wrap(grad_sync, "replicated_adapter_params", _without_replicated(_is_magnitude))


def _norm_with_grad(wrapped, instance, args, kwargs):
    """`Magnitude.norm` without the detach: gradients flow through the norm into A and B."""
    import torch
    from torch.distributed.nn.functional import all_reduce

    from megatron_lora_patch.lora.adapters import dora

    weight, lora_a, lora_b, scale = args
    squares = dora.row_partial_sums(weight, lora_a, lora_b, scale, dora.base_row_squares(weight))
    if instance.parallel_mode == "row" and torch.distributed.get_world_size(instance.group) > 1:
        squares = all_reduce(squares, group=instance.group)
    return squares.sqrt()


def dora_norm_not_detached(patcher: Patcher) -> None:
    """DoRA's weight norm keeps its graph (PEFT detaches it): A and B get the norm's gradient too."""
    from megatron_lora_patch.lora.adapters import dora

    patcher.wrap(dora.Magnitude, "norm", _norm_with_grad)
