"""Rank-side code of the LoRA layer tests: real Megatron linears vs a dense recompute.

Every rank builds a column-parallel and a row-parallel layer (dense, or expert on
the expert-TP group), loads its slice of logical base weights, attaches adapters with
non-zero B, runs forward + backward and compares against the dense world-size-1 math
`y = x W^T + b + s x A^T B^T` on the logical tensors (autograd on plain tensors).
Replicated-factor grads get their TP SUM here (the finalize_grads patch's job in
training); expert-path partial outputs / input grads get the dispatcher's SUM here.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Dict

import torch
from error_metrics import max_abs_error_over_max

SEQ, BATCH, HIDDEN, FFN = 8, 2, 16, 24
RANK = 4
DTYPE = torch.float32


def _logical(name: str, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=generator, dtype=DTYPE)


def _dense_reference(x, weight, bias, lora_a, lora_b, scale, upstream):
    leaves = [t.clone().requires_grad_(True) for t in (x, lora_a, lora_b)]
    x_, a_, b_ = leaves
    y = x_ @ weight.t() + scale * (x_ @ a_.t()) @ b_.t()
    if bias is not None:
        y = y + bias
    (y * upstream).sum().backward()
    return y.detach(), x_.grad, a_.grad, b_.grad


def _build(config, *, expert: bool, tp_group):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    init = lambda weight: torch.nn.init.normal_(weight, std=0.02)  # noqa: E731 (overwritten below)
    layers = torch.nn.Module()
    layers.linear_fc1 = ColumnParallelLinear(
        HIDDEN,
        FFN,
        config=config,
        init_method=init,
        bias=not expert,
        gather_output=False,
        is_expert=expert,
        tp_group=tp_group,
    )
    layers.linear_fc2 = RowParallelLinear(
        FFN,
        HIDDEN,
        config=config,
        init_method=init,
        bias=not expert,
        input_is_parallel=True,
        skip_bias_add=expert,
        is_expert=expert,
        tp_group=tp_group,
    )
    return layers


def apply_lora_linear() -> None:
    """Only `cpu_compat` and `lora_linear` on: the layer tests see no other patch."""
    from megatron_lora_patch.proof.testbed.patches import apply_only

    apply_only(("cpu_compat", "lora_linear"))


@dataclasses.dataclass(frozen=True)
class _Shards:
    """This rank's place in the layer's TP (expert-TP) group and how it slices logical tensors."""

    group: Any
    rank: int
    size: int
    sp: bool
    expert: bool

    def tp(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        from megatron_lora_patch.lora.adapters.layouts import shard

        return shard(tensor, dim, self.rank, self.size)

    def seq(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.tp(tensor, 0) if self.sp else tensor


def _run(shards: _Shards, module, column: bool, x, upstream, y_ref, dx_ref):
    """Forward + backward of this rank's layer; (output, expected output, input grad, expected input grad)."""
    if column:
        x_local = shards.seq(x).clone().requires_grad_(True)
        y_local, _ = module(x_local)
        (y_local * shards.tp(upstream, 2)).sum().backward()
        expected_y, dx, expected_dx = shards.tp(y_ref, 2), x_local.grad, shards.seq(dx_ref)
    else:
        x_local = shards.tp(x, 2).clone().requires_grad_(True)
        y_local, _ = module(x_local)
        (y_local * shards.seq(upstream)).sum().backward()
        expected_y, dx, expected_dx = shards.seq(y_ref), x_local.grad, shards.tp(dx_ref, 2)
    if shards.expert:
        # Explicit expert comm: the layer's output (row) and input grad (column) are
        # partial sums the token dispatcher reduces over expert-TP.
        if column:
            torch.distributed.all_reduce(dx, group=shards.group)
            expected_dx = dx_ref
        else:
            y_local = y_local.detach().clone()
            torch.distributed.all_reduce(y_local, group=shards.group)
    return y_local, expected_y, dx, expected_dx


def _adapter_grads(shards: _Shards, module, column: bool):
    """dA, dB of the layer's adapter (replicated ones SUMmed over TP, as finalize does) after checking its metadata."""
    from megatron_lora_patch.lora.adapters.metadata import adapter_info

    adapter = module.lora
    grad_a, grad_b = adapter.A.grad.clone(), adapter.B.grad.clone()
    for param, grad in ((adapter.A, grad_a), (adapter.B, grad_b)):
        info = adapter_info(param)
        assert info.domain == ("expert_tp" if shards.expert else "tp") and info.group is shards.group
        assert param.allreduce is (not shards.expert)
        assert getattr(param, "tensor_model_parallel", False) is (not info.replicated)
        if info.replicated:
            torch.distributed.all_reduce(grad, group=shards.group)  # the finalize_grads SUM
    assert adapter_info(adapter.A).replicated is column and adapter_info(adapter.B).replicated is not column
    assert module.weight.grad is None
    return grad_a, grad_b


def _layer_errors(shards: _Shards, lora, name: str, module, in_f: int, out_f: int) -> Dict[str, float]:
    """Max-abs errors (over max) of one layer's output, input grad, factor grads and init vs the dense math."""
    from megatron_lora_patch.lora.adapters.init import logical_factors

    column = name == "fc1"
    weight = _logical(name + ".weight", out_f, in_f)
    bias = None if shards.expert else _logical(name + ".bias", out_f)
    x, upstream = _logical(name + ".x", SEQ, BATCH, in_f), _logical(name + ".dy", SEQ, BATCH, out_f)
    lora_a, lora_b = logical_factors(lora, "linear_" + name, None, in_f, out_f)
    y_ref, dx_ref, da_ref, db_ref = _dense_reference(x, weight, bias, lora_a, lora_b, lora.scale, upstream)
    with torch.no_grad():
        module.weight.copy_(shards.tp(weight, 0 if column else 1))
        if bias is not None:
            module.bias.copy_(shards.tp(bias, 0) if column else bias)
    y_local, expected_y, dx, expected_dx = _run(shards, module, column, x, upstream, y_ref, dx_ref)
    grad_a, grad_b = _adapter_grads(shards, module, column)
    return {
        f"{name}.y": max_abs_error_over_max(y_local, expected_y),
        f"{name}.dx": max_abs_error_over_max(dx, expected_dx),
        f"{name}.dA": max_abs_error_over_max(grad_a, da_ref if column else shards.tp(da_ref, 1)),
        f"{name}.dB": max_abs_error_over_max(grad_b, shards.tp(db_ref, 0) if column else db_ref),
        f"{name}.A_init": max_abs_error_over_max(module.lora.A, lora_a if column else shards.tp(lora_a, 1)),
        f"{name}.B_init": max_abs_error_over_max(module.lora.B, shards.tp(lora_b, 0) if column else lora_b),
    }


def check_layers(rank: int, world: int, topology_spec: str, expert: bool, sp_input: str) -> Dict[str, float]:
    """Max-abs errors vs the dense reference for column and row layers (plus structural checks)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.layers.attach import attach_adapters
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_lora_linear()
    topology = Topology.parse(topology_spec)
    errors: Dict[str, float] = {}
    with topology.world():
        if expert:
            group = parallel_state.get_expert_tensor_parallel_group()
        else:
            group = parallel_state.get_tensor_model_parallel_group()
        shards = _Shards(group, group.rank(), group.size(), sp=topology.sp and not expert, expert=expert)
        config = ModelParallelConfig(
            tensor_model_parallel_size=topology.tp,
            expert_model_parallel_size=topology.ep,
            expert_tensor_parallel_size=topology.etp,
            sequence_parallel=topology.sp,
            use_cpu_initialization=True,
            params_dtype=DTYPE,
        )
        lora = LoraConfig(rank=RANK, alpha=8.0, b_init="nonzero", seed=5, sp_input=sp_input)
        layers = _build(config, expert=expert, tp_group=group)
        names = attach_adapters(layers, lora)
        assert names == ["linear_fc1", "linear_fc2"], names
        trainable = sorted(n for n, p in layers.named_parameters() if p.requires_grad)
        assert trainable == ["linear_fc1.lora.A", "linear_fc1.lora.B", "linear_fc2.lora.A", "linear_fc2.lora.B"], (
            trainable
        )
        errors.update(_layer_errors(shards, lora, "fc1", layers.linear_fc1, HIDDEN, FFN))
        errors.update(_layer_errors(shards, lora, "fc2", layers.linear_fc2, FFN, HIDDEN))
    return errors
