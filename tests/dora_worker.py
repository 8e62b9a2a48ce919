"""Rank-side code of the DoRA layer tests: real Megatron linears vs PEFT's DoRA recomputed densely.

Every rank builds a column-parallel (fc1) and a row-parallel (fc2) layer, loads its slice of logical
base weights, attaches DoRA adapters with non-zero B, sets `m` from the loaded weights
(`reset_magnitudes`, checked against the logical norm) and then to that norm times a per-row factor
(so the rescale is not 1), runs forward + backward and compares with the world-size-1 math on the
logical tensors: `y = m / ||W + s B A||.detach() * (x W^T + s x A^T B^T) + b`. Replicated grads (column
A, row B, row m) get their TP SUM here, as finalize does in training.
"""

from __future__ import annotations

from typing import Dict

import torch
from error_metrics import max_abs_error_over_max
from lora_layer_worker import BATCH, FFN, HIDDEN, RANK, SEQ, _build, _logical, _Shards, apply_lora_linear


def _dense_reference(x, weight, bias, lora_a, lora_b, magnitude, scale, upstream):
    leaves = [t.clone().requires_grad_(True) for t in (x, lora_a, lora_b, magnitude)]
    x_, a_, b_, m_ = leaves
    norm = torch.linalg.vector_norm(weight + scale * b_ @ a_, dim=1).detach()
    y = (m_ / norm) * (x_ @ weight.t() + scale * (x_ @ a_.t()) @ b_.t()) + bias
    (y * upstream).sum().backward()
    return (y.detach(), *(leaf.grad for leaf in leaves))


def _layer_errors(shards: _Shards, lora, name: str, layers, in_f: int, out_f: int) -> Dict[str, float]:
    from megatron_lora_patch.lora.adapters.init import logical_factors
    from megatron_lora_patch.lora.adapters.metadata import adapter_info
    from megatron_lora_patch.lora.checkpoints.magnitudes import reset_magnitudes

    column = name == "fc1"
    module = getattr(layers, "linear_" + name)
    weight, bias = _logical(name + ".weight", out_f, in_f), _logical(name + ".bias", out_f)
    x, upstream = _logical(name + ".x", SEQ, BATCH, in_f), _logical(name + ".dy", SEQ, BATCH, out_f)
    lora_a, lora_b = logical_factors(lora, "linear_" + name, None, in_f, out_f)
    with torch.no_grad():
        module.weight.copy_(shards.tp(weight, 0 if column else 1))
        module.bias.copy_(shards.tp(bias, 0) if column else bias)
    reset_magnitudes(layers)
    norm = torch.linalg.vector_norm(weight + lora.scale * lora_b @ lora_a, dim=1)
    rows = (lambda t: shards.tp(t, 0)) if column else (lambda t: t)
    errors = {f"{name}.m_init": max_abs_error_over_max(module.lora.m, rows(norm))}
    magnitude = norm * (1.0 + 0.5 * _logical(name + ".m", out_f).tanh())
    with torch.no_grad():
        module.lora.m.copy_(rows(magnitude))
    y_ref, dx_ref, da_ref, db_ref, dm_ref = _dense_reference(x, weight, bias, lora_a, lora_b, magnitude, lora.scale,
                                                             upstream)
    if column:
        x_local = shards.seq(x).clone().requires_grad_(True)
        y_local, _ = module(x_local)
        (y_local * shards.tp(upstream, 2)).sum().backward()
        expected_y, expected_dx = shards.tp(y_ref, 2), shards.seq(dx_ref)
    else:
        x_local = shards.tp(x, 2).clone().requires_grad_(True)
        y_local, _ = module(x_local)
        (y_local * shards.seq(upstream)).sum().backward()
        expected_y, expected_dx = shards.seq(y_ref), shards.tp(dx_ref, 2)
    grads = {}
    for factor in ("A", "B", "m"):
        param = getattr(module.lora, factor)
        grad = param.grad.clone()
        info = adapter_info(param)
        assert info.factor == factor and getattr(param, "tensor_model_parallel", False) is (not info.replicated)
        if info.replicated:
            torch.distributed.all_reduce(grad, group=shards.group)  # the finalize_grads SUM
        grads[factor] = grad
    assert module.lora.m.lora_info.replicated is (not column)
    errors.update({
        f"{name}.y": max_abs_error_over_max(y_local, expected_y),
        f"{name}.dx": max_abs_error_over_max(x_local.grad, expected_dx),
        f"{name}.dA": max_abs_error_over_max(grads["A"], da_ref if column else shards.tp(da_ref, 1)),
        f"{name}.dB": max_abs_error_over_max(grads["B"], shards.tp(db_ref, 0) if column else db_ref),
        f"{name}.dm": max_abs_error_over_max(grads["m"], rows(dm_ref)),
    })
    return errors


def check_dora_layers(rank: int, world: int, topology_spec: str) -> Dict[str, float]:
    """Max-abs errors (over max) of DoRA column and row layers vs the dense reference."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.layers.attach import attach_adapters
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_lora_linear()
    topology = Topology.parse(topology_spec)
    errors: Dict[str, float] = {}
    with topology.world():
        group = parallel_state.get_tensor_model_parallel_group()
        shards = _Shards(group, group.rank(), group.size(), sp=topology.sp, expert=False)
        config = ModelParallelConfig(tensor_model_parallel_size=topology.tp, sequence_parallel=topology.sp,
                                     use_cpu_initialization=True, params_dtype=torch.float32)
        lora = LoraConfig(rank=RANK, alpha=8.0, b_init="nonzero", seed=5, dora=True)
        layers = _build(config, expert=False, tp_group=group)
        attach_adapters(layers, lora)
        trainable = sorted(n for n, p in layers.named_parameters() if p.requires_grad)
        assert trainable == [f"linear_{n}.lora.{f}" for n in ("fc1", "fc2") for f in ("A", "B", "m")], trainable
        errors.update(_layer_errors(shards, lora, "fc1", layers, HIDDEN, FFN))
        errors.update(_layer_errors(shards, lora, "fc2", layers, FFN, HIDDEN))
    return errors
