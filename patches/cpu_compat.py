"""cpu_compat: run Megatron-Core (local spec, dense and MoE) on CPU with gloo.

The one patch of the `cpu_testbed` plugin (`compat.plugin`), never of the production
`lora_correct`: on by default once that plugin is loaded (the testing helpers and the oracle
load it when CUDA is unavailable).
It only relocates devices, backs the CUDA RNG tracker with the CPU generator, replaces
gloo-incompatible collectives by equivalents that move the same values, and lets the
torch norm run under sequence parallel with the correct param tag: numerics are those
Megatron computes. With CUDA available every hook is a no-op unless
`MEGATRON_LORA_CPU_COMPAT_FORCE=1`.

One hook per Megatron module it fixes (`FIXES`: target, `compat` module, installer):

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

import importlib

from megatron_lora_patch.patching import PatchSpec

#: (Megatron module fixed, `megatron_lora_patch.compat` module, its installer(patcher, module)).
FIXES = (
    ("megatron.core", "modules", "install_host_device"),
    ("megatron.core.tensor_parallel.random", "modules", "install_host_rng"),
    ("megatron.core.transformer.torch_norm", "modules", "install_torch_norm"),
    ("megatron.core.tensor_parallel.mappings", "collectives", "install"),
    ("megatron.core.transformer.moe.moe_utils", "modules", "install_moe_utils"),
    ("megatron.core.transformer.moe.token_dispatcher", "modules", "install_dispatcher_stream"),
    ("megatron.core.optimizer.clip_grads", "modules", "install_clip_grads"),
    ("megatron.core.datasets.utils", "training", "install_dataset_helpers"),
    ("megatron.training.initialize", "training", "install_initialize"),
    ("megatron.training.arguments", "training", "install_arguments"),
    ("megatron.legacy.fused_kernels", "training", "install_fused_kernels"),
)


def _only_on_host(library: str, installer: str):
    """A hook running `compat.<library>.<installer>(patcher, module)` only when the host has no CUDA (or forced)."""

    def hook(patcher, module):
        from megatron_lora_patch.compat import FORCE_FLAG, host_is_cpu
        from megatron_lora_patch.runtime import SkipPatch

        if not host_is_cpu():
            raise SkipPatch(f"CUDA is available, nothing to fix (set {FORCE_FLAG}=1 to force)")
        getattr(importlib.import_module(f"megatron_lora_patch.compat.{library}"), installer)(patcher, module)

    hook.__name__ = hook.__qualname__ = installer
    return hook


SPEC = PatchSpec(
    name="cpu_compat",
    summary="run Megatron-Core on CPU + gloo with unchanged numerics (testing)",
    hooks={target: _only_on_host(library, installer) for target, library, installer in FIXES},
    versions=">=0.13,<0.20",
    default=True,
)
