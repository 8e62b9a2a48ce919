"""Topology-invariant initial values of the logical (world-size-1) LoRA factors.

The logical A (r x in) and B (out x r) of a module are a pure function of
(seed, canonical module name, expert index): each factor draws from its own
`torch.Generator` seeded by a stable hash of those, on CPU in float32, so every
rank of every topology computes the same logical tensors and keeps its slice
(docs/architecture.md section 4, "Init is topology-invariant"). Nothing is broadcast.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Tuple

import torch

from megatron_lora_patch.lora.adapters.projections import block_mask
from megatron_lora_patch.lora.config import LoraConfig


def factor_seed(seed: int, module_name: str, expert_index: Optional[int], factor: str) -> int:
    """A 63-bit generator seed that depends only on its arguments (not on PYTHONHASHSEED)."""
    key = f"{seed}\x00{module_name}\x00{expert_index}\x00{factor}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)


def _uniform(shape: Tuple[int, int], bound: float, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def _normal(shape: Tuple[int, int], std: float, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def logical_factors(
    config: LoraConfig,
    module_name: str,
    expert_index: Optional[int],
    in_features: int,
    out_features: int,
    projection_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The logical float32 CPU factors `(A: r x in, B: out x r)` of one adapted module (r: its own rank).

    A: Kaiming-uniform with a=sqrt(5) on the FULL fan-in `in_features` (bound
    1/sqrt(in), what torch.nn.Linear uses), or Gaussian with std 1/r. B: zeros, or
    for `b_init="nonzero"` Kaiming-uniform on its own fan-in r (bound 1/sqrt(r)).
    With `projection_rows` (separate adapters on a fused linear, lora/adapters/projections.py) A is the k
    projections' A's stacked (k*r x in) and B the block matrix (out x k*r), zero off its blocks.
    """
    rank = config.rank_for(module_name)
    mask = None if projection_rows is None else block_mask(projection_rows, rank)
    rows = rank if mask is None else mask.shape[1]
    a_seed = factor_seed(config.seed, module_name, expert_index, "A")
    if config.init == "kaiming":
        lora_a = _uniform((rows, in_features), 1.0 / math.sqrt(in_features), a_seed)
    else:
        lora_a = _normal((rows, in_features), 1.0 / rank, a_seed)
    if config.b_init == "zero":
        lora_b = torch.zeros((out_features, rows), dtype=torch.float32)
    else:
        b_seed = factor_seed(config.seed, module_name, expert_index, "B")
        lora_b = _uniform((out_features, rows), 1.0 / math.sqrt(rank), b_seed)
        lora_b = lora_b if mask is None else lora_b * mask
    return lora_a, lora_b
