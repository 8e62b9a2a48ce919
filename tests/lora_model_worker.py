"""Rank-side code of the GPT-level LoRA tests (tests/test_lora_model.py).

Every rank builds the tiny testbed GPT (dense GQA + SwiGLU, or MoE with SequentialMLP
experts) with the `lora_linear` patch on, so adapters attach at `GPTModel`
construction exactly as in training, and returns picklable findings: its adapter
shards (for the topology-invariant init check), errors against dense recomputes, the
parameters Megatron DDP and the optimizer hold, and dropout masks. The parent
compares them across ranks and worlds.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch.lora.config import LoraConfig
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

DENSE = TinyGPTSpec()  # 4 heads, 2 query groups (GQA), SwiGLU
MOE = TinyGPTSpec.moe()
DENSE_TP4 = TinyGPTSpec(num_attention_heads=8, num_query_groups=4)  # query groups must divide by tp
#: Non-zero B so every check sees a real LoRA delta (zero B hides layout mistakes).
LORA = LoraConfig(rank=4, alpha=8.0, b_init="nonzero", seed=3)
RECOMPUTE = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
PATCHES = ("cpu_compat", "lora_linear")


def apply_patches() -> None:
    """Only `cpu_compat` and `lora_linear`: the findings depend on no other patch."""
    from megatron_lora_patch.proof.testbed.patches import apply_only

    apply_only(PATCHES)


def batch(spec: TinyGPTSpec):
    """(tokens, positions, causal attention mask, labels) of a fixed 2-sample batch.

    The explicit mask (True = masked, as Megatron-LM's data loader builds it) keeps the
    softmax from building its default mask with a literal `device="cuda"`: during a full
    recompute that runs inside backward, where cpu_compat's device mode is not active.
    """
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=generator)
    positions = torch.arange(spec.seq_length).unsqueeze(0).expand(2, -1)
    mask = torch.ones(spec.seq_length, spec.seq_length, dtype=torch.bool).triu(1).view(1, 1, spec.seq_length, -1)
    return tokens, positions, mask, tokens.roll(-1, 1)


def build(spec: TinyGPTSpec, topology, lora: LoraConfig = LORA, **overrides):
    """This rank's GPTModel; the patch attaches adapters configured by `lora` during construction."""
    from megatron_lora_patch.lora import config as lora_config
    from megatron_lora_patch.proof.testbed.models import build_model

    lora_config.set_active(lora)
    try:
        return build_model(spec, topology, **overrides)[0]
    finally:
        lora_config.set_active(None)


def adapters(model) -> Dict[str, object]:
    """local module name -> LoraAdapter."""
    from megatron_lora_patch.lora.adapters.adapter import LoraAdapter

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraAdapter)}


def adapter_shards(model) -> List[dict]:
    """Each adapter's local factors and where they sit (TP/expert-TP rank, B's stride)."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    from megatron_lora_patch.proof.testbed.shards import shard_of

    found = []
    for local_name, adapter in adapters(model).items():
        # The testbed's own canonical name of the wrapped layer: must equal the adapter's.
        testbed_name = shard_of(model, local_name + ".A", adapter.A).logical_name[: -len(".lora.A")]
        found.append(
            dict(
                name=adapter.module_name,
                testbed_name=testbed_name,
                expert_index=adapter.expert_index,
                mode=adapter.parallel_mode,
                stride=getattr(adapter.B, "partition_stride", 1) if adapter.parallel_mode == "column" else 1,
                tp_rank=get_pg_rank(adapter.tp_group),
                tp_size=get_pg_size(adapter.tp_group),
                A=adapter.A.detach().clone(),
                B=adapter.B.detach().clone(),
            )
        )
    return found


def _gather_last(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP ranks' pieces of `tensor` along its last dimension (rank order)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def qkv_errors(model, spec: TinyGPTSpec) -> Dict[str, float]:
    """Layer 0's q, k, v (as Megatron's attention splits them) vs separate dense q/k/v with LoRA.

    Reference: `x Wq^T + s x A^T Bq^T` (and k, v) from the logical W and B split into
    q/k/v by `qkv_mixed_to_separate`; the actual side is what Megatron's
    `get_query_key_value_tensors` hands to attention (heads gathered over TP).
    """
    from megatron_lora_patch.lora.adapters.init import logical_factors
    from megatron_lora_patch.lora.adapters.layouts import qkv_mixed_to_separate
    from megatron_lora_patch.proof.testbed.models import logical_state_dict

    attention = model.decoder.layers[0].self_attention
    seen = {}
    split = attention.get_query_key_value_tensors

    def record_split(*args, **kwargs):
        seen["qkv"] = split(*args, **kwargs)
        return seen["qkv"]

    attention.get_query_key_value_tensors = record_split  # instance attribute: this model only
    hook = attention.linear_qkv.register_forward_hook(
        lambda _m, inputs, output: seen.update(x=inputs[0], out=output[0])
    )
    tokens, positions, mask, _ = batch(spec)
    try:
        with torch.no_grad():
            model(tokens, positions, mask)
    finally:
        hook.remove()
        del attention.get_query_key_value_tensors

    name = "decoder.layers.0.self_attention.linear_qkv"
    weight = logical_state_dict(spec)[name + ".weight"]
    lora_a, lora_b = logical_factors(LORA, name, None, weight.shape[1], weight.shape[0])
    heads, groups, head_dim = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    x = seen["x"]
    separate = zip(
        qkv_mixed_to_separate(weight, heads, groups, head_dim), qkv_mixed_to_separate(lora_b, heads, groups, head_dim)
    )
    references = [x @ w.t() + LORA.scale * (x @ lora_a.t()) @ b.t() for w, b in separate]
    base_q = x @ qkv_mixed_to_separate(weight, heads, groups, head_dim)[0].t()
    errors = {"lora_share_of_q": max_abs_error_over_max(base_q, references[0])}  # must be large: a real delta
    for label, tensor, reference in zip("qkv", seen["qkv"], references):
        errors[label] = max_abs_error_over_max(_gather_last(tensor.flatten(2)), reference)
    mixed = _gather_last(seen["out"]).reshape(-1, weight.shape[0]).t()
    for label, rows, reference in zip("qkv", qkv_mixed_to_separate(mixed, heads, groups, head_dim), references):
        errors["mixed_" + label] = max_abs_error_over_max(rows.t(), reference.reshape(-1, reference.shape[-1]))
    return errors


def merged_error(model, spec: TinyGPTSpec, topology) -> float:
    """Logits of the LoRA model vs a model whose base weights absorbed `W + s B A` (logical layout).

    The merge happens on the world-size-1 tensors and is then sharded like any weight, so
    this checks that every adapter's B rows sit on the base's output rows on every rank
    (mixed QKV, SwiGLU `[gate_shard; up_shard]`) and A's columns on its input columns.
    """
    from megatron_lora_patch.lora.adapters.init import logical_factors
    from megatron_lora_patch.proof.testbed.models import logical_state_dict

    merged = logical_state_dict(spec)
    for name, weight in merged.items():
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in LORA.targets:
            lora_a, lora_b = logical_factors(LORA, module, None, weight.shape[1], weight.shape[0])
            merged[name] = weight + LORA.scale * lora_b @ lora_a
    plain = build(spec, topology, LoraConfig(rank=4, b_init="zero"), state_dict=merged)  # zero B: no delta
    tokens, positions, mask, _ = batch(spec)
    with torch.no_grad():
        actual, expected = (_gather_last(m(tokens, positions, mask)) for m in (model, plain))
    return max_abs_error_over_max(actual, expected)


def adapter_grads(spec: TinyGPTSpec, topology, lora: LoraConfig, **overrides) -> Dict[str, torch.Tensor]:
    """Adapter grads of one forward+backward of the summed LM loss (RNG reseeded first)."""
    from megatron.core import tensor_parallel

    model = build(spec, topology, lora, **overrides)
    model.train()
    tokens, positions, mask, labels = batch(spec)
    torch.manual_seed(99)  # the same dropout masks for every variant
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    torch.autograd.backward(model(tokens, positions, mask, labels=labels).sum())
    return {
        name: param.grad.detach().clone() if param.grad is not None else None
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def recompute_errors(spec: TinyGPTSpec, topology) -> Dict[str, float]:
    """Adapter grads with activation recompute vs without (LoRA dropout on, so masks must replay)."""
    lora = LoraConfig(rank=4, alpha=8.0, b_init="nonzero", seed=3, dropout=0.1)
    reference = adapter_grads(spec, topology, lora)
    errors = {}
    for variant, overrides in RECOMPUTE.items():
        grads = adapter_grads(spec, topology, lora, **overrides)
        assert grads.keys() == reference.keys(), (variant, sorted(grads))
        for name, grad in grads.items():
            errors[f"{variant}:{name}"] = (
                float("inf") if grad is None else max_abs_error_over_max(grad, reference[name])
            )
    return errors


def dropout_masks(spec: TinyGPTSpec, topology, **overrides) -> Dict[str, torch.Tensor]:
    """The LoRA dropout keep-masks drawn in one training forward, by adapter and kind."""
    lora = LoraConfig(
        rank=4, alpha=8.0, b_init="nonzero", seed=3, dropout=0.5, sp_input=overrides.pop("sp_input", "keep")
    )
    model = build(spec, topology, lora, **overrides)
    model.train()
    masks = {}
    for name, adapter in adapters(model).items():
        for kind in ("column_mask", "row_mask"):
            draw = getattr(adapter, kind)

            def record(activation, draw=draw, key=f"{name}:{kind}"):
                masks[key] = draw(activation)
                return masks[key]

            setattr(adapter, kind, record)  # instance attribute: observe the masks of this model only
    tokens, positions, mask, _ = batch(spec)
    model(tokens, positions, mask)
    return masks


def freeze_report(model, *, step: bool) -> Dict[str, object]:
    """Which parameters require grad, sit in Megatron DDP's buffers and in the optimizer.

    With `step`, one forward/backward/optimizer step also reports which parameters changed.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_lora_patch.lora.adapters.metadata import adapter_info

    names = {id(param): name for name, param in model.named_parameters()}
    report = {
        "adapters": sorted(name for name, p in model.named_parameters() if adapter_info(p) is not None),
        "expert_adapters": sorted(
            name for name, p in model.named_parameters() if getattr(adapter_info(p), "expert", False)
        ),
        "requires_grad": sorted(name for name, p in model.named_parameters() if p.requires_grad),
    }
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    report["ddp_dense"] = sorted(names[id(p)] for buffer in ddp.buffers for p in buffer.params)
    report["ddp_expert"] = sorted(names[id(p)] for buffer in ddp.expert_parallel_buffers for p in buffer.params)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32), [ddp])
    report["optimizer"] = sorted(names[id(p)] for group in optimizer.param_groups for p in group["params"])
    if step:
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        tokens, positions, mask, labels = batch(DENSE)
        ddp.zero_grad_buffer()
        torch.autograd.backward(ddp(tokens, positions, mask, labels=labels).sum())
        ddp.finish_grad_sync()
        optimizer.step()
        report["changed"] = sorted(name for name, p in model.named_parameters() if not torch.equal(p, before[name]))
    return report


def bad_config_messages(topology) -> Dict[str, str]:
    """The error each bad LoRA configuration raises while the GPT model is built."""
    from megatron_lora_patch.lora.config import LoraConfigError

    messages = {}
    for label, lora in (
        ("no_match", LoraConfig(targets=("linear_qvk", "fc3"))),
        ("rank_too_large", LoraConfig(rank=65)),
    ):
        try:
            build(DENSE, topology, lora)
        except LoraConfigError as error:
            messages[label] = str(error)
    return messages


def dense_world(rank: int, world: int, topology_spec: str, spec_name: str = "DENSE") -> dict:
    """Every dense-model finding of one rank."""
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_patches()
    spec = globals()[spec_name]
    topology = Topology.parse(topology_spec)
    found: dict = {}
    with topology.world():
        model = build(spec, topology)
        found["adapters"] = adapter_shards(model)
        if topology.tp <= spec.num_query_groups:
            found["qkv"] = qkv_errors(model, spec)
        if spec_name != "DENSE":
            return found
        found["merged"] = merged_error(model, spec, topology)
        found["recompute"] = recompute_errors(spec, topology)
        if topology.tp > 1:
            found["masks"] = dropout_masks(spec, topology)
            found["masks_sp"] = dropout_masks(spec, topology, sequence_parallel=True, sp_input="regather")
        if world == 1:
            found["references"] = {
                name: adapter_shards(build(globals()[name], topology)) for name in ("MOE", "DENSE_TP4")
            }
            found["bad_config"] = bad_config_messages(topology)
        found["freeze"] = freeze_report(model, step=True)
    return found


def moe_world(rank: int, world: int, topology_spec: str) -> dict:
    """MoE findings of one rank: adapter shards (global expert naming) and what DDP / optimizer hold."""
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_patches()
    topology = Topology.parse(topology_spec)
    with topology.world():
        model = build(MOE, topology)
        return {"adapters": adapter_shards(model), "freeze": freeze_report(model, step=topology.pp == 1)}
