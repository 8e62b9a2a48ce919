"""The LoRA adapter of one Megatron tensor-parallel linear layer (DESIGN.md section 4).

| layer           | A (r x in)            | B (out x r)            |
|-----------------|-----------------------|------------------------|
| column-parallel | replicated            | sharded on out, like W |
| row-parallel    | sharded on in, like W | replicated             |

Experts use the same math on the expert-TP group (`layer.tp_group` of an expert
linear is the expert-TP group). The adapter computes only its local term; how that
term rides the base layer's one collective is `lora.linear`'s job.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .config import LoraConfig
from .init import logical_factors
from .layouts import shard
from .metadata import AdapterParamInfo, tag

#: The attribute (and submodule name) under which a wrapped layer holds its adapter.
ADAPTER_NAME = "lora"


class LoraAdapter(torch.nn.Module):
    """Parameters `A`, `B` (local shards) plus the per-rank LoRA term of one linear layer.

    Registered as a submodule of the layer, so DDP, the optimizer and state dicts see
    `<layer>.lora.A` / `<layer>.lora.B`; the layer itself is not referenced (no cycle).
    """

    def __init__(
        self,
        layer: torch.nn.Module,
        *,
        parallel_mode: str,
        module_name: str,
        expert_index: Optional[int],
        config: LoraConfig,
        out_stride: int = 1,
    ) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.utils import get_pg_rank, get_pg_size

        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode must be 'column' or 'row', got {parallel_mode!r}")
        self.parallel_mode = parallel_mode
        self.module_name = module_name
        self.expert_index = expert_index
        self.rank = config.rank
        self.scale = config.scale
        self.dropout = config.dropout
        self.sp_input = config.sp_input
        self.tp_group = layer.tp_group
        tp_rank, tp_world = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)

        logical_a, logical_b = logical_factors(
            config, module_name, expert_index, layer.input_size, layer.output_size
        )
        if parallel_mode == "column":
            local_a, local_b = logical_a, shard(logical_b, 0, tp_rank, tp_world, out_stride)
        else:
            local_a, local_b = shard(logical_a, 1, tp_rank, tp_world), logical_b
        weight = layer.weight
        self.A = torch.nn.Parameter(local_a.to(device=weight.device, dtype=weight.dtype))
        self.B = torch.nn.Parameter(local_b.to(device=weight.device, dtype=weight.dtype))

        is_expert = bool(layer.is_expert)
        sharded_factor, sharded_dim = ("B", 0) if parallel_mode == "column" else ("A", 1)
        for factor, param in (("A", self.A), ("B", self.B)):
            replicated = factor != sharded_factor
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
                set_tensor_model_parallel_attributes(param, True, sharded_dim, stride)

    def extra_repr(self) -> str:
        return (
            f"{self.parallel_mode}, rank={self.rank}, scale={self.scale}, "
            f"A={tuple(self.A.shape)}, B={tuple(self.B.shape)}"
        )

    def _drop(self, activation: torch.Tensor) -> torch.Tensor:
        return F.dropout(activation, self.dropout, self.training) if self.dropout else activation

    def column_term(self, total_input: torch.Tensor, local_input: Optional[torch.Tensor]) -> torch.Tensor:
        """`s * dropout(x) A^T B_shard^T` on the (gathered / copied) input of the base matmul.

        The input is replicated over TP, so dropout uses the default generator, which
        Megatron seeds alike on every TP rank (the same mask everywhere). With
        `local_input` given (sequence parallel, `sp_input="regather"`), backward keeps
        only that local shard and all-gathers it again for dA.
        """
        if local_input is None:
            hidden = F.linear(self._drop(total_input), self.A)
        else:
            mask = None
            if self.dropout and self.training:
                mask = torch.empty_like(total_input, dtype=torch.bool).bernoulli_(1.0 - self.dropout)
            hidden = _DownProjectionRegather.apply(total_input, self.A, local_input, mask, self.dropout, self.tp_group)
        return self.scale * F.linear(hidden, self.B)

    def row_term(self, local_input: torch.Tensor) -> torch.Tensor:
        """`s * dropout(x_shard) A_shard^T B^T`: this rank's partial sum of the LoRA output.

        The input is sharded over TP, so each rank draws its own dropout mask inside
        Megatron's model-parallel RNG tracker (as Megatron does for TP-sharded dropout).
        """
        if self.dropout and self.training:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                local_input = self._drop(local_input)
        return self.scale * F.linear(F.linear(local_input, self.A), self.B)


class _DownProjectionRegather(torch.autograd.Function):
    """`h = dropout(total) A^T` saving the local sequence shard instead of `total`.

    Backward: the input grad goes to `total` (so it joins the base's grad in the one
    reduce-scatter of `gather_from_sequence_parallel_region`), and dA re-gathers the
    local shard with Megatron's `_gather_along_first_dim`: one extra all-gather, the
    same trade as Megatron's trainable-weight linear.
    """

    @staticmethod
    def forward(ctx, total, lora_a, local, mask, dropout, group):
        keep_scale = 1.0 / (1.0 - dropout) if mask is not None else 1.0
        dropped = total * mask * keep_scale if mask is not None else total
        ctx.save_for_backward(local, lora_a, mask)
        ctx.keep_scale, ctx.group = keep_scale, group
        return F.linear(dropped, lora_a)

    @staticmethod
    def backward(ctx, grad_hidden):
        from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

        local, lora_a, mask = ctx.saved_tensors
        total = _gather_along_first_dim(local, ctx.group)
        grad_total = grad_hidden.matmul(lora_a)
        if mask is not None:
            total = total * mask * ctx.keep_scale
            grad_total = grad_total * mask * ctx.keep_scale
        grad_a = grad_hidden.reshape(-1, grad_hidden.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        return grad_total, grad_a, None, None, None, None
