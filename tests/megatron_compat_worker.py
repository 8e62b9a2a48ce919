"""Rank-side code of tests/test_megatron_compat.py: one world-size-1 run collects every finding.

Each finding exercises a Megatron-Core API that changed between 0.16 and 0.19 on the code
path the plugin takes, with the real installed Megatron (no doubles).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict

import torch

from megatron_lora_patch.proof.testbed import models

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _layer0_b_grads(model, tokens) -> Dict[str, float]:
    """|grad| sum of the first layer's LoRA B factors after one backward (B starts at zero, A gets none)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    model(tokens, positions, None, labels=tokens).sum().backward()
    return {
        name: float(param.grad.abs().sum()) if param.grad is not None else 0.0
        for name, param in model.named_parameters()
        if name.startswith("decoder.layers.0.") and name.endswith("lora.B")
    }


def _trainable(model) -> list:
    return sorted(name for name, param in model.named_parameters() if param.requires_grad)


def hybrid_findings(spec, topology, tokens) -> Dict[str, Any]:
    """HybridModel (0.18+) with an attention+MLP pattern under full recompute: adapters and grads."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    config = models.transformer_config(spec, topology, **RECOMPUTE)
    model = HybridModel(
        config=config, hybrid_stack_spec=models.hybrid_stack_spec(spec, topology), vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length, hybrid_layer_pattern="*-*-", position_embedding_type="rope",
    )
    return {"trainable": _trainable(model), "layer0_b_grads": _layer0_b_grads(model, tokens)}


def mamba_findings(spec, topology, tokens) -> Dict[str, Any]:
    """MambaModel up to 0.17 (not yet a HybridModel) with an attention+MLP pattern: adapters and grads."""
    from megatron.core.models.mamba.mamba_model import MambaModel

    model = MambaModel(
        config=models.transformer_config(spec, topology), mamba_stack_spec=models.hybrid_stack_spec(spec, topology),
        vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length, hybrid_override_pattern="*-*-",
        position_embedding_type="rope",
    )
    return {"trainable": _trainable(model), "layer0_b_grads": _layer0_b_grads(model, tokens)}


def gpt_recompute_grads(spec, topology, tokens) -> Dict[str, float]:
    return _layer0_b_grads(models.build_model(spec, topology, **RECOMPUTE)[0], tokens)


def gtp_message(spec, topology) -> str:
    """The error building a GPT model with GTP on (`tensor_parallel_num_weight_shards` = 2 x TP)."""
    from megatron_lora_patch.lora.layers.unsupported import UnsupportedModelError

    try:
        models.build_model(spec, topology, tensor_parallel_num_weight_shards=2)
    except UnsupportedModelError as error:
        return str(error)
    return "no error"


def all_to_all_output(topology) -> list:
    """`mappings.all_to_all` with list splits and, where Megatron has it, `use_nccl_stream`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    extra = {"use_nccl_stream": False} if "use_nccl_stream" in inspect.signature(mappings.all_to_all).parameters else {}
    group = parallel_state.get_expert_model_parallel_group()
    data = torch.arange(6.0).reshape(3, 2)
    return mappings.all_to_all(group, data, torch.tensor([3]), torch.tensor([3]), **extra).tolist()


def tp_invariant_loss_error(topology) -> float:
    """TP-invariant `vocab_parallel_cross_entropy`, called as Megatron calls it (0.19: with `tp_group`)."""
    from megatron.core import parallel_state, tensor_parallel

    logits = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 16, (4, 2), generator=torch.Generator().manual_seed(1))
    accepted = inspect.signature(tensor_parallel.vocab_parallel_cross_entropy.__wrapped__).parameters
    extra = {"tp_group": parallel_state.get_tensor_model_parallel_group()} if "tp_group" in accepted else {}
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, **extra)
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), reduction="none")
    return float((loss.reshape(-1) - reference).abs().max())


def world1(rank: int, world_size: int) -> Dict[str, Any]:
    from megatron.core.model_parallel_config import ModelParallelConfig

    import megatron_lora_patch
    from megatron_lora_patch.proof.testbed.data import cp_sequence_positions
    from megatron_lora_patch.proof.testbed.topology import Topology

    megatron_lora_patch.apply(["lora_correct"], enable={"layout_invariant": True}, strict=True)
    spec = models.TinyGPTSpec(num_layers=4)
    topology = Topology.parse("tp1")
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=torch.Generator().manual_seed(2))
    found: Dict[str, Any] = {}
    with topology.world():
        found["cp_positions"] = cp_sequence_positions(8).tolist()
        found["all_to_all"] = all_to_all_output(topology)
        found["loss_error"] = tp_invariant_loss_error(topology)
        found["gpt_recompute"] = gpt_recompute_grads(spec, topology, tokens)
        if hasattr(ModelParallelConfig, "gtp_weight_remat_size"):  # 0.19+
            found["gtp"] = gtp_message(spec, topology)
        try:
            import megatron.core.models.hybrid.hybrid_model  # noqa: F401
        except ModuleNotFoundError:  # before 0.18: MambaModel is the hybrid model
            found["mamba"] = mamba_findings(spec, topology, tokens)
        else:
            found["hybrid"] = hybrid_findings(spec, topology, tokens)
    import megatron.core.optimizer  # noqa: F401  (lora_plus's target: a model run alone never imports it before 0.16)

    found["status"] = {row.patch: row.state for row in megatron_lora_patch.status()}
    return found
