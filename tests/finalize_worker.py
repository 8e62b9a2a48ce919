"""The rank side of tests/test_finalize_grads.py: a column-parallel -> row-parallel pair of real Megatron
layers with hand-tagged LoRA factors (docs/architecture.md section 4), its world-size-1 reference on full
tensors, and what each rank measures (grads with and without the patch, grad norm, all-reduce count,
mixed-dtype buckets, the missing-finalize report)."""

from __future__ import annotations

import logging

import torch
from finalize_reference import (
    HIDDEN,
    IN,
    OUT,
    SEQ,
    global_batch,
    logical_tensors,
    per_token_losses,
    samples_of_dp_rank,
)


class TinyLoRAPair(torch.nn.Module):
    """ColumnParallelLinear -> RowParallelLinear (frozen) with tagged LoRA factors."""

    def __init__(self, config, logical: dict):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        from megatron_lora_patch.lora.adapters.metadata import AdapterParamInfo, tag

        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp, rank = tp_group.size(), tp_group.rank()
        init = torch.nn.init.zeros_
        self.col = ColumnParallelLinear(IN, HIDDEN, config=config, init_method=init, bias=False, gather_output=False)
        self.row = RowParallelLinear(
            HIDDEN, OUT, config=config, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True
        )
        shard = slice(rank * HIDDEN // tp, (rank + 1) * HIDDEN // tp)
        with torch.no_grad():
            self.col.weight.copy_(logical["w1"][shard])
            self.row.weight.copy_(logical["w2"][:, shard])
        self.col.weight.requires_grad_(False)
        self.row.weight.requires_grad_(False)
        self.a1 = torch.nn.Parameter(logical["a1"].clone())
        self.b1 = torch.nn.Parameter(logical["b1"][shard].clone())
        self.a2 = torch.nn.Parameter(logical["a2"][:, shard].clone())
        self.b2 = torch.nn.Parameter(logical["b2"].clone())
        for name, module, factor, replicated, dim in (
            ("a1", "col", "A", True, None),
            ("b1", "col", "B", False, 0),
            ("a2", "row", "A", False, 1),
            ("b2", "row", "B", True, None),
        ):
            param = getattr(self, name)
            tag(
                param,
                AdapterParamInfo(
                    module=module, factor=factor, replicated=replicated, domain="tp", group=tp_group, expert=False
                ),
            )
            if not replicated:  # Megatron's grad-norm attributes for sharded factors only
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
        self.model_type = ModelType.encoder_or_decoder
        self.config = config

    def set_input_tensor(self, tensor) -> None:
        """Single pipeline stage: nothing comes from a previous stage."""

    def forward(self, x):
        """x: [S, IN] full sequence; under SP it is scattered like an embedding output and the
        output gathered like GPT's output layer (each TP rank then holds the same full loss)."""
        from megatron.core import tensor_parallel as mappings

        sp = self.config.sequence_parallel
        x = mappings.scatter_to_sequence_parallel_region(x.unsqueeze(1)) if sp else x.unsqueeze(1)
        h, _ = self.col(x)
        lora_in = (
            mappings.gather_from_sequence_parallel_region(x) if sp else mappings.copy_to_tensor_model_parallel_region(x)
        )
        h = h + (lora_in @ self.a1.T) @ self.b1.T
        y, _ = self.row(h)
        lora_out = (h @ self.a2.T) @ self.b2.T
        y = y + (
            mappings.reduce_scatter_to_sequence_parallel_region(lora_out)
            if sp
            else mappings.reduce_from_tensor_model_parallel_region(lora_out)
        )
        if sp:
            y = mappings.gather_from_sequence_parallel_region(y, tensor_parallel_output_grad=False)
        return y.squeeze(1)


def apply_patches(finalize: bool, loss: bool, strict: bool = False) -> None:
    """Only cpu_compat and the patches under test: the real LoRA layers stay out of this model."""
    from megatron_lora_patch.proof.testbed.patches import apply_only

    wanted = {"cpu_compat": True, "finalize_grads": finalize, "loss_normalization": loss}
    apply_only([name for name, on in wanted.items() if on], strict=strict)


def build_ddp_model(tp: int, sequence_parallel: bool = False):
    """TransformerConfig -> tiny model -> Megatron DDP, finalize bound like Megatron-LM's setup."""
    import megatron.core.distributed as distributed
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    module = TinyLoRAPair(config, logical_tensors())
    ddp_config = distributed.DistributedDataParallelConfig(average_in_collective=True)
    model = distributed.DistributedDataParallel(config, ddp_config, module)
    config.finalize_model_grads_func = distributed.finalize_model_grads
    return model, config


def sum_loss_func(mask, y):
    losses = per_token_losses(y.float(), TARGETS.pop(0)) * mask
    num_tokens = mask.sum().to(torch.int)
    return losses.sum(), num_tokens, {"lm loss": torch.stack([losses.sum().detach(), mask.sum()])}


def mean_loss_func(mask, y):
    losses = per_token_losses(y.float(), TARGETS.pop(0)) * mask
    return losses.sum() / mask.sum(), {"lm loss": (losses.sum() / mask.sum()).detach().view(1)}


TARGETS: list = []


def train_step(model, samples: list, loss_func=sum_loss_func) -> dict:
    """One Megatron training step (zero grads, schedule with finalize); grads and the reduced report."""
    import functools

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    TARGETS[:] = [sample["target"] for sample in samples]
    batches = iter(samples)

    def forward_step(data_iterator, model_chunk):
        sample = next(data_iterator)
        return model_chunk(sample["x"]), functools.partial(loss_func, sample["mask"])

    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=len(samples),
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    summed = torch.stack([report["lm loss"] for report in reports]).sum(0)
    torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    grads = {name: param.main_grad.clone() for name, param in model.module.named_parameters() if param.requires_grad}
    return {"grads": grads, "report": summed}


def gather_logical(grads: dict) -> dict:
    """Full logical grads from this rank's TP shards (replicated factors taken as they are)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, dim in (("a1", None), ("b1", 0), ("a2", 1), ("b2", None)):
        if dim is None:
            full[name] = grads[name]
        else:
            parts = [torch.empty_like(grads[name]) for _ in range(group.size())]
            torch.distributed.all_gather(parts, grads[name].contiguous(), group=group)
            full[name] = torch.cat(parts, dim)
    return full


# -- TP2 world -----------------------------------------------------------------------------------


def _tp2_rank(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_patches(finalize=True, loss=True)
    # Expert TP 2 as well: the expert-TP group is then a distinct group over the TP ranks (mixed_dtype_buckets).
    topology = Topology.parse("tp2-etp2-sp" if sequence_parallel else "tp2-etp2")
    with topology.world(cpu_compat=False):
        samples = samples_of_dp_rank(global_batch(1), 0, 1)
        model, config = build_ddp_model(tp=2, sequence_parallel=sequence_parallel)
        patched = train_step(model, samples)
        result = {
            "rank": rank,
            "patched": gather_logical(patched["grads"]),
            "report": patched["report"],
            "grad_norm": grad_norm_of(model, config),
        }
        result["buckets"] = count_extension_all_reduces(model)
        result["mixed_dtype"] = mixed_dtype_buckets()
        apply_patches(finalize=False, loss=True)
        model, config = build_ddp_model(tp=2, sequence_parallel=sequence_parallel)
        result["unpatched"] = gather_logical(train_step(model, samples)["grads"])
        result["missing_finalize"] = missing_finalize_reports(model, config, samples)
    return result


def grad_norm_of(model, config) -> float:
    """Megatron's optimizer grad norm (get_grad_norm_fp32 over the duplicate-filtered main grads)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, bf16=False, fp16=False), [model])
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def count_extension_all_reduces(model) -> int:
    """all_reduce calls of one extension pass (the step's grads are recorded already)."""
    from megatron_lora_patch.lora.training.grad_sync import sum_replicated_adapter_grads

    calls = []
    original = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        returned = sum_replicated_adapter_grads([model])
    finally:
        torch.distributed.all_reduce = original
    assert returned == len(calls), (returned, calls)
    return len(calls)


def mixed_dtype_buckets() -> dict:
    """Plain `.grad` params: fp32 and bf16 replicated on TP (2 buckets), one on a size-1 group (skipped),
    and an expert factor on the expert-TP group: a distinct group object over the TP ranks (ETP = TP,
    EP = 1), so it joins the fp32 TP bucket (one all-reduce per distinct ranks, not per group object)."""
    from megatron.core import parallel_state

    from megatron_lora_patch.lora.adapters.metadata import AdapterParamInfo, tag
    from megatron_lora_patch.lora.training.grad_sync import sum_replicated_adapter_grads

    tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group()
    single = parallel_state.get_data_parallel_group()  # size 1 in a TP2 world: must be skipped
    rank = torch.distributed.get_rank()
    module = torch.nn.Module()
    specs = {
        "f32": (torch.float32, tp_group),
        "f32b": (torch.float32, tp_group),
        "bf16": (torch.bfloat16, tp_group),
        "solo": (torch.float32, single),
        "expert": (torch.float32, expert_tp_group),
    }
    for name, (dtype, group) in specs.items():
        param = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
        param.grad = torch.full((3,), (1.0 + rank) * (1 + 1 / 128), dtype=dtype)  # exact in bf16 and fp32
        expert = group is expert_tp_group
        tag(
            param,
            AdapterParamInfo(
                module=name,
                factor="A",
                replicated=True,
                domain="expert_tp" if expert else "tp",
                group=group,
                expert=expert,
            ),
        )
        module.register_parameter(name, param)
    calls = []
    original = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: calls.append(a[0].dtype) or original(*a, **k)
    try:
        sum_replicated_adapter_grads([module])
    finally:
        torch.distributed.all_reduce = original
    same_ranks = torch.distributed.get_process_group_ranks(
        expert_tp_group
    ) == torch.distributed.get_process_group_ranks(tp_group)
    return {
        "calls": calls,
        "grads": {name: p.grad.float() for name, p in module.named_parameters()},
        "expert_tp_is_tp_ranks_other_group": same_ranks and expert_tp_group is not tp_group,
        "dtypes": {name: p.grad.dtype for name, p in module.named_parameters()},
    }


def missing_finalize_reports(model, config, samples) -> dict:
    """SkyRL #223: finalize_model_grads_func None reaches the optimizer -> warning, or error in strict mode."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    apply_patches(finalize=True, loss=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, bf16=False, fp16=False), [model])
    config.finalize_model_grads_func = None
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_lora_patch").addHandler(handler)
    train_step(model, samples)
    optimizer.prepare_grads()
    warned = any("SkyRL #223" in record.getMessage() for record in records)
    apply_patches(finalize=True, loss=True, strict=True)
    try:
        train_step(model, samples)
        optimizer.prepare_grads()
        strict_error = None
    except RuntimeError as error:
        strict_error = str(error)
    finally:
        apply_patches(finalize=True, loss=True, strict=False)
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    train_step(model, samples)
    optimizer.prepare_grads()  # a finalized step passes silently
    return {"warned": warned, "strict_error": strict_error}
