"""DoRA (PEFT's `use_dora`): the magnitude `m` of an adapter and the detached norm it divides by.

PEFT's definition, per output feature (row) of a linear layer:

    y = m / ||W + s B A||_row * (W x + s B A x) + bias

with the norm over the input dimension of the merged weight, detached (no gradient flows
through it), the bias left unscaled, and `m` initialised to that norm (so a fresh adapter
changes nothing). The merged weight is never built: per row

    ||W + s B A||^2 = ||W||^2 + 2 s <W A^T, B> + s^2 <B (A A^T), B>

where `||W||^2` of the frozen base is computed once per value of W (cached on the weight's
version counter, exact because W is frozen) and `W A^T` (out_local x r) is a transient.
Per rank DoRA keeps one fp32 vector per local output row (the cached base norm) plus `m`.

Tensor parallelism (docs/architecture.md section 4): a column-parallel layer holds whole
rows, so its norm is local and `m` is sharded like the output (dim 0, the layer's stride).
A row-parallel layer holds a slice of every row's input dimension: each term above is a
sum over that dimension, so the per-row partial sums are SUMmed over the TP group before
the square root, and `m` is replicated over TP; its grad is then a partial sum per rank,
SUMmed like a replicated factor's (`AdapterParamInfo.factor == "m"`, `replicated`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

MAGNITUDE = "m"


def row_partial_sums(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                     base_squares: torch.Tensor) -> torch.Tensor:
    """`||W + s B A||^2` per row of this rank's slices (fp32), from the cached `||W||^2` per row."""
    weight_a = torch.matmul(weight, lora_a.t()).float()  # [out_local, r]
    lora_b = lora_b.float()
    gram = torch.matmul(lora_a.float(), lora_a.float().t())  # [r, r]
    cross = (weight_a * lora_b).sum(dim=1)
    square = (torch.matmul(lora_b, gram) * lora_b).sum(dim=1)
    return base_squares + (2.0 * scale) * cross + (scale * scale) * square


def base_row_squares(weight: torch.Tensor) -> torch.Tensor:
    """`||W||^2` per row of `weight` in fp32, one row block at a time (no full fp32 copy of W)."""
    block = max(1, (1 << 24) // max(1, weight.shape[1]))
    return torch.cat([
        torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square() for rows in weight.split(block)
    ])


class Magnitude:
    """The DoRA state of one adapter: where its norm comes from and how it is reduced.

    `parallel_mode` "row" SUMs the per-row sums of squares over `group`; "column" keeps them local.
    """

    def __init__(self, parallel_mode: str, group: Any) -> None:
        self.parallel_mode = parallel_mode
        self.group = group
        self._base: Optional[tuple] = None  # (weight storage, weight version, ||W||^2 per row)

    def _base_squares(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape)
        if self._base is None or self._base[0] != key:
            self._base = (key, base_row_squares(weight))
        return self._base[1]

    def norm(self, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
        """`||W + s B A||` per local output row (fp32), detached; a collective over TP for row-parallel layers."""
        with torch.no_grad():
            squares = row_partial_sums(weight, lora_a, lora_b, scale, self._base_squares(weight))
            if self.parallel_mode == "row":
                reduce_row_squares(squares, self.group)
            return squares.clamp_(min=0.0).sqrt_()


def reduce_row_squares(squares: torch.Tensor, group: Any) -> None:
    """SUM a row-parallel layer's per-row partial sums of squares over its TP group, in place."""
    import torch.distributed as dist

    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)


def rescale(output: torch.Tensor, magnitude: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """`output * (m / norm)` per output row (the last dim): `m` gets its grad, the norm none."""
    return output * (magnitude.float() / norm).to(output.dtype)
