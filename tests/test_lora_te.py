"""LoRA on Transformer Engine linears (megatron_lora_patch.lora.layers.te).

Two parts:
- The TE-path LoRA branch (`te.column_term` / `te.row_term`, with their own rank-r
  collectives, since TE communicates inside its fused modules) against the dense
  world-size-1 math on CPU/gloo, TP2 and TP2+SP: outputs, input grads, A and B grads
  (replicated factors SUMmed over TP, as the finalize_grads patch does). Runs everywhere.
- The real TE modules with the `lora_linear` patch (world size 1, one GPU): skipped with
  the reason where Transformer Engine does not import.
"""

from __future__ import annotations

import pytest
import torch
from error_metrics import assert_errors_within, max_abs_error_over_max

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.topology import Topology

SEQ, BATCH, HIDDEN, FFN, RANK = 8, 2, 16, 24, 4
TOLERANCE = 1e-6


def _logical(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dense_lora(x, lora_a, lora_b, scale, upstream):
    """`s x A^T B^T` and its grads for x, A, B (plain autograd on the logical tensors)."""
    x, lora_a, lora_b = (t.clone().requires_grad_(True) for t in (x, lora_a, lora_b))
    y = scale * (x @ lora_a.t()) @ lora_b.t()
    (y * upstream).sum().backward()
    return y.detach(), x.grad, lora_a.grad, lora_b.grad


def te_branch_errors(rank: int, world: int, topology_spec: str) -> dict:
    """Errors of the TE-path branch on adapters of real Megatron layers (no TE needed)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_lora_patch.lora.adapters.init import logical_factors
    from megatron_lora_patch.lora.adapters.layouts import shard
    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.layers import te
    from megatron_lora_patch.lora.layers.attach import attach_adapters

    topology = Topology.parse(topology_spec)
    errors = {}
    with topology.world():
        group = parallel_state.get_tensor_model_parallel_group()
        tp_rank, tp = group.rank(), group.size()
        config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        layers = torch.nn.Module()
        init = torch.nn.init.zeros_
        common = dict(config=config, init_method=init, bias=False, tp_group=group)
        layers.linear_fc1 = ColumnParallelLinear(HIDDEN, FFN, gather_output=False, **common)
        layers.linear_fc2 = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True, skip_bias_add=False, **common)
        lora = LoraConfig(rank=RANK, alpha=8.0, b_init="nonzero", seed=2)
        attach_adapters(layers, lora)
        sp = topology.sp

        def seq(t):
            return shard(t, 0, tp_rank, tp) if sp else t

        for name, in_f, out_f in (("linear_fc1", HIDDEN, FFN), ("linear_fc2", FFN, HIDDEN)):
            column = name == "linear_fc1"
            adapter = getattr(layers, name).lora
            x, upstream = _logical(1, SEQ, BATCH, in_f), _logical(2, SEQ, BATCH, out_f)
            lora_a, lora_b = logical_factors(lora, name, None, in_f, out_f)
            y_ref, dx_ref, da_ref, db_ref = _dense_lora(x, lora_a, lora_b, lora.scale, upstream)
            if column:  # input: sequence shard (SP) or replicated; output: this rank's columns
                x_local = seq(x).clone().requires_grad_(True)
                y = te.column_term(adapter, x_local, sp)
                y_expected, dx_expected = shard(y_ref, 2, tp_rank, tp), seq(dx_ref)
                upstream_local = shard(upstream, 2, tp_rank, tp)
            else:  # input: this rank's columns; output: reduced (sequence shard under SP)
                x_local = shard(x, 2, tp_rank, tp).clone().requires_grad_(True)
                y = te.row_term(adapter, x_local, sp)
                y_expected, upstream_local, dx_expected = seq(y_ref), seq(upstream), shard(dx_ref, 2, tp_rank, tp)
            (y * upstream_local).sum().backward()
            grad_a, grad_b = adapter.A.grad.clone(), adapter.B.grad.clone()
            torch.distributed.all_reduce(grad_a if column else grad_b, group=group)  # the finalize_grads SUM
            errors[f"{name}.y"] = max_abs_error_over_max(y, y_expected)
            errors[f"{name}.dx"] = max_abs_error_over_max(x_local.grad, dx_expected)
            errors[f"{name}.dA"] = max_abs_error_over_max(grad_a, da_ref if column else shard(da_ref, 1, tp_rank, tp))
            errors[f"{name}.dB"] = max_abs_error_over_max(grad_b, shard(db_ref, 0, tp_rank, tp) if column else db_ref)
    return errors


@pytest.mark.parametrize("topology", ["tp2", "tp2-sp"])
def test_te_branch_matches_dense_lora(topology):
    results = run_world(te_branch_errors, 2, args=(topology,), name=topology, timeout=240)
    expected = [f"{layer}.{what}" for layer in ("linear_fc1", "linear_fc2") for what in ("y", "dx", "dA", "dB")]
    for rank, errors in enumerate(results):
        assert_errors_within(errors, expected, TOLERANCE, f"{topology} rank {rank}")


# -- the real Transformer Engine modules (CUDA + TE) ---------------------------------------------


def te_module_errors(rank: int, world: int) -> dict:
    """World size 1 on one GPU: TE linears with adapters vs base + dense `s x A^T B^T` (fp32)."""
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    import megatron_lora_patch
    from megatron_lora_patch.lora.adapters.init import logical_factors
    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.layers.attach import attach_adapters
    from megatron_lora_patch.plugins.lora_correct import PATCH_NAMES

    megatron_lora_patch.apply(plugins=["lora_correct"], enable={name: name == "lora_linear" for name in PATCH_NAMES})
    errors = {}
    with Topology().world(cpu_compat=False):
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=2,
            ffn_hidden_size=FFN,
            normalization="LayerNorm",
            params_dtype=torch.float32,
            add_bias_linear=False,
        )
        init = torch.nn.init.normal_
        common = dict(config=config, init_method=init, bias=False, skip_bias_add=False, is_expert=False)
        layers = torch.nn.Module()
        layers.linear_qkv = mte.TELayerNormColumnParallelLinear(HIDDEN, FFN, gather_output=False, **common)
        layers.linear_fc1 = mte.TEColumnParallelLinear(HIDDEN, FFN, gather_output=False, **common)
        layers.linear_fc2 = mte.TERowParallelLinear(FFN, HIDDEN, input_is_parallel=True, **common)
        layers.cuda()
        lora = LoraConfig(rank=RANK, alpha=8.0, b_init="nonzero", seed=2)
        assert attach_adapters(layers, lora) == ["linear_qkv", "linear_fc1", "linear_fc2"]
        for name, module in layers.named_children():
            x = _logical(1, SEQ, BATCH, module.lora.A.shape[1]).cuda()
            upstream = _logical(2, SEQ, BATCH, module.lora.B.shape[0]).cuda()
            lora_a, lora_b = (t.cuda() for t in logical_factors(lora, name, None, x.shape[-1], upstream.shape[-1]))
            lora_input = x
            if name == "linear_qkv":  # the LoRA input is the layer's own norm output
                norm_weight, norm_bias = module.layer_norm_weight.detach(), module.layer_norm_bias.detach()
                lora_input = torch.nn.functional.layer_norm(
                    x, (HIDDEN,), norm_weight, norm_bias, config.layernorm_epsilon
                )
            with torch.no_grad():
                base = module.weight.detach()
                y_ref = lora_input @ base.t() + lora.scale * (lora_input @ lora_a.t()) @ lora_b.t()
            x = x.clone().requires_grad_(True)
            y, _ = module(x)
            (y * upstream).sum().backward()
            _, _, da_ref, db_ref = _dense_lora(lora_input, lora_a, lora_b, lora.scale, upstream)
            errors[f"{name}.y"] = max_abs_error_over_max(y, y_ref)
            errors[f"{name}.dA"] = max_abs_error_over_max(module.lora.A.grad, da_ref)
            errors[f"{name}.dB"] = max_abs_error_over_max(module.lora.B.grad, db_ref)
            errors[f"{name}.base_frozen"] = float(module.weight.grad is not None)
    return errors


def test_te_modules_match_dense_lora():
    pytest.importorskip(
        "transformer_engine", reason="Transformer Engine is not importable here (it needs CUDA); run on a CUDA machine"
    )
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine imports but no CUDA device is available")
    errors = run_world(te_module_errors, 1, name="te", timeout=600)[0]
    layers = ("linear_qkv", "linear_fc1", "linear_fc2")
    expected = [f"{layer}.{what}" for layer in layers for what in ("y", "dA", "dB", "base_frozen")]
    assert_errors_within(errors, expected, 1e-5, "te")  # fp32 cuBLAS GEMMs, other sum order
