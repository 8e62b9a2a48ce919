"""Rank-side code of the LoRA layer tests: real Megatron linears vs a dense recompute.

Every rank builds a column-parallel and a row-parallel layer (dense, or expert on
the expert-TP group), loads its slice of logical base weights, attaches adapters with
non-zero B, runs forward + backward and compares against the dense world-size-1 math
`y = x W^T + b + s x A^T B^T` on the logical tensors (autograd on plain tensors).
Replicated-factor grads get their TP SUM here (the finalize_grads patch's job in
training); expert-path partial outputs / input grads get the dispatcher's SUM here.
"""

from __future__ import annotations

import zlib
from typing import Dict

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
        HIDDEN, FFN, config=config, init_method=init, bias=not expert, gather_output=False,
        is_expert=expert, tp_group=tp_group,
    )
    layers.linear_fc2 = RowParallelLinear(
        FFN, HIDDEN, config=config, init_method=init, bias=not expert, input_is_parallel=True,
        skip_bias_add=expert, is_expert=expert, tp_group=tp_group,
    )
    return layers


def apply_lora_linear() -> None:
    """Only `cpu_compat` and `lora_linear` on: the layer tests see no other patch."""
    from megatron_lora_patch.proof.testbed.patches import apply_only

    apply_only(("cpu_compat", "lora_linear"))


def check_layers(rank: int, world: int, topology_spec: str, expert: bool, sp_input: str) -> Dict[str, float]:
    """Max-abs errors vs the dense reference for column and row layers (plus structural checks)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_lora_patch.lora.attach import attach_adapters
    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.init import logical_factors
    from megatron_lora_patch.lora.layouts import shard
    from megatron_lora_patch.lora.metadata import adapter_info
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_lora_linear()
    topology = Topology.parse(topology_spec)
    errors: Dict[str, float] = {}
    with topology.world():
        if expert:
            group = parallel_state.get_expert_tensor_parallel_group()
        else:
            group = parallel_state.get_tensor_model_parallel_group()
        tp_rank, tp = group.rank(), group.size()
        sp = topology.sp and not expert
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
        assert trainable == ["linear_fc1.lora.A", "linear_fc1.lora.B", "linear_fc2.lora.A", "linear_fc2.lora.B"], trainable

        def seq_shard(t):
            return shard(t, 0, tp_rank, tp) if sp else t

        for name, module, in_f, out_f in (("fc1", layers.linear_fc1, HIDDEN, FFN), ("fc2", layers.linear_fc2, FFN, HIDDEN)):
            column = name == "fc1"
            weight = _logical(name + ".weight", out_f, in_f)
            bias = None if expert else _logical(name + ".bias", out_f)
            x = _logical(name + ".x", SEQ, BATCH, in_f)
            upstream = _logical(name + ".dy", SEQ, BATCH, out_f)
            lora_a, lora_b = logical_factors(lora, "linear_" + name, None, in_f, out_f)
            y_ref, dx_ref, da_ref, db_ref = _dense_reference(x, weight, bias, lora_a, lora_b, lora.scale, upstream)
            with torch.no_grad():
                module.weight.copy_(shard(weight, 0 if column else 1, tp_rank, tp))
                if bias is not None:
                    module.bias.copy_(shard(bias, 0, tp_rank, tp) if column else bias)

            if column:
                x_local = seq_shard(x).clone().requires_grad_(True)
                y_local, _ = module(x_local)
                expected_y = shard(y_ref, 2, tp_rank, tp)
                (y_local * shard(upstream, 2, tp_rank, tp)).sum().backward()
                dx, expected_dx = x_local.grad, seq_shard(dx_ref)
            else:
                x_local = shard(x, 2, tp_rank, tp).clone().requires_grad_(True)
                y_local, _ = module(x_local)
                expected_y = seq_shard(y_ref)
                (y_local * seq_shard(upstream)).sum().backward()
                dx, expected_dx = x_local.grad, shard(dx_ref, 2, tp_rank, tp)
            if expert:
                # Explicit expert comm: the layer's output (row) and input grad (column) are
                # partial sums the token dispatcher reduces over expert-TP.
                if column:
                    torch.distributed.all_reduce(dx, group=group)
                    expected_dx = dx_ref
                else:
                    y_local = y_local.detach().clone()
                    torch.distributed.all_reduce(y_local, group=group)
            adapter = module.lora
            grad_a, grad_b = adapter.A.grad.clone(), adapter.B.grad.clone()
            for param, grad in ((adapter.A, grad_a), (adapter.B, grad_b)):
                info = adapter_info(param)
                assert info.domain == ("expert_tp" if expert else "tp") and info.group is group
                assert param.allreduce is (not expert)
                assert getattr(param, "tensor_model_parallel", False) is (not info.replicated)
                if info.replicated:
                    torch.distributed.all_reduce(grad, group=group)  # the finalize_grads SUM
            assert adapter_info(adapter.A).replicated is column and adapter_info(adapter.B).replicated is not column
            assert module.weight.grad is None
            errors[f"{name}.y"] = max_abs_error_over_max(y_local, expected_y)
            errors[f"{name}.dx"] = max_abs_error_over_max(dx, expected_dx)
            errors[f"{name}.dA"] = max_abs_error_over_max(grad_a, da_ref if column else shard(da_ref, 1, tp_rank, tp))
            errors[f"{name}.dB"] = max_abs_error_over_max(grad_b, shard(db_ref, 0, tp_rank, tp) if column else db_ref)
            errors[f"{name}.A_init"] = max_abs_error_over_max(adapter.A, lora_a if column else shard(lora_a, 1, tp_rank, tp))
            errors[f"{name}.B_init"] = max_abs_error_over_max(adapter.B, shard(lora_b, 0, tp_rank, tp) if column else lora_b)
    return errors
