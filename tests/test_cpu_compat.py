"""cpu_compat: exact revert, no effect with CUDA, and each fix is needed (TP2+SP)."""

from __future__ import annotations

import pytest
import torch
from error_metrics import relative_l2_error

from megatron_lora_patch.proof.testbed.launcher import WorldError, run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, logical_shapes
from megatron_lora_patch.proof.testbed.shards import assemble_logical

SPEC = TinyGPTSpec()
ONLY_CPU_COMPAT = {"cpu_compat": True, "lora_linear": False, "finalize_grads": False, "loss_normalization": False}
_PATCHED = {
    "torch.cuda": ("current_device", "synchronize", "Stream", "current_stream", "default_stream", "stream"),
    "megatron.core.tensor_parallel.random": (
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
        "model_parallel_cuda_manual_seed",
    ),
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker": ("add", "fork"),
    "megatron.core.tensor_parallel": ("model_parallel_cuda_manual_seed", "all_to_all"),
    "megatron.core.transformer.torch_norm:WrappedTorchNorm": ("__new__",),
    "megatron.core.transformer.multi_latent_attention": ("build_module",),
    "megatron.core.tensor_parallel.mappings": (
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "all_to_all",
    ),
    "megatron.core.transformer.moe.token_dispatcher": ("all_to_all",),
    "megatron.core.optimizer.clip_grads": ("clip_grad_by_total_norm_fp32",),
    "megatron.core.optimizer.optimizer": ("clip_grad_by_total_norm_fp32",),
    "megatron.core.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller": ("async_loop",),
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync": ("prepare_write_data",),
}
_MISSING = object()


def _snapshot():
    import importlib

    snapshot = {}
    for where, attributes in _PATCHED.items():
        module_name, _, class_name = where.partition(":")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, class_name) if class_name else owner
        for attribute in attributes:
            snapshot[where, attribute] = vars(owner).get(attribute, _MISSING)
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    snapshot["moe_utils", "te_general_gemm"] = vars(moe_utils).get("te_general_gemm", _MISSING)
    snapshot["torch", "function modes"] = len(torch.overrides._get_current_function_mode_stack())
    return snapshot


def apply_revert_round_trip(rank, world_size):
    """Import Megatron, apply, check every target changed, revert, check every target is the original."""
    import megatron.core.optimizer  # noqa: F401  (imports clip_grads and optimizer)
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
    import megatron.core.transformer.torch_norm  # noqa: F401

    import megatron_lora_patch

    before = _snapshot()
    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT, strict=True)
    during = _snapshot()
    on_host = (torch.cuda.current_device(), torch.zeros(1, device="cuda").device, torch.ones(1).cuda().device)
    megatron_lora_patch.revert()
    after = _snapshot()
    # Megatron-Core 0.17+ defines `te_general_gemm = None` itself without TE: nothing to change then
    kept = {("torch", "function modes")} | {key for key in [("moe_utils", "te_general_gemm")] if before[key] is None}
    unchanged_while_applied = [key for key in before if key not in kept and during[key] is before[key]]
    not_restored = [key for key in before if after[key] is not before[key] and after[key] != before[key]]
    return unchanged_while_applied, not_restored, on_host, during[("torch", "function modes")]


def apply_before_import_round_trip(rank, world_size):
    """Apply first, then import Megatron (re-exports copy wrappers), revert: no wrapper may remain."""
    import wrapt

    import megatron_lora_patch

    current_device = torch.cuda.current_device
    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT, strict=True)
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
    import megatron.core.transformer.torch_norm  # noqa: F401

    wrapped_while_applied = sum(isinstance(value, wrapt.FunctionWrapper) for value in _snapshot().values())
    megatron_lora_patch.revert()
    after = _snapshot()
    left_wrapped = [key for key, value in after.items() if isinstance(value, wrapt.FunctionWrapper)]
    return (
        wrapped_while_applied,
        left_wrapped,
        torch.cuda.current_device is current_device,
        after["torch", "function modes"],
    )


def skipped_when_cuda_is_available(rank, world_size):
    import megatron.core.tensor_parallel  # noqa: F401

    import megatron_lora_patch

    torch.cuda.is_available = lambda: True  # this throwaway process pretends to have a GPU
    original = torch.cuda.current_device
    rows = megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT)
    state = next(row.state for row in rows if row.patch == "cpu_compat")
    return state, torch.cuda.current_device is original


def test_revert_restores_every_patched_attribute():
    unchanged, not_restored, on_host, modes = run_world(apply_revert_round_trip, 1, name="tp1")[0]
    assert unchanged == [] and not_restored == []
    assert on_host == (torch.device("cpu"),) * 3 and modes == 1


def test_revert_after_import_while_applied_leaves_no_wrapper():
    wrapped_while_applied, left_wrapped, current_device_restored, modes = run_world(
        apply_before_import_round_trip, 1, name="tp1"
    )[0]
    assert wrapped_while_applied >= 10  # the re-exports copied the wrappers
    assert left_wrapped == [] and current_device_restored and modes == 0


def test_does_nothing_when_cuda_is_available():
    state, current_device_untouched = run_world(skipped_when_cuda_is_available, 1, name="tp1")[0]
    assert state == "skipped" and current_device_untouched


def tp2_sp_grads(rank, world_size, topology_spec, skip_hook=None, strip_norm_tags=False):
    """Logits and finalized grads (Megatron DDP + finalize_model_grads) of a fixed linear loss."""
    import importlib

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_lora_patch.patches import cpu_compat
    from megatron_lora_patch.proof.testbed import models, shards
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.runtime.patching import Patcher

    patcher = Patcher()  # the patch's megatron.core hooks minus `skip_hook`, applied by hand
    for module_name, hook in cpu_compat.SPEC.hooks.items():
        if module_name != skip_hook and module_name.startswith("megatron.core"):
            hook(patcher, importlib.import_module(module_name))
    topology = Topology.parse(topology_spec)
    with topology.world(cpu_compat=False):
        from megatron.core import parallel_state

        model = models.build_model(SPEC, topology)[0]
        if strip_norm_tags:
            for name, parameter in model.named_parameters():
                if name.endswith("layernorm.weight"):
                    del parameter.sequence_parallel
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        generator = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_length), generator=generator)
        positions = torch.arange(SPEC.seq_length).unsqueeze(0).expand(2, -1)
        loss_weights = torch.randn(2, SPEC.seq_length, SPEC.vocab_size, generator=generator)
        logits = ddp(tokens, positions, None)  # vocab-parallel [b, s, V/tp]
        vocab_shard = shards.Shard("logits", 2, parallel_state.get_tensor_model_parallel_rank(), topology.tp)
        (logits * vocab_shard.take(loss_weights)).sum().backward()
        finalize_model_grads([ddp])
        return shards.canonical_items([ddp], select=lambda parameter: parameter.main_grad)


def _grad_errors(rank_items, reference):
    grads = assemble_logical(rank_items, logical_shapes(SPEC))
    assert set(grads) == set(reference) and reference, sorted(grads)
    return {name: relative_l2_error(grads[name], reference[name]) for name in reference}


@pytest.fixture(scope="module")
def world1_grads():
    return assemble_logical(run_world(tp2_sp_grads, 1, args=("tp1",), name="tp1"), logical_shapes(SPEC))


def test_tp2_sp_grads_equal_world1_and_need_the_norm_tag(world1_grads):
    errors = _grad_errors(run_world(tp2_sp_grads, 2, args=("tp2-sp",), name="tp2-sp"), world1_grads)
    assert max(errors.values()) < 1e-5, errors
    untagged = _grad_errors(
        run_world(tp2_sp_grads, 2, args=("tp2-sp",), kwargs={"strip_norm_tags": True}, name="tp2-sp"), world1_grads
    )
    norm_errors = [error for name, error in untagged.items() if name.endswith("layernorm.weight")]
    assert min(norm_errors) > 1e-2, untagged  # each rank kept only its sequence shard's norm grad


def test_tp2_sp_fails_without_the_torch_norm_fix():
    with pytest.raises(WorldError, match="sequence parallel not supported by torch"):
        run_world(
            tp2_sp_grads,
            2,
            args=("tp2-sp",),
            kwargs={"skip_hook": "megatron.core.transformer.torch_norm"},
            name="tp2-sp",
        )


def recompute_allocating_on_cuda(rank: int, world_size: int) -> dict:
    """Megatron's full and selective recompute of a function that allocates on "cuda"."""
    from megatron_lora_patch.proof.testbed.topology import Topology

    with Topology().world():
        from megatron.core.tensor_parallel import random

        def scaled(x):
            return x * torch.full(x.shape, 3.0, device="cuda")

        full = torch.ones(3, requires_grad=True)
        random.checkpoint(scaled, False, full).sum().backward()
        selective = torch.ones(3, requires_grad=True)
        checkpoint = random.CheckpointWithoutOutput(fp8=None)  # as Megatron passes config.fp8 (None)
        output = checkpoint.checkpoint(scaled, selective)
        total = (output * 2).sum()
        checkpoint.discard_output_and_register_recompute(total)
        total.backward()
        return {"full": full.grad.tolist(), "selective": selective.grad.tolist()}


def test_activation_recompute_runs_on_the_host():
    """Recompute happens inside backward, where torch pops function modes: the device
    mapping must still apply there (full and selective recompute)."""
    grads = run_world(recompute_allocating_on_cuda, 1, name="tp1")[0]
    assert grads == {"full": [3.0] * 3, "selective": [6.0] * 3}


def test_type_queries_name_the_cuda_type_while_mapped():
    """Megatron's Float16 optimizer accepts only CUDA type names; the host plays that device."""
    from megatron_lora_patch.cpu_testbed.host_device import HostDeviceMode

    with HostDeviceMode():
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1).type(torch.int64).dtype == torch.int64  # conversions are untouched
    assert torch.zeros(1).type() == "torch.FloatTensor"
