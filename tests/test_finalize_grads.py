"""The `finalize_grads` patch and `lora.grad_sync`, on real Megatron layers, DDP, schedule and optimizer over gloo.

The model is a column-parallel -> row-parallel pair of real Megatron layers (frozen) with
hand-tagged LoRA factors in the layouts of docs/architecture.md section 4: column A replicated / B
sharded, row A sharded / B replicated. The reference is the same logical computation on
full tensors in one process (world size 1), so the replicated factors' grads only match
it once their per-rank partial sums are SUMmed over TP.
"""

from __future__ import annotations

import logging

import pytest
import torch
from error_metrics import assert_all_within, fp32_sum_tolerance, relative_l2_error

from megatron_lora_patch.proof.testbed.launcher import run_world

IN, HIDDEN, OUT, RANK_R = 6, 8, 5, 2
SEQ, MICROBATCHES_PER_DP_RANK = 4, 2
MY_PATCHES = ("finalize_grads", "loss_normalization")
REPLICATED, SHARDED = ("a1", "b2"), ("b1", "a2")


def grad_tolerance(dp: int) -> float:
    """Relative L2 allowed against world-1: fp32 reduction-order noise only (tokens x longest dot product).

    Measured at dp=1: <= 2.5e-7 under every kernel/thread variant tried, vs 2.3e-5 allowed; the
    unpatched replicated factors (TP SUM skipped) are >= 0.26 off, 1e4x the tolerance.
    """
    return fp32_sum_tolerance(dp * MICROBATCHES_PER_DP_RANK * SEQ * HIDDEN * max(IN, OUT))


# -- model and reference (imported by test_loss_normalization too) -----------------------------


def logical_tensors(seed: int = 7) -> dict:
    """The full (world-size-1) weights and adapters; B non-zero so every factor gets a grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "w1": (HIDDEN, IN),
        "w2": (OUT, HIDDEN),
        "a1": (RANK_R, IN),
        "b1": (HIDDEN, RANK_R),
        "a2": (RANK_R, HIDDEN),
        "b2": (OUT, RANK_R),
    }
    return {name: torch.randn(shape, generator=g) * 0.5 for name, shape in shapes.items()}


def global_batch(dp: int, seed: int = 11) -> list:
    """`dp * MICROBATCHES_PER_DP_RANK` samples with very different trainable-token counts."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(dp * MICROBATCHES_PER_DP_RANK):
        mask = torch.zeros(SEQ)
        mask[: 1 + (index * 3) % SEQ] = 1.0
        samples.append(
            {"x": torch.randn(SEQ, IN, generator=g), "target": torch.randn(SEQ, OUT, generator=g), "mask": mask}
        )
    return samples


def samples_of_dp_rank(samples: list, dp_rank: int, dp: int) -> list:
    """Megatron's sampler order: microbatch m of DP rank r is global sample m*dp + r (mbs 1)."""
    return [samples[m * dp + dp_rank] for m in range(MICROBATCHES_PER_DP_RANK)]


def per_token_losses(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).sum(-1)


def reference(samples: list, mean_of_means_dp: int = 0) -> dict:
    """World-size-1 grads and loss of the global token mean (or, if asked, DP mean of microbatch means)."""
    t = {name: tensor.clone().requires_grad_(name[0] in "ab") for name, tensor in logical_tensors().items()}
    total, tokens, means = 0.0, 0.0, []
    for sample in samples:
        h = sample["x"] @ t["w1"].T + (sample["x"] @ t["a1"].T) @ t["b1"].T
        y = h @ t["w2"].T + (h @ t["a2"].T) @ t["b2"].T
        losses = per_token_losses(y, sample["target"]) * sample["mask"]
        total = total + losses.sum()
        tokens += float(sample["mask"].sum())
        means.append(losses.sum() / sample["mask"].sum())
    loss = total / tokens if not mean_of_means_dp else sum(means) / len(means)
    loss.backward()
    return {"loss": float(total / tokens), "grads": {name: t[name].grad for name in ("a1", "b1", "a2", "b2")}}


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


@pytest.fixture(scope="module", params=[False, True], ids=["tp2", "tp2-sp"])
def tp2(request):
    return run_world(_tp2_rank, 2, kwargs={"sequence_parallel": request.param}, name=request.node.name)


@pytest.fixture(scope="module")
def tp1_reference():
    return reference(samples_of_dp_rank(global_batch(1), 0, 1))


def test_replicated_factor_grads_match_world1_after_finalize(tp2, tp1_reference):
    assert len(tp2) == 2
    for rank_result in tp2:
        assert_all_within(rank_result["patched"], tp1_reference["grads"], grad_tolerance(dp=1))


def test_without_the_patch_replicated_factor_grads_are_partial(tp2, tp1_reference):
    assert len(tp2) == 2
    expected = tp1_reference["grads"]
    for rank_result in tp2:
        # the replicated factors hold one rank's partial sum: the negative control, >= 100x the tolerance
        partial = {name: relative_l2_error(rank_result["unpatched"][name], expected[name]) for name in REPLICATED}
        assert min(partial.values()) > 100 * grad_tolerance(dp=1), partial
        # sharded factors never needed the extension
        assert_all_within(
            {name: rank_result["unpatched"][name] for name in SHARDED},
            {name: expected[name] for name in SHARDED},
            grad_tolerance(dp=1),
        )


def test_grad_norm_matches_world1(tp2, tp1_reference):
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in tp1_reference["grads"].values())).item()
    for rank_result in tp2:
        assert rank_result["grad_norm"] == pytest.approx(expected, rel=grad_tolerance(dp=1))


def test_one_all_reduce_per_bucket(tp2):
    for rank_result in tp2:
        assert rank_result["buckets"] == 1  # both replicated factors: one (tp group, sum, fp32, cpu) bucket
        mixed = rank_result["mixed_dtype"]
        # fp32 bucket (dense and expert TP: same ranks, other group objects), bf16 bucket reduced in fp32
        assert mixed["expert_tp_is_tp_ranks_other_group"]
        assert mixed["calls"] == [torch.float32, torch.float32]
        summed = 3 * (1 + 1 / 128)
        assert mixed["grads"]["f32"].tolist() == mixed["grads"]["f32b"].tolist() == [summed] * 3
        assert mixed["grads"]["expert"].tolist() == [summed] * 3
        assert mixed["grads"]["bf16"].tolist() == [torch.tensor(summed).to(torch.bfloat16).item()] * 3
        assert mixed["dtypes"]["bf16"] == torch.bfloat16
        assert mixed["grads"]["solo"].tolist() == [(1.0 + rank_result["rank"]) * (1 + 1 / 128)] * 3


def test_unset_finalize_func_is_reported(tp2):
    for rank_result in tp2:
        assert rank_result["missing_finalize"]["warned"]
        assert "finalize_model_grads_func" in rank_result["missing_finalize"]["strict_error"]
