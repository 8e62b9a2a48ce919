"""LoRA under the options Megatron-LM turns on for GPU runs, on the CPU testbed: `gradient_accumulation_fusion`
and DDP's `overlap_grad_reduce` / `overlap_param_gather` (the GPU-only failure classes CPU can run).

- `gradient_accumulation_fusion`, through `cpu_testbed`'s stand-in of APEX's fused weight-grad kernel (checked
  against the kernel's definition below): the output layer, trained fully beside the adapters
  (`modules_to_save`), gets its weight grad added straight into DDP's `main_grad` on every microbatch, while the
  adapters' grads come through autograd's `.grad` into the same buffers. Another Megatron LoRA project lost its
  adapters' grad sync on this path.
- `overlap_grad_reduce` with small buckets (several reductions start inside backward), on DP2 with the fused
  kernel, and `overlap_param_gather` with the distributed optimizer (the next forward's pre-hooks gather the
  updated params).

Every run is compared with the world-size-1 run with none of these options, on the oracle's phases and
thresholds. The ranks also report that the fused path ran (weights marked `grad_added_to_main_grad`) and that
DDP had several buckets, so a run that silently fell back to the plain path fails. Negative controls: a kernel
that overwrites `main_grad` instead of adding to it (the last microbatch's grad survives), and the oracle's
`local_token_normalization` mutation under overlap; each must exceed its threshold by 100x.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from megatron_lora_patch.cpu_testbed import fused_wgrad
from megatron_lora_patch.proof.oracle.harness import OracleSettings, make_job
from megatron_lora_patch.proof.oracle.mutations import MUTATIONS
from megatron_lora_patch.proof.oracle.phases import adapter_shapes, canonical_phases, compare
from megatron_lora_patch.proof.testbed.runner import run_jobs
from megatron_lora_patch.proof.testbed.topology import Topology

SETTINGS = OracleSettings(lora_options=(("modules_to_save", ("output_layer",)),))
FUSED = {"model_config": {"gradient_accumulation_fusion": True}}
#: Params per DDP bucket: the trainable params of the oracle's dense model (the output layer's 8192 and the
#: adapters) fill several buckets.
OVERLAP = {"overlap_grad_reduce": True, "ddp_bucket_size": 4096}
GATHER = {"use_distributed_optimizer": True, "overlap_param_gather": True}
#: A broken mechanism must exceed the threshold by this factor to count as detected.
DETECTION_FACTOR = 100


# ------------------------------------------------------------------ the stand-in against the kernel's definition


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stand_in_adds_the_weight_grad_gemm_into_main_grad(dtype):
    generator = torch.Generator().manual_seed(0)
    total_input = torch.randn(12, 5, generator=generator).to(dtype)
    grad_output = torch.randn(12, 3, generator=generator).to(dtype)
    main_grad = torch.randn(3, 5, generator=generator).to(dtype)
    expected = main_grad.float() + grad_output.float().t() @ total_input.float()
    kernel = fused_wgrad.wgrad_gemm_accum_fp32 if dtype == torch.float32 else fused_wgrad.wgrad_gemm_accum_fp16
    storage = main_grad.data_ptr()
    kernel(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == storage  # in place, as the kernel writes DDP's buffer
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(main_grad.float(), expected, rtol=tolerance, atol=tolerance)


def test_stand_in_refuses_what_the_kernel_refuses():
    with pytest.raises(TypeError, match="fp32 main_grad"):
        fused_wgrad.wgrad_gemm_accum_fp32(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bf16 / fp16"):
        fused_wgrad.wgrad_gemm_accum_fp16(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"\[tokens, in\]"):
        fused_wgrad.wgrad_gemm_accum_fp32(torch.ones(2, 2), torch.ones(3, 2), torch.ones(2, 2))


def test_stand_in_is_installed_only_where_the_kernel_is_missing():
    from megatron_lora_patch.runtime.patching import Patcher

    class Layers:
        _grad_accum_fusion_available = False

    patcher = Patcher()
    fused_wgrad.install(patcher, Layers)
    assert Layers._grad_accum_fusion_available and Layers.fused_weight_gradient_mlp_cuda is fused_wgrad.KERNEL_MODULE
    patcher.revert()
    assert not Layers._grad_accum_fusion_available and not hasattr(Layers, "fused_weight_gradient_mlp_cuda")
    Layers._grad_accum_fusion_available = True  # a machine with APEX: its kernel stays
    fused_wgrad.install(patcher, Layers)
    assert not hasattr(Layers, "fused_weight_gradient_mlp_cuda") and not patcher.changes


# ------------------------------------------------------------------ adapters in DDP's overlapped param gather


def test_a_linear_call_fires_its_adapters_pre_hooks_as_calling_them_would():
    from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME
    from megatron_lora_patch.lora.training.param_sync import hook_linear

    linear, adapter, fired = torch.nn.Linear(2, 2), torch.nn.Module(), []
    linear.add_module(ADAPTER_NAME, adapter)
    hook_linear(linear)
    hook_linear(linear)  # attaching again adds no second hook
    early = adapter.register_forward_pre_hook(lambda module, args: fired.append(("plain", module, args)))
    adapter.register_forward_pre_hook(lambda module, args, kwargs: fired.append(("kwargs", module, args, kwargs)),
                                      with_kwargs=True)  # registered after hook_linear, like DDP's
    linear(torch.ones(1, 2))
    assert fired == [("plain", adapter, ()), ("kwargs", adapter, (), {})]
    early.remove()  # DDP's disable_forward_pre_hook: a removed hook no longer fires
    del linear._modules[ADAPTER_NAME]  # a merged layer keeps its hook, with nothing to fire
    linear(torch.ones(1, 2))
    assert len(fired) == 2


def _config_model(**fields) -> torch.nn.Module:
    model = torch.nn.Module()
    model.config = type("Config", (), fields)()
    return model


@pytest.mark.parametrize("fields,named", [
    ({"cuda_graph_impl": "local"}, "cuda_graph_impl 'local'"),
    ({"cuda_graph_impl": "none", "enable_cuda_graph": True}, "enable_cuda_graph"),
    ({"external_cuda_graph": True}, "external_cuda_graph"),
])
def test_cuda_graphs_are_refused_with_one_line(fields, named):
    from megatron_lora_patch.lora.layers.unsupported import UnsupportedModelError, refuse_unsupported

    with pytest.raises(UnsupportedModelError) as refused:
        refuse_unsupported(_config_model(**fields), [])
    assert str(refused.value) == (
        f"LoRA is not supported with CUDA graphs ({named}); set --cuda-graph-impl none (and leave out "
        "--enable-cuda-graph / --external-cuda-graph)"
    )
    refuse_unsupported(_config_model(cuda_graph_impl="none"), [])


def test_shared_expert_overlap_warns_once_naming_the_preflight(caplog):
    from megatron_lora_patch.lora.layers.unsupported import refuse_unsupported

    with caplog.at_level("WARNING"):
        refuse_unsupported(_config_model(moe_shared_expert_overlap=True), [])
        refuse_unsupported(_config_model(moe_shared_expert_overlap=True), [])
    warnings = [record.getMessage() for record in caplog.records if "moe-shared-expert-overlap" in
                record.getMessage()]
    assert warnings == [
        "megatron-lora-patch: LoRA with --moe-shared-expert-overlap has not run on a GPU here; check it on your "
        "nodes with `megatron-lora-patch preflight -- <your pretrain_gpt.py args>`"
    ]


# ------------------------------------------------------------------ training runs against world size 1


def _overwrite_main_grad(total_input, grad_output, main_grad) -> None:
    """The control's kernel: writes the microbatch's weight grad over `main_grad` instead of adding it."""
    main_grad.copy_(grad_output.t().to(main_grad.dtype) @ total_input.to(main_grad.dtype))


@contextlib.contextmanager
def _overwriting_kernel(job_context):
    """`Job.context`: the oracle's context, with the stand-in kernel overwriting instead of accumulating."""
    with job_context():
        original = fused_wgrad.KERNEL_MODULE.wgrad_gemm_accum_fp32
        fused_wgrad.KERNEL_MODULE.wgrad_gemm_accum_fp32 = _overwrite_main_grad
        try:
            yield
        finally:
            fused_wgrad.KERNEL_MODULE.wgrad_gemm_accum_fp32 = original


def _observe(oracle_step_end, step: int, record: dict, chunks: list) -> None:
    """`Capture.on_step_end`: the oracle's record, plus what the rank's DDP and fused kernel did."""
    oracle_step_end(step, record, chunks)
    params = [param for chunk in chunks for param in chunk.parameters()]
    record["extra"]["fused_weights"] = sum(bool(getattr(param, "grad_added_to_main_grad", False)) for param in params)
    record["extra"]["buckets"] = sum(len(group.buckets) for chunk in chunks for group in chunk.bucket_groups)


def _job(topology: str, options: dict, mutation=None, overwrite: bool = False):
    job = make_job(Topology.parse(topology), SETTINGS, mutation)
    capture = dataclasses.replace(job.settings.capture, on_step_end=functools.partial(
        _observe, job.settings.capture.on_step_end))
    job = dataclasses.replace(job, settings=dataclasses.replace(job.settings, capture=capture, **options))
    return dataclasses.replace(job, context=functools.partial(_overwriting_kernel, job.context)) if overwrite else job


RUNS = {
    "tp2-sp fused wgrad": _job("tp2-sp", FUSED),
    "dp2 overlap fused wgrad": _job("dp2", {**FUSED, **OVERLAP}),
    "dp2 distributed optimizer overlap grads + params, fused wgrad": _job("dp2", {**FUSED, **OVERLAP, **GATHER}),
}
CONTROLS = {
    "tp2-sp kernel overwriting main_grad": _job("tp2-sp", FUSED, overwrite=True),
    "dp2 overlap, local token normalization": _job(
        "dp2", {**FUSED, **OVERLAP}, MUTATIONS["local_token_normalization"]
    ),
}


@pytest.fixture(scope="module")
def compared() -> dict:
    """name -> (phase metrics against world 1, the ranks' records); one launch per world size."""
    reference = _job("tp1", {})
    jobs = {"reference": reference, **RUNS, **CONTROLS}
    records = dict(zip(jobs, run_jobs(list(jobs.values()))))
    shapes = adapter_shapes(records["reference"])
    expected = canonical_phases(records["reference"], reference.spec, shapes)
    return {
        name: (compare(canonical_phases(records[name], job.spec, shapes), expected, SETTINGS), records[name])
        for name, job in jobs.items()
        if name != "reference"
    }


@pytest.mark.parametrize("name", RUNS)
def test_run_matches_world1(compared, name):
    phases, records = compared[name]
    failed = {phase: f"{metrics.rel_l2:.2e} > {metrics.threshold:.0e} ({metrics.worst_tensor})"
              for phase, metrics in phases.items() if not metrics.passed}
    assert not failed, f"{name}: {failed}"
    assert {"forward", "loss", "grads", "grad_norm", "deltas"} <= set(phases), sorted(phases)
    extra = [record["steps"][-1]["extra"] for record in records]
    assert all(entry["fused_weights"] >= 1 for entry in extra), f"{name}: the fused weight-grad path never ran"
    if "overlap" in name:
        assert all(entry["buckets"] >= 3 for entry in extra), f"{name}: DDP had under 3 buckets: {extra}"


@pytest.mark.parametrize("name", CONTROLS)
def test_control_is_detected(compared, name):
    phases, _ = compared[name]
    worst = max(metrics.ratio for metrics in phases.values())
    assert worst > DETECTION_FACTOR, f"{name}: worst phase only {worst:.1f}x its threshold"
