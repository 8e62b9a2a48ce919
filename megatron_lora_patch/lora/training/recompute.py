"""Full activation recompute with a frozen base: make the checkpointed region's input need grad.

Megatron's full recompute runs each chunk of layers inside a reentrant
`CheckpointFunction` (or TE's `te_checkpoint`), an autograd Function whose tensor
inputs decide whether autograd ever calls its backward. With the embedding frozen
(LoRA), the decoder input does not require grad, so the chunk's output does not
either: backward never re-runs the chunk and the adapters inside get no gradient
(on the first pipeline stage; later stages receive an input that requires grad).
The fix, the same one PEFT applies for Hugging Face gradient checkpointing: when the
block holds trainable parameters and grad is enabled, hand the checkpointed forward an
input that requires grad. Cost: the input grad of the first recomputed chunk, which
is otherwise skipped.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


@functools.lru_cache(maxsize=None)
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


def checkpointed_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the full-recompute forward: its input requires grad when needed.

    Wraps the method `TransformerBlock._checkpointed_forward` (up to 0.17) or the module
    function `checkpointed_forward(block, ...)` that 0.18+ imports into `transformer_block`
    and `hybrid_block` (the block is then its first argument, `self`).
    """
    import torch

    call = _signature(wrapped).bind(*args, **kwargs).arguments
    block = instance if instance is not None else call["self"]
    hidden_states = call["hidden_states"]
    if (
        torch.is_grad_enabled()
        and isinstance(hidden_states, torch.Tensor)
        and not hidden_states.requires_grad
        and any(param.requires_grad for param in block.parameters())
    ):
        call["hidden_states"] = hidden_states.detach().requires_grad_(True)
    return wrapped(**call)
