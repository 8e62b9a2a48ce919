"""A CPU stand-in for APEX's `fused_weight_gradient_mlp_cuda` (Megatron's `gradient_accumulation_fusion`).

With `gradient_accumulation_fusion` on (Megatron-LM's default), a trainable parallel linear's
backward does not return a weight grad: `LinearWithGradAccumulationAndAsyncCommunication` calls
the fused kernel, which adds the weight grad straight into the `main_grad` buffer DDP gave the
weight, and marks the weight `grad_added_to_main_grad` so DDP's hook adds nothing on top. It is
the path on which another Megatron LoRA project lost its adapters' grad sync (their grads never
reached the buffer their sync read). Megatron-Core imports the kernel module at import time and
refuses the flag without it, so on CPU the flag could never be on.

The stand-in is the kernel's definition (APEX `csrc/megatron/fused_weight_gradient_dense.cpp`:
one GEMM with beta = 1 into the output): for `input` `[tokens, in]`, `d_output` `[tokens, out]`
and `d_weight` `[out, in]`, `d_weight += d_output^T input`, in place, in `d_weight`'s dtype
(`wgrad_gemm_accum_fp16` takes a bf16 / fp16 `d_weight`, the product computed in that dtype as
the kernel's GEMM does). `tests/test_fused_wgrad_stand_in.py` checks it against that definition.
"""

from __future__ import annotations

import types

import torch


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    if total_input.dim() != 2 or grad_output.dim() != 2 or total_input.shape[0] != grad_output.shape[0]:
        raise ValueError(
            f"fused wgrad stand-in: input {tuple(total_input.shape)} and d_output {tuple(grad_output.shape)} "
            "must be [tokens, in] and [tokens, out]"
        )
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """`main_grad += grad_output^T total_input` into an fp32 `main_grad`."""
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 needs an fp32 main_grad, got {main_grad.dtype}")
    _accumulate(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """`main_grad += grad_output^T total_input` into a bf16 / fp16 `main_grad`."""
    if main_grad.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"wgrad_gemm_accum_fp16 needs a bf16 / fp16 main_grad, got {main_grad.dtype}")
    _accumulate(total_input, grad_output, main_grad)


#: What Megatron-Core's `tensor_parallel.layers` finds as `fused_weight_gradient_mlp_cuda` on CPU.
KERNEL_MODULE = types.SimpleNamespace(
    __name__="fused_weight_gradient_mlp_cuda (megatron_lora_patch CPU stand-in)",
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
    wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16,
)


def install(patcher, layers_module) -> None:
    """Give `megatron.core.tensor_parallel.layers` the kernel module (only where the real one is missing)."""
    if getattr(layers_module, "_grad_accum_fusion_available", False):
        return
    patcher.replace(layers_module, "fused_weight_gradient_mlp_cuda", KERNEL_MODULE)
    patcher.replace(layers_module, "_grad_accum_fusion_available", True)
