"""The known bugs of DeepSeek-style MoE routing under LoRA the oracle's mutations re-introduce.

Like `known_bugs`, each `install(patcher)` bends one invariant through the given `Patcher`
(reverted when the job ends) and is a module-level function (jobs are pickled to spawned ranks).
"""

from __future__ import annotations

import importlib
from unittest import mock

import torch

from megatron_lora_patch.runtime.patching import Patcher


def _no_all_reduce(*args, **kwargs) -> None:
    """`torch.distributed.all_reduce` that leaves its tensor as it is (this rank's own counts)."""


def _update_from_local_counts(wrapped, instance, args, kwargs):
    """Megatron's `get_updated_expert_bias` with its all-reduce of the tokens per expert skipped."""
    with mock.patch.object(torch.distributed, "all_reduce", _no_all_reduce):
        return wrapped(*args, **kwargs)


def expert_bias_from_local_counts(patcher: Patcher) -> None:
    """Each rank moves the expert bias by the tokens per expert IT routed, not those counted over
    TP x DP x CP: the bias (and the routing it steers) then depends on how the batch was split."""
    module = importlib.import_module(
        "megatron.core.distributed.finalize_model_grads"
    )  # the package attr is the function
    patcher.wrap(module, "get_updated_expert_bias", _update_from_local_counts)
