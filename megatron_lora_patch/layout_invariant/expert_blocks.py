"""An expert's weight grads per global microbatch, summed over fixed sequence blocks
(docs/architecture.md section 7).

Under sequence parallelism (MoE at tp > 1) a microbatch's tokens reach an expert from `tp` source
ranks, one per sequence shard, and the backward of those segments runs in autograd's order. So the
grad of one (expert parameter, global microbatch) is formed from `SEQUENCE_BLOCKS` block partials:
block `b` holds the chained chunk grads of the tokens at flattened positions
`[b * n / SEQUENCE_BLOCKS, (b + 1) * n / SEQUENCE_BLOCKS)` of the microbatch's `n` tokens, which lie
in one shard for every tp dividing `SEQUENCE_BLOCKS`. Blocks wait here until the microbatch's
`backward_step` ends (every segment of it has run backward), then are chained in block order and
added into the microbatch's lane: the same bits whichever shard, rank or order delivered them.
Memory: at most `SEQUENCE_BLOCKS` expert-grad partials per parameter and source DP rank, for one
microbatch at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

#: Blocks of consecutive token positions per microbatch; tensor-parallel sizes dividing it give the same bits.
SEQUENCE_BLOCKS = 8


class PendingBlocks:
    """Block partials of the running `backward_step`, per (parameter, global microbatch)."""

    def __init__(self) -> None:
        self._blocks: Dict[Tuple[int, int], Tuple[Any, Dict[int, torch.Tensor]]] = {}

    def add(self, param: Any, microbatch: int, block: int, grad: torch.Tensor) -> None:
        """Keep `grad`, the chained chunk grads of `param` over block `block` of global `microbatch`."""
        _, blocks = self._blocks.setdefault((id(param), microbatch), (param, {}))
        if block in blocks:
            raise RuntimeError(f"expert block {block} of microbatch {microbatch} arrived twice")
        blocks[block] = grad

    def flush(self, add_global: Callable[[Any, torch.Tensor, int], None]) -> None:
        """`add_global(param, blocks chained in block order, microbatch)` for every pending pair; then empty."""
        pending, self._blocks = self._blocks, {}
        for (_, microbatch), (param, blocks) in pending.items():
            total = None
            for block in sorted(blocks):
                total = blocks[block].clone() if total is None else total.add_(blocks[block])
            add_global(param, total, microbatch)

    def clear(self) -> None:
        self._blocks = {}


PENDING = PendingBlocks()
