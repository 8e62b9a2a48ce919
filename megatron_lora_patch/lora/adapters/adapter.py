"""The LoRA adapter of one Megatron tensor-parallel linear layer (docs/architecture.md section 4).

| layer           | A (r x in)            | B (out x r)            |
|-----------------|-----------------------|------------------------|
| column-parallel | replicated            | sharded on out, like W |
| row-parallel    | sharded on in, like W | replicated             |

Experts use the same math on the expert-TP group (`layer.tp_group` of an expert
linear is the expert-TP group). The adapter computes only its local term; how that
term rides the base layer's one collective is `lora.linear`'s job.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from megatron_lora_patch.lora.adapters import dora
from megatron_lora_patch.lora.adapters.init import logical_factors
from megatron_lora_patch.lora.adapters.kernels import add_up_projection, down_projection, regather_down_projection
from megatron_lora_patch.lora.adapters.layouts import shard
from megatron_lora_patch.lora.adapters.metadata import AdapterParamInfo, tag
from megatron_lora_patch.lora.adapters.projections import block_mask
from megatron_lora_patch.lora.config import LoraConfig


class LoraAdapter(torch.nn.Module):
    """Parameters `A`, `B` (local shards) plus the per-rank LoRA term of one linear layer.

    Registered as a submodule of the layer, so DDP, the optimizer and state dicts see
    `<layer>.lora.A` / `<layer>.lora.B`; the layer itself is not referenced (no cycle).
    `layer` is a Megatron linear or anything with its `input_size`, `output_size` (logical),
    `tp_group`, `weight` (local) and `is_expert` (`lora.te.Geometry` for TE linears).
    """

    def __init__(
        self,
        layer: Any,
        *,
        parallel_mode: str,
        module_name: str,
        expert_index: Optional[int],
        config: LoraConfig,
        out_stride: int = 1,
        projection_rows: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        from megatron.core.utils import get_pg_rank, get_pg_size

        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode must be 'column' or 'row', got {parallel_mode!r}")
        self.parallel_mode = parallel_mode
        self.module_name = module_name
        self.expert_index = expert_index
        self.lora_config = config  # the settings it was built from (checkpoint descriptions read them)
        self.rank = config.rank_for(module_name)  # rank_pattern / alpha_pattern / rsLoRA decide per module
        self.scale = config.scale_for(module_name)
        self.dropout = config.dropout
        self.sp_input = config.sp_input
        self.tp_group = layer.tp_group
        tp_rank, tp_world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)

        logical_a, logical_b = logical_factors(
            config, module_name, expert_index, layer.input_size, layer.output_size, projection_rows
        )
        if parallel_mode == "column":
            local_a, local_b = logical_a, shard(logical_b, 0, tp_rank, tp_world, out_stride)
        else:
            local_a, local_b = shard(logical_a, 1, tp_rank, tp_world), logical_b
        weight = layer.weight
        self.A = torch.nn.Parameter(local_a.to(device=weight.device, dtype=weight.dtype))
        self.B = torch.nn.Parameter(local_b.to(device=weight.device, dtype=weight.dtype))
        # Separate adapters per projection: B's off-block entries never act (lora/adapters/projections.py).
        self.block_mask: Optional[torch.Tensor]
        mask = None
        if projection_rows is not None:
            mask = shard(block_mask(projection_rows, self.rank), 0, tp_rank, tp_world, out_stride).to(self.B)
        self.register_buffer("block_mask", mask, persistent=False)

        self.is_expert = bool(layer.is_expert)
        # DoRA: `m` per local output row, initialised to ||W + s B A|| (lora/adapters/dora.py); None: plain LoRA
        self.magnitude = dora.Magnitude(parallel_mode, self.tp_group) if config.dora else None
        if self.magnitude is not None:
            self.m = torch.nn.Parameter(self.weight_norm(weight).to(weight.dtype))
        self._tag_factors(module_name, out_stride)

    def _tag_factors(self, module_name: str, out_stride: int) -> None:
        """Adapter metadata (finalize, grad norm) and Megatron's TP attributes on A and B."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        is_expert, parallel_mode = self.is_expert, self.parallel_mode
        sharded = {"B": 0, dora.MAGNITUDE: 0} if parallel_mode == "column" else {"A": 1}
        factors = [("A", self.A), ("B", self.B)] + ([(dora.MAGNITUDE, self.m)] if self.magnitude else [])
        for factor, param in factors:
            replicated = factor not in sharded
            info = AdapterParamInfo(
                module=module_name,
                factor=factor,
                replicated=replicated,
                domain="expert_tp" if is_expert else "tp",
                group=self.tp_group,
                expert=is_expert,
            )
            tag(param, info)
            # DDP puts allreduce=False params in expert-parallel buffers (expert-DP sync).
            param.allreduce = not is_expert
            if not replicated:
                # Grad-norm counts sharded params on every TP rank, replicated ones on TP rank 0.
                stride = out_stride if parallel_mode == "column" else 1
                set_tensor_model_parallel_attributes(param, True, sharded[factor], stride)

    def extra_repr(self) -> str:
        return (
            f"{self.parallel_mode}, rank={self.rank}, scale={self.scale}, separate={self.block_mask is not None}, "
            f"A={tuple(self.A.shape)}, B={tuple(self.B.shape)}, dora={self.magnitude is not None}"
        )

    def weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """DoRA's detached `||W + s B A||` per local output row (fp32) for the local base weight `weight`."""
        assert self.magnitude is not None, "weight_norm is DoRA's"
        return self.magnitude.norm(weight, self.A, self.up_weight(), self.scale)

    def reset_magnitude(self, weight: torch.Tensor) -> None:
        """DoRA: `m` := `||W + s B A||` of the base weight `weight` now (after the base was loaded)."""
        with torch.no_grad():
            self.m.copy_(self.weight_norm(weight))

    def dora_rescale(self, output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`output * m / ||W + s B A||` per output row (the bias-free output; plain LoRA: `output`)."""
        if self.magnitude is None:
            return output
        return dora.rescale(output, self.m, self.weight_norm(weight))

    def up_weight(self) -> torch.Tensor:
        """The B the LoRA term multiplies: `B`, or `B * block_mask` for separate projections."""
        return self.B if self.block_mask is None else self.B * self.block_mask

    def _training_dropout(self) -> bool:
        return bool(self.dropout) and self.training

    def column_mask(self, total_input: torch.Tensor) -> Optional[torch.Tensor]:
        """Dropout keep-mask of the column input, or None when dropout is off.

        That input is replicated over TP (expert-TP), so every rank must draw the same
        mask. Not from the default generator: under sequence parallelism Megatron runs
        the whole decoder inside the TP-rank-specific tracker fork, so the default
        generator differs per TP rank there. Megatron's tracker state
        "data-parallel-rng" is seeded with the plain seed on every rank.
        """
        if not self._training_dropout():
            return None
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name

        with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
            return _keep_mask(total_input, self.dropout)

    def row_mask(self, local_input: torch.Tensor) -> Optional[torch.Tensor]:
        """Dropout keep-mask of the row input (a TP shard), or None when dropout is off.

        Each rank draws its own mask, from Megatron's model-parallel tracker state
        (expert-parallel state for experts), seeded per TP (expert-TP) rank, as Megatron
        does for dropout on TP-sharded activations.
        """
        if not self._training_dropout():
            return None
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        tracker = get_cuda_rng_tracker()
        with tracker.fork(get_expert_parallel_rng_tracker_name()) if self.is_expert else tracker.fork():
            return _keep_mask(local_input, self.dropout)

    def column_down(self, total_input: torch.Tensor, local_input: Optional[torch.Tensor] = None,
                    fuse_dgrad: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the input the base matmul consumes, `h = dropout(x) A^T`) on the (gathered / copied)
        input of the base matmul (`kernels.down_projection`; `fuse_dgrad`: the base's input grad
        then receives the LoRA input grad in place).

        With `local_input` given (sequence parallel, `sp_input="regather"`), backward keeps only
        that local shard and all-gathers it again for dA.
        """
        mask = self.column_mask(total_input)
        if local_input is None:
            return down_projection(total_input, self.A, mask, self.dropout, fuse_dgrad)
        return total_input, regather_down_projection(total_input, self.A, local_input, mask, self.dropout,
                                                     self.tp_group)

    def row_down(self, local_input: torch.Tensor, fuse_dgrad: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the input the base matmul consumes, `h = dropout(x_shard) A_shard^T`): this rank's
        partial of the rank-r hidden, as in `column_down`."""
        return down_projection(local_input, self.A, self.row_mask(local_input), self.dropout, fuse_dgrad)

    def up(self, hidden: torch.Tensor, base_output: Optional[torch.Tensor] = None,
           in_place: bool = False) -> torch.Tensor:
        """`base_output + s * h B^T` in one GEMM (`kernels.add_up_projection`; `in_place`: the
        caller owns `base_output`, a fresh output of the base matmul)."""
        return add_up_projection(base_output, hidden, self.up_weight(), self.scale, in_place)

    def column_term(self, total_input: torch.Tensor, local_input: Optional[torch.Tensor],
                    base_output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`s * dropout(x) A^T B_shard^T` (plus `base_output` when given, out of place)."""
        return self.up(self.column_down(total_input, local_input)[1], base_output)

    def row_term(self, local_input: torch.Tensor, base_output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`s * dropout(x_shard) A_shard^T B^T`: this rank's partial sum of the LoRA output
        (plus `base_output` when given, out of place)."""
        return self.up(self.row_down(local_input)[1], base_output)


def _keep_mask(activation: torch.Tensor, dropout: float) -> torch.Tensor:
    return torch.empty_like(activation, dtype=torch.bool).bernoulli_(1.0 - dropout)
