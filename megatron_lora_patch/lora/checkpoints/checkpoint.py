"""LoRA adapters in Megatron distributed checkpoints (`megatron.core.dist_checkpointing`).

A parallel linear's own `sharded_state_dict` sees `lora.A` / `lora.B` in its plain
state dict and would mark both as replicated over TP. `layer_sharded_state_dict` (the
`lora_checkpoint` patch wraps the layers' method with it) replaces those two entries with
`adapter_sharded_state_dict`, which describes each factor the way Megatron describes the
base weight beside it (docs/architecture.md section 4):

- the sharded factor (column B on dim 0, row A on dim 1) is a TP-sharded tensor with
  replica id `(0, 0, dp_rank)`, exactly like the weight;
- the replicated factor (column A, row B) has replica id `(0, tp_rank, dp_rank)`, so
  only one rank of its shard domain writes it;
- a SwiGLU fc1 B (stride 2, each shard is `[gate_shard; up_shard]`) goes through
  Megatron's `apply_swiglu_sharded_factory`, like the fc1 weight in `MLP.sharded_state_dict`;
- the groups are the wrapped layer's: for expert linears the expert-TP group, and
  `SequentialMLP.sharded_state_dict` adds the expert axis and the expert-DP replica id
  around it, as it does for the expert weights.

The saved tensors are therefore the logical (world-size-1) factors, stacked over layers
(and experts), and load onto any topology. `save_adapters` / `load_adapters` write and
read an adapter-only checkpoint (the base weights are left out) with a description of
the model in its common state (`lora/inventory.py` `describe`), which `peft` export reads.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Iterable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.dora import MAGNITUDE
from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME
from megatron_lora_patch.lora.checkpoints import collective, staging
from megatron_lora_patch.lora.inventory import DESCRIPTION_FORMAT, AdapterCheckpointError, describe, single_model
from megatron_lora_patch.lora.layers import trained_fully
from megatron_lora_patch.runtime import agreement

#: Common-state entry of an adapter-only checkpoint: the model and LoRA description.
DESCRIPTION_KEY = "megatron_lora_patch"
_ADAPTER_SEGMENT = f".{ADAPTER_NAME}."


def _data_parallel_rank(metadata: Optional[dict]) -> int:
    """Rank in the DP x CP group: from `metadata` (Megatron-Core >= 0.14 passes it) or parallel_state."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_pg_rank

    group = (metadata or {}).get("dp_cp_group")
    if group is not None:
        return get_pg_rank(group)
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def _swiglu_factory(sharded: Any, sharded_offsets: tuple, metadata: Optional[dict]) -> Any:
    """Megatron's fc1 swiglu factory (its `singleton_local_shards` argument exists from 0.14 on)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    if "singleton_local_shards" in inspect.signature(apply_swiglu_sharded_factory).parameters:
        singleton = (metadata or {}).get("singleton_local_shards", False)
        return apply_swiglu_sharded_factory(sharded, sharded_offsets, singleton)
    return apply_swiglu_sharded_factory(sharded, sharded_offsets)


def adapter_sharded_state_dict(
    adapter: LoraAdapter, prefix: str, sharded_offsets: tuple = (), metadata: Optional[dict] = None
) -> Dict[str, Any]:
    """`{prefix}A`, `{prefix}B` (and DoRA's `{prefix}m`) as ShardedTensors (or a SwiGLU factory) with their true
    sharding.

    Built with `ShardedTensor.from_rank_offsets` on the adapter's own TP group (the
    expert-TP group for expert linears) so it reads the same on every supported
    Megatron-Core; replica ids are `(pipeline, tp, dp)` like Megatron's helpers make them.
    """
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.utils import get_pg_rank, get_pg_size

    tp_rank, tp_size = get_pg_rank(adapter.tp_group), get_pg_size(adapter.tp_group)
    dp_rank = _data_parallel_rank(metadata)
    prepend = len(sharded_offsets)
    # DoRA's magnitude `m` follows the output rows: sharded with column B, replicated with row B.
    sharded_axes = {"B": 0, MAGNITUDE: 0} if adapter.parallel_mode == "column" else {"A": 1}
    entries: Dict[str, Any] = {}
    for factor in ("A", "B") + ((MAGNITUDE,) if adapter.magnitude is not None else ()):
        key, tensor = f"{prefix}{factor}", getattr(adapter, factor)
        if factor not in sharded_axes:
            # Same values on every rank of the TP domain: only TP rank 0 (and DP rank 0) writes it.
            entries[key] = ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, replica_id=(0, tp_rank, dp_rank), prepend_axis_num=prepend
            )
            continue
        sharded = ShardedTensor.from_rank_offsets(
            key, tensor, *sharded_offsets, (sharded_axes[factor] + prepend, tp_rank, tp_size),
            replica_id=(0, 0, dp_rank), prepend_axis_num=prepend,
        )
        if getattr(tensor, "partition_stride", 1) == 2:  # SwiGLU fc1: [gate_shard; up_shard]
            sharded = _swiglu_factory(sharded, sharded_offsets, metadata)
        entries[key] = sharded
    return entries


def _bind_layer_arguments(method: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def layer_sharded_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """wrapt wrapper of Column/RowParallelLinear.sharded_state_dict: the adapter entries done right."""
    result = wrapped(*args, **kwargs)
    adapter = getattr(instance, "_modules", {}).get(ADAPTER_NAME)
    if adapter is None:
        return result
    call = _bind_layer_arguments(wrapped, args, kwargs).arguments
    adapter_prefix = f"{call['prefix']}{ADAPTER_NAME}."
    for key in [key for key in result if key.startswith(adapter_prefix)]:
        del result[key]  # Megatron's entries treat both factors as replicated
    result.update(adapter_sharded_state_dict(adapter, adapter_prefix, call["sharded_offsets"], call["metadata"]))
    return result


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key belongs to a LoRA adapter."""
    return _ADAPTER_SEGMENT in key


def adapter_only_sharded_state_dict(chunks: Iterable[torch.nn.Module]) -> Dict[str, Any]:
    """The model's sharded state dict restricted to adapter entries and fully trained weights
    (`modules_to_save`, described by Megatron itself: vocab-parallel shards); other base weights left out."""
    model = single_model(chunks)
    kept = trained_fully.state_keys(model)
    return {key: value for key, value in model.sharded_state_dict().items() if is_adapter_key(key) or key in kept}


def _rank_zero() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _from_rank_zero(value: Optional[str]) -> str:
    import torch.distributed as dist

    if not dist.is_initialized():
        return value  # type: ignore[return-value]
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def save_adapters(chunks: Iterable[torch.nn.Module], directory: str, overwrite: bool = False,
                  timeout: float = agreement.DEFAULT_TIMEOUT_S) -> None:
    """Write an adapter-only distributed checkpoint of this rank's model (collective: call on every rank; the
    others must call within `timeout` seconds with the same arguments, else one line names the difference).

    A non-empty `directory` (another checkpoint, a base model) is refused unless `overwrite`;
    the ranks write into a staging directory beside it that replaces it only when complete.
    """
    from megatron.core import dist_checkpointing

    chunks = list(chunks)
    label = "save_adapters: directory"

    collective.agreed(  # every rank has seen the target as it was, and agreed, before anyone writes
        "save_adapters", {"directory": directory, "overwrite": overwrite}, timeout,
        lambda: staging.check_target(directory, label, "pass overwrite=True", overwrite),
    )
    state = adapter_only_sharded_state_dict(chunks)
    state[DESCRIPTION_KEY] = describe(chunks)
    partial = _from_rank_zero(staging.make_staging(directory, label) if _rank_zero() else None)
    try:
        dist_checkpointing.save(state, partial)
        _barrier()
    except BaseException:
        if _rank_zero():
            staging.discard(partial)
        raise
    if _rank_zero():
        staging.publish(partial, directory, label)
    _barrier()


def read_error(error: BaseException) -> str:
    """The cause of a failed checkpoint read in one line: the first rank's error of torch's
    CheckpointException (its text is every rank's traceback), else the error itself; its first sentence."""
    failures = getattr(error, "failures", None) or {}
    cause = next(iter(failures.values()), (error,))[0]
    text = (str(cause).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(cause).__name__}: {text}".removesuffix(": ")


def unreadable_tensors(directory: str, error: BaseException) -> str:
    """The one line for a checkpoint whose tensor files cannot be read (truncated or damaged in a copy)."""
    return (f"{directory} has an unreadable tensor file ({read_error(error)}): it is truncated or damaged; copy the "
            "checkpoint again from where it was saved")


def _unreadable(label: str, directory: str, error: BaseException) -> str:
    """Why `directory`'s common state (the description) cannot be read; a missing legacy `common.pt` by name
    (Megatron-Core < 0.19 keeps the common state there; its own error for that names no file)."""
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    if not os.path.exists(os.path.join(directory, COMMON_STATE_FNAME)) and _legacy_format(error):
        return (
            f"{label} {directory} has no common state: {COMMON_STATE_FNAME} is missing (the checkpoint was copied "
            f"or written incompletely); copy {COMMON_STATE_FNAME} from where the checkpoint was saved"
        )
    return f"{label} {directory} is an unreadable distributed checkpoint ({read_error(error)}); save or copy it again"


def _legacy_format(error: BaseException) -> bool:
    """The read failed for lack of the common state: no `common.pt` (Megatron-Core < 0.19), or no
    `common_state` object in the tensor files (0.19 reads those when `common.pt` is absent)."""
    text = read_error(error)
    return "iterdir" in text or "FileNotFoundError" in text or "common_state" in text


def _common_state(directory: str) -> Any:
    """The checkpoint's common state. A legacy `common.pt` (Megatron-Core < 0.19 writes one) is a pickle from the
    user: read here with `torch.load(weights_only=True)` said explicitly (Megatron's reader relies on torch's
    default, which a TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 or a torch < 2.6 turns off); Megatron-Core 0.19 reads its
    own format with weights_only=True itself."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    legacy = os.path.join(directory, COMMON_STATE_FNAME)
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    return dist_checkpointing.load_common_state_dict(directory)


def read_description(directory: str, label: str = "adapter checkpoint") -> Dict[str, Any]:
    """The description saved by `save_adapters`, or a one-line `AdapterCheckpointError` saying what `directory` is."""
    from megatron.core.dist_checkpointing.core import CONFIG_FNAME

    fix = "pass the directory save_adapters wrote"
    if not directory:
        raise AdapterCheckpointError(f"{label} is empty; {fix}")
    if not os.path.exists(directory):
        raise AdapterCheckpointError(f"{label} {directory} does not exist; {fix}")
    if not os.path.isdir(directory):
        raise AdapterCheckpointError(f"{label} {directory} is a file, not a directory; {fix}")
    if not os.path.isfile(os.path.join(directory, CONFIG_FNAME)):
        raise AdapterCheckpointError(
            f"{label} {directory} is not a Megatron distributed checkpoint (no {CONFIG_FNAME}); {fix}"
        )
    try:
        common = _common_state(directory)
    except Exception as error:  # a damaged common state fails in several ways
        raise AdapterCheckpointError(_unreadable(label, directory, error)) from None
    except CheckpointException as error:  # a BaseException: torch's reader wraps each rank's error in it
        raise AdapterCheckpointError(_unreadable(label, directory, error)) from None
    description = common.get(DESCRIPTION_KEY) if isinstance(common, dict) else None
    if not isinstance(description, dict) or description.get("format") != DESCRIPTION_FORMAT:
        raise AdapterCheckpointError(
            f"{label} {directory} holds no megatron-lora-patch adapters (a base-model checkpoint?); "
            f"write one with megatron_lora_patch.lora.checkpoints.checkpoint.save_adapters"
        )
    return description


def _check_loadable(chunks: list, directory: str) -> None:
    """One `AdapterCheckpointError` where `directory` is no adapter checkpoint or was saved from another model."""
    saved, here = read_description(directory), describe(chunks)
    saved.setdefault("modules_to_save", [])  # written before modules_to_save existed
    for field in ("rank", "modules_to_save", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "num_experts"):
        if saved[field] != here[field]:
            raise AdapterCheckpointError(
                f"{directory}: checkpoint {field}={saved[field]} but this model has {field}={here[field]}; "
                f"build the model (and MEGATRON_LORA_RANK, _MODULES_TO_SAVE) as when it was saved"
            )
    separate = bool(saved.get("separate_projections", False))  # older checkpoints: one A per fused layer
    if separate != here["separate_projections"]:
        raise AdapterCheckpointError(
            f"{directory}: checkpoint {'has' if separate else 'has no'} separate q/k/v and gate/up adapters but this "
            f"model {'has no' if separate else 'has'} them; set MEGATRON_LORA_SEPARATE_PROJECTIONS={int(separate)}"
        )
    shared = bool(saved.get("expert_shared_outer", False))  # older checkpoints: per-expert factors
    if shared != here["expert_shared_outer"]:
        raise AdapterCheckpointError(
            f"{directory}: checkpoint {'has' if shared else 'has no'} expert factors shared per MoE layer but this "
            f"model {'has no' if shared else 'has'} them; set MEGATRON_LORA_EXPERT_SHARED_OUTER={int(shared)}"
        )
    dora = bool(saved.get("dora", False))  # older checkpoints: plain LoRA
    if dora != here["dora"]:
        raise AdapterCheckpointError(
            f"{directory}: checkpoint {'has' if dora else 'has no'} DoRA magnitudes but this model's adapters "
            f"{'do not use' if dora else 'use'} DoRA; set MEGATRON_LORA_DORA={int(dora)}"
        )


def load_adapters(chunks: Iterable[torch.nn.Module], directory: str,
                  timeout: float = agreement.DEFAULT_TIMEOUT_S) -> None:
    """Load an adapter-only checkpoint into this rank's adapters, whatever topology saved it (collective: call on
    every rank; the others must call within `timeout` seconds with the same directory, else one line says why)."""
    from megatron.core import dist_checkpointing

    chunks = list(chunks)
    collective.agreed("load_adapters", {"directory": directory}, timeout, lambda: _check_loadable(chunks, directory))
    sharded = adapter_only_sharded_state_dict(chunks)
    try:
        loaded = dist_checkpointing.load(sharded, directory)
    except (CheckpointException, OSError, EOFError) as error:  # a truncated or damaged .distcp file
        raise AdapterCheckpointError(unreadable_tensors(directory, error)) from None
    # A shared outer expert factor sits under every local expert's name (lora/layers/shared_outer.py).
    parameters = dict(single_model(chunks).named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key in sharded:  # `loaded` also holds the common state (the description)
            parameters[key].copy_(loaded[key])
