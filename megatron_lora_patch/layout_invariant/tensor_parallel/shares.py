"""The fixed partition of a TP-sharded dimension and the canonical tree over it
(docs/architecture.md section 7).

Bitwise invariance across TP needs every sum whose terms a TP split separates to be formed
in one order that no TP degree changes, with every GEMM of a shape that no TP degree changes
either (CPU and GPU kernels choose their blocking, hence the summation order, from the
shapes). Both come from one partition of the sharded dimension, fixed by its width alone:
each stride part (SwiGLU fc1: gate, up) is cut into `SEGMENTS` equal segments, each segment
into chunks of at most `CHUNK_COLUMNS`. TP rank r of n holds segments r * S / n ... (r + 1) *
S / n of every part: exactly Megatron's shard, with every shard boundary on a segment edge.

- A GEMM runs per chunk (the same shape at every TP degree).
- A sum over the sharded dimension is a chained sum over the chunks of a segment (its stride
  parts in order), then the canonical tree over the segments: it splits its operands
  into halves (the high bit of the segment index first), so a rank's contiguous segments form
  one subtree (`TreeSum`). Each rank sums its own subtree, the per-rank partials are all-gathered and the
  same tree finishes over them in rank order (`collectives.tree_all_gather`): the TP = 1 bits.
"""

from __future__ import annotations

import functools
from math import gcd
from typing import List, Optional, Tuple

import torch

from megatron_lora_patch.layout_invariant.tensor_parallel import TPInvariantUnsupported

#: Segments per stride part: Megatron's shard boundaries at TP 1, 2, 4 and 8 fall on segment edges.
SEGMENTS = 8
#: Widest chunk one GEMM covers: a contraction this long keeps a GEMM compute-bound and the
#: chained adds of a segment few; the row layer's contiguous copy of one weight chunk, `[out, 1024]`,
#: bounds its scratch.
CHUNK_COLUMNS = 1024

Chunks = Tuple[Tuple[int, int], ...]


def _segments(width: int, stride: int, world: int) -> Tuple[int, int]:
    """(segments per stride part, segment size), refused where a TP shard would split a segment."""
    part = width // stride
    segments = gcd(part, SEGMENTS)
    if width % stride or segments % world:
        raise TPInvariantUnsupported(
            f"tp_invariant: a dimension of {width} (stride {stride}) does not split into whole segments "
            f"for TP {world}: run the TP-invariant mode at a TP degree dividing {segments}, or turn tp_invariant off"
        )
    return segments, part // segments


def _chunks_of(start: int, size: int) -> Chunks:
    stops = (min(offset + CHUNK_COLUMNS, size) for offset in range(0, size, CHUNK_COLUMNS))
    return tuple((start + offset, start + stop) for offset, stop in zip(range(0, size, CHUNK_COLUMNS), stops))


@functools.lru_cache(maxsize=None)
def local_segments(width: int, stride: int, world: int) -> Tuple[Chunks, ...]:
    """The chunks of every segment a rank holds, as `(start, stop)` offsets into its LOCAL shard of a
    dimension of `width`, segment by segment in tree order; within a segment, the chunks of each
    stride part in turn (the chained order of the segment's sum). The same for every rank."""
    segments, size = _segments(width, stride, world)
    mine, local_part = segments // world, width // stride // world
    return tuple(
        tuple(chunk for p in range(stride) for chunk in _chunks_of(p * local_part + s * size, size))
        for s in range(mine)
    )


def local_chunks(width: int, stride: int, world: int) -> Chunks:
    """Every chunk of the local shard, in the shard's order (a partition of `[0, width / world)`)."""
    return tuple(sorted(chunk for segment in local_segments(width, stride, world) for chunk in segment))


class TreeSum:
    """The canonical tree sum of a power-of-two count of operands, streamed: `add` them in order, then
    `result()`. Holds at most log2(count) + 1 partial sums (a binary counter), and adds exactly the
    pairs the canonical tree adds: each half of the operands first, then the two halves. The operands
    are consumed: partial sums are formed in place in the first operand of each pair."""

    def __init__(self) -> None:
        self._stack: List[Tuple[int, torch.Tensor]] = []

    def add(self, value: torch.Tensor) -> None:
        leaves = 1
        while self._stack and self._stack[-1][0] == leaves:
            _, left = self._stack.pop()
            value, leaves = left.add_(value), 2 * leaves
        self._stack.append((leaves, value))

    def result(self) -> Optional[torch.Tensor]:
        if len(self._stack) > 1:
            raise ValueError(f"tree sum of a count that is not a power of two: {[n for n, _ in self._stack]}")
        return self._stack[0][1] if self._stack else None
