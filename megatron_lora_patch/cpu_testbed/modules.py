"""Fixes for single Megatron modules that refuse to run without CUDA, TE or Apex."""

from __future__ import annotations

import copy


def torch_norm_with_sequence_parallel(wrapped, instance, args, kwargs):
    """`WrappedTorchNorm.__new__(cls, config, hidden_size, ...)` accepting sequence parallel.

    Upstream asserts `not config.sequence_parallel`. The torch norm computes the same
    per-token function either way; what SP needs is the `sequence_parallel` tag on its
    parameters, so `finalize_model_grads` all-reduces their grads over TP (each rank saw
    only its sequence shard), exactly as `FusedLayerNorm` tags its own.
    """

    def new(cls, config, *rest, **options):
        if not config.sequence_parallel:
            return wrapped(cls, config, *rest, **options)
        config_without_sp = copy.copy(config)  # shallow: no __post_init__, config untouched
        config_without_sp.sequence_parallel = False
        norm = wrapped(cls, config_without_sp, *rest, **options)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel
        return norm

    return new(*args, **kwargs)


def clip_grads_on_host(clip_grads_module):
    """`clip_grad_by_total_norm_fp32` without its `torch.cuda.FloatTensor` assertion.

    Same grads, same coefficient, same `multi_tensor_applier` scale call as upstream;
    the only change is that fp32 grads are recognized by dtype instead of CUDA type name.
    """
    import torch

    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attribute = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = []
        for parameter in parameters:
            grad = getattr(parameter, attribute, None)
            if grad is None:
                continue
            allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
            if grad.dtype not in allowed:
                raise TypeError(f"clip_grad_by_total_norm_fp32 expects fp32 grads, got {grad.dtype}")
            grads.append(clip_grads_module.to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            overflow_buffer = torch.zeros(1, dtype=torch.int)
            clip_grads_module.multi_tensor_applier(
                clip_grads_module.multi_tensor_scale_impl, overflow_buffer, [grads, grads], clip_coeff
            )

    def clip_grads_without_cuda_type_check(wrapped, instance, args, kwargs):
        return clip(*args, **kwargs)

    return clip_grads_without_cuda_type_check


def install_torch_norm(patcher, torch_norm_module) -> None:
    patcher.wrap(torch_norm_module.WrappedTorchNorm, "__new__", torch_norm_with_sequence_parallel)


def install_moe_utils(patcher, moe_utils_module) -> None:
    """Without TE, `moe_utils` never defines `te_general_gemm` but reads it (NameError)."""
    if not hasattr(moe_utils_module, "te_general_gemm"):
        patcher.replace(moe_utils_module, "te_general_gemm", None)


def install_clip_grads(patcher, clip_grads_module) -> None:
    patcher.wrap(
        clip_grads_module,
        "clip_grad_by_total_norm_fp32",
        clip_grads_on_host(clip_grads_module),
        reexported_by=("megatron.core.optimizer.optimizer",),
    )


def install_host_device(patcher, megatron_core) -> None:
    """torch.cuda current device / streams / synchronize and `device="cuda"` mean the CPU."""
    from megatron_lora_patch.cpu_testbed import host_device

    host_device.install(patcher)


def install_host_rng(patcher, random_module) -> None:
    """CUDA RNG tracker states are CPU generator states; recompute runs under the host mapping."""
    from megatron_lora_patch.cpu_testbed import host_device, rng

    rng.install(patcher, random_module)
    host_device.install_recompute(patcher, random_module)


def install_dispatcher_stream(patcher, token_dispatcher_module) -> None:
    """Forget the class-level DtoH stream (a host stream while patched) on revert.

    0.15+ create `MoEAlltoAllTokenDispatcher.cuda_dtoh_stream` once per class; recording
    its current value makes revert restore it, so no host stream outlives the patch.
    """
    dispatcher = token_dispatcher_module.MoEAlltoAllTokenDispatcher
    if "cuda_dtoh_stream" in vars(dispatcher):
        patcher.replace(dispatcher, "cuda_dtoh_stream", vars(dispatcher)["cuda_dtoh_stream"])
