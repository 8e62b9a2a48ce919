"""LoRA on Megatron's Transformer Engine linears (`megatron.core.extensions.transformer_engine`).

What is verified, and where: the LoRA branch math below (`column_term`, `row_term`, with
their own collectives) is checked on CPU/gloo against the dense world-size-1 math for
TP2 and TP2+SP by tests/test_lora_te.py, using Megatron's own mappings. The wiring into
the TE modules (the forward wrappers, `return_layernorm_output`, grouped splits) needs
Transformer Engine, hence CUDA: those tests skip where TE does not import and have NOT
been run by the authors of this module. Written against Megatron-Core 0.16.1's TE
wrappers and TE main (d0067d0, `module/layernorm_linear.py`).

Why the LoRA branch cannot ride TE's collectives as it rides Megatron's: TE runs the TP
communication inside its fused autograd functions (the SP all-gather of the input, the
dgrad all-reduce / reduce-scatter, the row output reduction). So the branch runs beside
the TE module and communicates its rank-r hidden activation instead; every extra
collective carries [tokens, r], i.e. r/in (column) or r/out (row) of the base's:

| layer       | TP (no SP)                | TP + SP                                       |
|-------------|---------------------------|-----------------------------------------------|
| column      | bwd: all-reduce of dh     | fwd: all-gather of h, bwd: reduce-scatter dh  |
| row         | fwd: all-reduce of h      | fwd: reduce-scatter of h, bwd: all-gather dh  |
| experts with explicit comm, or TP size 1 | none: the same local terms as Megatron's own linears |

Under SP the column branch projects the local sequence shard first (A is replicated, so
`gather(x) A^T == gather(x A^T)`): it keeps no gathered input (`sp_input` does not apply).
Replicated factors' grads stay partial sums over TP, exactly as on the Megatron path, so
the `finalize_grads` SUM and the metadata are the same.

`TELayerNormColumnParallelLinear`: the LoRA input is the norm output. The wrapper turns on
TE's `return_layernorm_output` for the call (TE returns the unquantized, non-gathered norm
output and adds its grad to the dgrad before the norm backward) and strips it from the result.

Not covered: FP8 for the LoRA branch (it runs in the activation dtype), `delay_wgrad_compute`
for adapters, TE's fused `TEFusedMLP` path (bypasses the linears' forward).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.kernels import add_up_projection, apply_mask, down_projection
from megatron_lora_patch.lora.layers.linear import adapter_of

TE_MODULE = "megatron.core.extensions.transformer_engine"
#: Megatron TE class name -> (parallel mode, grouped).
TE_LINEARS = {
    "TELayerNormColumnParallelLinear": ("column", False),
    "TEColumnParallelLinear": ("column", False),
    "TERowParallelLinear": ("row", False),
    "TEColumnParallelGroupedLinear": ("column", True),
    "TERowParallelGroupedLinear": ("row", True),
}


def te_linear_kind(module: torch.nn.Module) -> Optional[Tuple[str, bool]]:
    """(parallel mode, grouped) of a Megatron TE linear, else None; never imports TE itself.

    A `TELinear(parallel_mode="duplicated")` (MLA's down projections in the TE spec) is
    ("duplicated", False): a linear users can name, whose adapter `attach` refuses."""
    extensions = sys.modules.get(TE_MODULE)
    if extensions is None:
        return None
    for name, kind in TE_LINEARS.items():
        cls = getattr(extensions, name, None)
        if isinstance(cls, type) and isinstance(module, cls):
            return kind
    plain = getattr(extensions, "TELinear", None)
    if isinstance(plain, type) and isinstance(module, plain) and getattr(module, "parallel_mode", None) == "duplicated":
        return "duplicated", False
    return None


class Geometry:
    """The logical shape and shard domain of one (local expert of a) TE linear, for `LoraAdapter`."""

    def __init__(self, weight: torch.Tensor, mode: str, tp_group: Any, is_expert: bool) -> None:
        from megatron.core.utils import get_pg_size

        tp = get_pg_size(tp_group)
        out_local, in_local = weight.shape
        self.weight, self.tp_group, self.is_expert = weight, tp_group, is_expert
        self.output_size = out_local * tp if mode == "column" else out_local
        self.input_size = in_local * tp if mode == "row" else in_local


def geometries(module: torch.nn.Module, mode: str, grouped: bool, is_expert: bool) -> list:
    """One `Geometry` per GEMM: the module's weight, or `weight0..N-1` of a grouped linear."""
    weights = [getattr(module, f"weight{i}") for i in range(module.num_gemms)] if grouped else [module.weight]
    return [Geometry(weight, mode, module._tp_group, is_expert or grouped) for weight in weights]


# -- the branch ---------------------------------------------------------------------------------


def column_term(adapter: LoraAdapter, x: torch.Tensor, sequence_parallel: bool,
                base_output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """LoRA output columns of this rank for a column layer whose TE base does its own TP comm
    (added to `base_output` in the up-projection's GEMM when given: `LoraAdapter.up`)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    if sequence_parallel:  # x is this rank's sequence shard
        local = down_projection(x, adapter.A, adapter.row_mask(x), adapter.dropout)[1]
        hidden = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=adapter.tp_group)
    else:  # x is replicated over TP
        dropped = apply_mask(x, adapter.column_mask(x), adapter.dropout)
        hidden = _DownProjectionAllReduceDgrad.apply(dropped, adapter.A, adapter.tp_group)
    return adapter.up(hidden, base_output)


def row_term(adapter: LoraAdapter, x: torch.Tensor, sequence_parallel: bool,
             base_output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """LoRA output of a row layer whose TE base reduces its own output (full, or a sequence shard),
    added to `base_output` in the up-projection's GEMM when given."""
    from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

    partial = down_projection(x, adapter.A, adapter.row_mask(x), adapter.dropout)[1]
    if sequence_parallel:
        hidden = reduce_scatter_to_sequence_parallel_region(partial, group=adapter.tp_group)
        return adapter.up(hidden, base_output)
    return _UpProjectionAfterAllReduce.apply(partial, adapter.up_weight(), adapter.scale, adapter.tp_group, base_output)


def lora_term(module: torch.nn.Module, adapter: LoraAdapter, x: torch.Tensor,
              base_output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The LoRA term matching what the TE base `module` communicates (fused into `base_output` if given)."""
    te_communicates = module.parallel_mode is not None and module.tp_size > 1
    sequence_parallel = module.sequence_parallel
    if adapter.parallel_mode == "column":
        if te_communicates:
            return column_term(adapter, x, sequence_parallel, base_output)
        return adapter.column_term(x, None, base_output)
    if te_communicates:
        return row_term(adapter, x, sequence_parallel, base_output)
    return adapter.row_term(x, base_output)


class _DownProjectionAllReduceDgrad(torch.autograd.Function):
    """`h = x A^T` on a TP-replicated x. Backward: dA from this rank's partial dh (the
    finalize SUM over TP completes it); dx from dh all-reduced over TP ([tokens, r])."""

    @staticmethod
    def forward(ctx, x, lora_a, group):
        ctx.save_for_backward(x, lora_a)
        ctx.group = group
        return F.linear(x, lora_a)

    @staticmethod
    def backward(ctx, grad_hidden):
        x, lora_a = ctx.saved_tensors
        grad_a = grad_hidden.reshape(-1, grad_hidden.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        total = grad_hidden.contiguous().clone()
        torch.distributed.all_reduce(total, group=ctx.group)
        return total.matmul(lora_a), grad_a, None


class _UpProjectionAfterAllReduce(torch.autograd.Function):
    """`y = base + s * allreduce(h_partial) B^T` (`base` optional, fused by `add_up_projection`).
    Backward: dB from this rank's partial h (the finalize SUM over TP completes it);
    dh_partial = s dy B (the all-reduce's backward is identity); d base = dy, as is."""

    @staticmethod
    def forward(ctx, partial, lora_b, scale, group, base_output):
        total = partial.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        ctx.save_for_backward(partial, lora_b)
        ctx.scale, ctx.has_base = scale, base_output is not None
        return add_up_projection(base_output, total, lora_b, scale)

    @staticmethod
    def backward(ctx, grad_output):
        partial, lora_b = ctx.saved_tensors
        flat = grad_output.reshape(-1, grad_output.shape[-1])
        grad_b = flat.t().matmul(partial.reshape(-1, partial.shape[-1])).mul_(ctx.scale)
        grad_partial = grad_output.matmul(lora_b).mul_(ctx.scale)
        return grad_partial, grad_b, None, None, grad_output if ctx.has_base else None


# -- forward wrappers (installed by the lora_linear patch, patches/lora_linear.py, when the TE module imports) ---


def _first_argument(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


def linear_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`TELinear.forward(x)` (TEColumnParallelLinear, TERowParallelLinear): base + LoRA."""
    adapter = adapter_of(instance)
    if adapter is None:
        return wrapped(*args, **kwargs)
    output, bias = wrapped(*args, **kwargs)
    return lora_term(instance, adapter, _first_argument(args, kwargs, "x"), output), bias


def layernorm_linear_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`TELayerNormColumnParallelLinear.forward(x)`: the LoRA input is TE's own norm output."""
    adapter = adapter_of(instance)
    if adapter is None:
        return wrapped(*args, **kwargs)
    previous = instance.return_layernorm_output
    instance.return_layernorm_output = True  # read by TE's forward only; restored below
    try:
        result = wrapped(*args, **kwargs)
    finally:
        instance.return_layernorm_output = previous
    if instance.te_return_bias:  # Megatron passes TE's (out, bias, ln_out) through
        output, bias, normed = result
    else:  # Megatron returns (TE's (out, ln_out), None)
        (output, normed), bias = result
    return lora_term(instance, adapter, normed, output), bias


def grouped_linear_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`TEGroupedLinear.forward(x, m_splits)`: one adapter per local expert on its token rows.

    TE grouped linears never communicate over TP (Megatron makes their expert comm
    explicit), so each expert's term is the local one, as for Megatron's expert linears.
    """
    adapters = adapter_of(instance)
    if adapters is None:
        return wrapped(*args, **kwargs)
    x = _first_argument(args, kwargs, "x")
    m_splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    output, bias = wrapped(*args, **kwargs)
    splits = m_splits.tolist() if hasattr(m_splits, "tolist") else list(m_splits)
    pieces = [
        adapter.column_term(rows, None, out) if adapter.parallel_mode == "column" else adapter.row_term(rows, out)
        for adapter, rows, out in zip(adapters, torch.split(x, splits), torch.split(output, splits))
    ]
    return torch.cat(pieces), bias
