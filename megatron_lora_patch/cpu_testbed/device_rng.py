"""The host's stand-in for the CUDA default generator: a CPU generator of its own.

On a GPU the CUDA generator and the CPU generator are separate streams: CUDA draws
(`torch.rand(..., device="cuda")`, `torch.cuda.get_rng_state()`) never move the CPU
stream that `--use-cpu-initialization` draws the base weights from. On the host both
would be the CPU default generator, so Megatron-LM's JIT warm-up (random tensors whose
sizes depend on TP and SP) would shift the weights' stream and TP1 / TP2 would start
from different base weights. Here:

- `torch.cuda.manual_seed(_all)`, `get_rng_state`, `set_rng_state` act on `GENERATOR`
  (what Megatron-LM's checkpoint RNG state and the rerun state machine save and restore);
- a random factory called with a literal CUDA device outside a tracker fork draws from
  `GENERATOR` (`route_random_factory`, called by the host device mode). Inside a fork the
  tracker's state is swapped into the CPU default generator (`cpu_testbed.rng`), which is
  where that draw belongs, as on a GPU;
- a draw on an activation outside a tracker fork (Megatron's hidden / embedding dropout, the
  LoRA keep-mask: `DEVICE_DRAWS`) draws from `GENERATOR` too (`draw_on_device`), as it draws
  from the CUDA default generator on a GPU. Otherwise host-side draws would move the dropout
  stream: Megatron-LM restores both generators from a checkpoint and then builds its data
  loader, which draws a seed from the CPU generator, so a resumed run dropped other units
  than the uninterrupted one (issue 27 item 4: losses 0.1 % then 0.5 % off from the first
  resumed update on).
"""

from __future__ import annotations

from typing import Any

import torch

#: The host's "CUDA default generator".
GENERATOR = torch.Generator(device="cpu")
RANDOM_FACTORIES = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal})
_fork_depth = [0]


#: Draws that read an activation, which lives on the device on a GPU.
DEVICE_DRAWS = frozenset({torch.nn.functional.dropout, torch.dropout, torch.Tensor.bernoulli_})


def manual_seed(seed: int) -> None:
    """Replacement of `torch.cuda.manual_seed` / `manual_seed_all`."""
    GENERATOR.manual_seed(int(seed))


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """Replacement of `torch.cuda.get_rng_state`."""
    return GENERATOR.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """Replacement of `torch.cuda.set_rng_state`."""
    GENERATOR.set_state(new_state)


class tracker_fork:
    """Marks the body of a CUDA RNG tracker fork (the tracked state is in the CPU generator there)."""

    def __enter__(self) -> None:
        _fork_depth[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _fork_depth[0] -= 1


def route_random_factory(func: Any, kwargs: dict) -> dict:
    """`kwargs` of a CUDA-device random factory call, drawing from `GENERATOR` outside tracker forks."""
    if func in RANDOM_FACTORIES and kwargs.get("generator") is None and not _fork_depth[0]:
        return {**kwargs, "generator": GENERATOR}
    return kwargs


def routes_to_device(func: Any) -> bool:
    """Whether `func` is an activation draw made outside a tracker fork (it belongs to `GENERATOR`)."""
    return func in DEVICE_DRAWS and not _fork_depth[0]


def draw_on_device(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)` drawing from `GENERATOR`, swapped into the CPU generator (dropout
    takes no generator argument) and out again; the CPU generator's own stream is left as it was."""
    outer = torch.get_rng_state()
    torch.set_rng_state(GENERATOR.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        GENERATOR.set_state(torch.get_rng_state())
        torch.set_rng_state(outer)
