"""What every LoRA adapter parameter tells the rest of the system about itself.

The gradient finalization, DDP bucketing, grad-norm and checkpoint code read this
instead of guessing from names (docs/architecture.md section 4):
- a *replicated* factor (column A, row B) holds the same logical tensor on every rank
  of its shard domain, so its local grad is a partial sum: it must be SUMmed over
  `group` after Megatron's finalize, never averaged, never skipped;
- a *sharded* factor (column B, row A) is a slice like the base weight: it only takes
  part in DP (dense) or expert-DP (experts) sync and carries the grad-norm attributes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

ATTRIBUTE = "lora_info"
#: The submodule name under which a wrapped layer holds its adapter (`<layer>.lora.A`).
ADAPTER_NAME = "lora"
_generation = 0


@dataclasses.dataclass(frozen=True)
class AdapterParamInfo:
    module: str  # qualified name of the wrapped layer in the model ("decoder.layers.0.mlp.linear_fc1")
    factor: Literal["A", "B", "m"]  # "m": DoRA's magnitude (lora/adapters/dora.py), with the output rows
    replicated: bool
    domain: Literal["tp", "expert_tp"]  # the shard domain: dense TP group or expert-TP group
    group: Optional[Any]  # torch.distributed.ProcessGroup of the domain, taken from the wrapped layer
    expert: bool  # expert adapters have allreduce=False: DDP syncs them over expert-DP

    @property
    def grad_sync_op(self) -> Optional[Literal["sum"]]:
        """SUM over `group` for replicated factors; None for sharded ones (DP sync only)."""
        return "sum" if self.replicated else None


def adapter_info(param: Any) -> Optional[AdapterParamInfo]:
    """The adapter metadata of `param`, or None for a non-adapter parameter."""
    return getattr(param, ATTRIBUTE, None)


def tag(param: Any, info: AdapterParamInfo) -> None:
    """Attach `info` to `param` (the one way adapter parameters are marked)."""
    global _generation
    setattr(param, ATTRIBUTE, info)
    _generation += 1


def generation() -> int:
    """How many times `tag` has run in this process: caches of the tagged parameters of a
    model (`grad_sync`) are valid while it stays the same."""
    return _generation
