"""cpu_compat: run Megatron-Core (local spec, dense and MoE) on CPU with gloo.

The one patch of the `cpu_testbed` plugin (`compat.plugin`), never of the production
`lora_correct`: on by default once that plugin is loaded (the testing helpers and the oracle
load it when CUDA is unavailable).
It only relocates devices, backs the CUDA RNG tracker with the CPU generator, replaces
gloo-incompatible collectives by equivalents that move the same values, and lets the
torch norm run under sequence parallel with the correct param tag: numerics are those
Megatron computes. With CUDA available every hook is a no-op unless
`MEGATRON_LORA_CPU_COMPAT_FORCE=1`.

One hook per Megatron module it fixes:

- `megatron.core`: `torch.cuda.current_device`/`synchronize`/streams and a
  TorchFunctionMode for `device="cuda"` / `.cuda()` (compat.host_device; global while
  applied, because the call sites are in ~40 modules).
- `tensor_parallel.random`: tracker add/fork and seeding on the CPU generator; activation
  recompute (which runs inside backward, where torch pops function modes) under the host mapping.
- `transformer.torch_norm`: `WrappedTorchNorm` under SP, params tagged `sequence_parallel`.
- `tensor_parallel.mappings`: uneven all_gather / list reduce_scatter / list all-to-all splits.
- `transformer.moe.moe_utils`: `te_general_gemm` defined as None without TE.
- `transformer.moe.token_dispatcher`: the class-level DtoH stream it creates is reset on revert.
- `optimizer.clip_grads`: no `torch.cuda.FloatTensor` assertion.
- `megatron.training.*` (Megatron-LM's loop, S1-S6 of issue 15) and the wheel's dataset
  helpers: compat.training. The host's CUDA generator is its own (compat.device_rng, S7).
"""

from __future__ import annotations

from megatron_lora_patch.patching import PatchSpec


def _only_on_host(fix):
    """Run `fix(patcher, module)` only when the host has no CUDA (or the fix is forced)."""

    def hook(patcher, module):
        from megatron_lora_patch.compat import FORCE_FLAG, host_is_cpu
        from megatron_lora_patch.runtime import SkipPatch

        if not host_is_cpu():
            raise SkipPatch(f"CUDA is available, nothing to fix (set {FORCE_FLAG}=1 to force)")
        fix(patcher, module)

    hook.__name__ = fix.__name__
    hook.__doc__ = fix.__doc__
    return hook


@_only_on_host
def relocate_cuda_device(patcher, module):
    """torch.cuda current device / streams / synchronize and `device="cuda"` mean the CPU."""
    from megatron_lora_patch.compat import host_device

    host_device.install(patcher)


@_only_on_host
def host_rng_tracker(patcher, module):
    """CUDA RNG tracker states are CPU generator states; recompute runs under the host mapping."""
    from megatron_lora_patch.compat import host_device, rng

    rng.install(patcher, module)
    host_device.install_recompute(patcher, module)


@_only_on_host
def torch_norm_sequence_parallel(patcher, module):
    """WrappedTorchNorm accepts SP and tags its params `sequence_parallel`."""
    from megatron_lora_patch.compat import modules

    modules.install_torch_norm(patcher, module)


@_only_on_host
def gloo_collectives(patcher, module):
    """Uneven gathers, list reduce-scatters and all-to-all splits in gloo-supported forms."""
    from megatron_lora_patch.compat import collectives

    collectives.install(patcher, module)


@_only_on_host
def moe_utils_without_te(patcher, module):
    """`te_general_gemm` is None when Transformer Engine is absent."""
    from megatron_lora_patch.compat import modules

    modules.install_moe_utils(patcher, module)


@_only_on_host
def dispatcher_host_stream(patcher, module):
    """Forget the class-level DtoH stream (a host stream while patched) on revert.

    0.15+ create `MoEAlltoAllTokenDispatcher.cuda_dtoh_stream` once per class; recording
    its current value makes revert restore it, so no host stream outlives the patch.
    """
    dispatcher = module.MoEAlltoAllTokenDispatcher
    if "cuda_dtoh_stream" in vars(dispatcher):
        patcher.replace(dispatcher, "cuda_dtoh_stream", vars(dispatcher)["cuda_dtoh_stream"])


@_only_on_host
def clip_grads_on_host(patcher, module):
    """clip_grad_by_total_norm_fp32 recognizes fp32 grads by dtype, not CUDA type name."""
    from megatron_lora_patch.compat import modules

    modules.install_clip_grads(patcher, module)


@_only_on_host
def training_initialize(patcher, module):
    """Megatron-LM's `initialize_megatron` without CUDA; model parallelism and seeds as on one device."""
    from megatron_lora_patch.compat import training

    training.install_initialize(patcher, module)


@_only_on_host
def training_arguments(patcher, module):
    """`get_device_arch_version()` in argument validation answers for the host."""
    from megatron_lora_patch.compat import training

    training.install_arguments(patcher, module)


@_only_on_host
def legacy_fused_kernels(patcher, module):
    """Megatron-LM checkouts: no CUDA kernels to build."""
    from megatron_lora_patch.compat import training

    training.install_fused_kernels(patcher, module)


@_only_on_host
def prebuilt_dataset_helpers(patcher, module):
    """`compile_helpers()` skips `make` when the wheel's compiled helpers import."""
    from megatron_lora_patch.compat import training

    training.install_dataset_helpers(patcher, module)


SPEC = PatchSpec(
    name="cpu_compat",
    summary="run Megatron-Core on CPU + gloo with unchanged numerics (testing)",
    hooks={
        "megatron.core": relocate_cuda_device,
        "megatron.core.tensor_parallel.random": host_rng_tracker,
        "megatron.core.transformer.torch_norm": torch_norm_sequence_parallel,
        "megatron.core.tensor_parallel.mappings": gloo_collectives,
        "megatron.core.transformer.moe.moe_utils": moe_utils_without_te,
        "megatron.core.transformer.moe.token_dispatcher": dispatcher_host_stream,
        "megatron.core.optimizer.clip_grads": clip_grads_on_host,
        "megatron.core.datasets.utils": prebuilt_dataset_helpers,
        "megatron.training.initialize": training_initialize,
        "megatron.training.arguments": training_arguments,
        "megatron.legacy.fused_kernels": legacy_fused_kernels,
    },
    versions=">=0.13,<0.20",
    default=True,
)
