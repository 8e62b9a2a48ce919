"""Model features LoRA has not been proven on: refused with one line before any training step.

- Generalized tensor parallelism (GTP, Megatron-Core 0.19: `--tensor-parallel-num-weight-shards`
  above the TP size, `gtp_weight_remat_size` > 1). GTP shards each weight once more and
  re-gathers it inside the `linear_with_*` functions the adapters ride on, and adds its own
  finalize reductions; the oracle has never checked LoRA beside it, so it would be unproven
  math, not a tested path.
- CUDA graphs (`--cuda-graph-impl local|transformer_engine|full_iteration`, the older `--enable-cuda-graph` /
  `--external-cuda-graph`). A captured graph replays fixed kernels on fixed buffers: the adapters' Python-side
  dispatch (the linear's context variable, dropout masks, in-place epilogues) and DDP's param-gather pre-hooks,
  which skip while a graph is captured (lora/training/param_sync.py), are not part of any replay we have
  checked, and no CPU run can capture one.
- `moe_shared_expert_overlap` runs after a one-line warning: the shared experts' linears then skip their own
  TP collectives (`explicit_expert_comm`), so the adapters' terms ride Megatron's pre-reduction partials as on
  routed experts (lora/layers/linear.py), but the overlapped schedule needs CUDA streams and has never run
  here; `megatron-lora-patch preflight` on the user's nodes is the check.
- Multi-token prediction (`--mtp-num-layers`, DeepSeek-V3). Megatron-Core 0.19 builds its layers on CPU with the
  local spec, but neither the adapters on them (`eh_proj`, the MTP transformer layer) nor the MTP loss's grads
  reaching the decoder's adapters have been compared with world size 1 on any topology: refused.
- The linears of Mamba / gated-delta-net mixers (`megatron.core.ssm`): `in_proj` packs
  `[z, x, B, C, dt]` (uneven `partition_sizes`) per TP shard, so a column adapter's B would
  not be sharded like the base weight. Attention and MLP linears of a hybrid model are fine.
- Multi-latent attention's down projections in the Transformer Engine spec: Megatron builds them as
  `TELinear(parallel_mode="duplicated")` (fused as `linear_qkv_down_proj` with `mla_down_proj_fusion`),
  a full weight on every TP rank fed the rank's own sequence shard under SP. Their factors would be
  replicated with grads that are partial per sequence shard under SP and complete without it: a grad
  domain no adapter here has, so it is refused; the local spec builds them column-parallel (proven).
- Fully sharded data parallelism (`--use-torch-fsdp2`, `--use-megatron-fsdp`, 0.13's custom FSDP): every data-parallel
  wrapper but Megatron's `DistributedDataParallel`. FSDP reduce-scatters grads into shards of its own, not DDP's
  buffers, so the SUM of replicated factors over TP (`finalize_grads`), the grad norm's count of
  them and the adapter-sized checkpoints would act on state they were never checked against; no CPU run here can
  build FSDP (it needs CUDA), so it is refused when the wrapper is built (`refuse_sharded_data_parallel`).
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

import torch

from megatron_lora_patch.lora.adapters.metadata import adapter_info
from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.registry import warn_once

SSM_PACKAGE = "megatron.core.ssm."
#: MLA's down projections: column-parallel in the local spec, TE "duplicated" linears in the TE spec.
MLA_DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


class UnsupportedModelError(UsageError):
    """The model uses a feature LoRA is not verified for."""


def _gtp_sizes(model: torch.nn.Module, linears: Iterable[torch.nn.Module]) -> Tuple[int, int]:
    """(dense, expert) GTP weight-rematerialization sizes of the model: config or built layers."""
    config = getattr(model, "config", None)
    dense = getattr(config, "gtp_weight_remat_size", 1) or 1
    expert = getattr(config, "expert_gtp_weight_remat_size", 1) or 1
    built = max((getattr(module, "gtp_remat_size", 1) or 1 for module in linears), default=1)
    return max(dense, built), expert


def _cuda_graph_setting(config) -> str:
    """The CUDA-graph option the model config turns on, as the user set it ("" when none is)."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl != "none":
        return f"cuda_graph_impl {impl!r}"
    for field in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(config, field, False):
            return field
    return ""


def refuse_unsupported(
    model: torch.nn.Module, selected: Iterable[Tuple[str, torch.nn.Module, torch.nn.Module]]
) -> None:
    """Raise `UnsupportedModelError` for GTP, or for selected `(name, linear, parent)` in an SSM mixer."""
    selected = list(selected)
    config = getattr(model, "config", None)
    graphs = _cuda_graph_setting(config)
    if graphs:
        raise UnsupportedModelError(
            f"LoRA is not supported with CUDA graphs ({graphs}); set --cuda-graph-impl none (and leave out "
            "--enable-cuda-graph / --external-cuda-graph)"
        )
    if getattr(config, "mtp_num_layers", None):
        raise UnsupportedModelError(
            f"LoRA with multi-token prediction (--mtp-num-layers {config.mtp_num_layers}) is not supported: its "
            "layers and their loss have not been checked against world size 1 here; leave out --mtp-num-layers"
        )
    if getattr(config, "moe_shared_expert_overlap", False):
        warn_once("moe-shared-expert-overlap", "LoRA with --moe-shared-expert-overlap has not run on a GPU here; "
                  "check it on your nodes with `megatron-lora-patch preflight -- <your pretrain_gpt.py args>`")
    dense, expert = _gtp_sizes(model, (module for _, module, _ in selected))
    if dense > 1 or expert > 1:
        raise UnsupportedModelError(
            f"LoRA is not supported with generalized tensor parallelism (gtp_weight_remat_size {dense}, "
            f"expert_gtp_weight_remat_size {expert}); set --tensor-parallel-num-weight-shards and "
            "--expert-tensor-parallel-num-weight-shards to the TP / expert-TP sizes (GTP off)"
        )
    mixers = [name for name, _, parent in selected if type(parent).__module__.startswith(SSM_PACKAGE)]
    if mixers:
        raise UnsupportedModelError(
            f"LoRA on Mamba/GDN mixer linears is not supported: {', '.join(mixers)}; drop them from "
            "MEGATRON_LORA_TARGETS or add them to MEGATRON_LORA_EXCLUDE (attention and MLP linears are supported)"
        )



def refuse_duplicated(names: List[str]) -> None:
    """Raise `UnsupportedModelError` naming the selected Transformer Engine duplicated linears (the TE spec's
    MLA down projections, see the module docstring)."""
    if names:
        raise UnsupportedModelError(
            f"LoRA on Transformer Engine duplicated linears (MLA's down projections in the TE spec) is not "
            f"supported: {', '.join(names)}; add {','.join(MLA_DOWN_PROJECTIONS)} to MEGATRON_LORA_EXCLUDE "
            "or build the model with the local spec (column-parallel down projections)"
        )


#: The Megatron-LM flag that builds each fully sharded wrapper (by the wrapper's module).
_FSDP_FLAGS = {
    "megatron.core.distributed.torch_fully_sharded_data_parallel": "--use-torch-fsdp2",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter": "--use-megatron-fsdp",
    "megatron.core.distributed.custom_fsdp.fully_sharded_data_parallel": "--use-custom-fsdp",  # 0.13
}


def sharded_data_parallel_problem(what: str, fix: str) -> str:
    """The one line that refuses LoRA under a fully sharded wrapper (`what`, e.g. its class and flag)."""
    return (
        f"LoRA is not supported with {what}: the adapters' grad sync, grad norm and checkpoints are proven with "
        f"Megatron's DistributedDataParallel only; {fix} (--use-distributed-optimizer shards the optimizer state)"
    )


def fsdp_flag(args) -> str:
    """The Megatron-LM flag of `args` (parsed arguments) that asks for a fully sharded wrapper ('' when none)."""
    for flag in _FSDP_FLAGS.values():
        if getattr(args, flag[2:].replace("-", "_"), False):
            return flag
    return ""


def refuse_sharded_data_parallel(wrapper: torch.nn.Module, module: torch.nn.Module) -> None:
    """Raise `UnsupportedModelError` when a data-parallel wrapper other than Megatron's DDP (an FSDP) is built
    around a model that holds adapters (see the module docstring)."""
    from megatron.core.distributed import DistributedDataParallel

    if isinstance(wrapper, DistributedDataParallel):
        return
    if not any(adapter_info(param) is not None for param in module.parameters()):
        return
    kind = type(wrapper)
    flag = _FSDP_FLAGS.get(kind.__module__)
    if flag:
        raise UnsupportedModelError(sharded_data_parallel_problem(f"{kind.__name__} ({flag})", f"leave out {flag}"))
    fix = "wrap the model in megatron.core.distributed.DistributedDataParallel"
    raise UnsupportedModelError(sharded_data_parallel_problem(kind.__name__, fix))
