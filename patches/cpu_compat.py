"""cpu_compat: run Megatron-Core (local spec, dense and MoE; Megatron-LM's loop) on CPU with gloo.

The one patch of the `cpu_testbed` plugin, never of the production `lora_correct`; on once that
plugin is named. It relocates devices, backs the CUDA RNG tracker with the CPU generator, swaps
gloo-incompatible collectives for ones that move the same values and fixes a few CUDA-only
asserts: the numerics are those Megatron computes (docs/architecture.md section 9). Where CUDA
is available every hook skips unless `MEGATRON_LORA_CPU_COMPAT_FORCE=1`. `status` lists every
attribute the hooks change; the docstrings of `megatron_lora_patch.cpu_testbed` say why.
"""

from __future__ import annotations

from megatron_lora_patch.cpu_testbed import host_only_hook
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

#: (Megatron module fixed, `megatron_lora_patch.cpu_testbed` module, its installer(patcher, module)).
FIXES = (
    ("megatron.core", "modules", "install_host_device"),
    ("megatron.core.tensor_parallel.random", "modules", "install_host_rng"),
    ("megatron.core.transformer.torch_norm", "modules", "install_torch_norm"),
    ("megatron.core.tensor_parallel.mappings", "collectives", "install"),
    ("megatron.core.transformer.multi_latent_attention", "mla_attention", "install"),
    ("megatron.core.transformer.moe.moe_utils", "modules", "install_moe_utils"),
    ("megatron.core.transformer.moe.token_dispatcher", "modules", "install_dispatcher_stream"),
    ("megatron.core.optimizer.clip_grads", "modules", "install_clip_grads"),
    ("megatron.core.tensor_parallel.layers", "fused_wgrad", "install"),
    ("megatron.core.datasets.utils", "training", "install_dataset_helpers"),
    ("megatron.training.initialize", "training", "install_initialize"),
    ("megatron.training.arguments", "training", "install_arguments"),
    ("megatron.legacy.fused_kernels", "training", "install_fused_kernels"),
    ("megatron.core.utils", "thd", "install_thd_partition"),
    ("megatron.core.dist_checkpointing.strategies.async_utils", "async_save", "install_worker"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "async_save", "install_host_staging"),
)

SPEC = PatchSpec(
    name="cpu_compat",
    summary="run Megatron-Core on CPU + gloo with unchanged numerics (testing)",
    hooks={target: host_only_hook(library, installer) for target, library, installer in FIXES},
    versions=tested_range(),
    default=True,
)
