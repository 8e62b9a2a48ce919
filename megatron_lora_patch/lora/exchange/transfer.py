"""Moving whole adapters in and out: checkpoint -> logical adapters -> PEFT, and PEFT -> this rank's shards.

`export_peft(checkpoint_dir, out_dir)` needs no model and no world: it reads the adapter
tensors of a checkpoint the plugin wrote (adapter-only or Megatron-LM's, any topology;
Megatron's loader returns the full logical tensors, stacked over layers (unless the layers differ) and experts) and
the fully trained weights (`modules_to_save`), and writes the PEFT files.
`import_peft(chunks, peft_dir)` runs on every rank of any topology and copies each
rank's slice of the logical adapters and fully trained weights into its parameters.
DoRA's magnitude `m` travels with its adapter both ways and is loaded as is (never re-initialised from the base
weight: import after the base weights are loaded, as `magnitudes.reset_magnitudes` would overwrite it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, Iterable, Optional, Tuple

import torch

from megatron_lora_patch.lora import inventory
from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.dora import MAGNITUDE
from megatron_lora_patch.lora.adapters.layouts import shard
from megatron_lora_patch.lora.checkpoints import checkpoint, collective, staging
from megatron_lora_patch.lora.checkpoints import source as checkpoint_source
from megatron_lora_patch.lora.exchange import checks, families, files, peft
from megatron_lora_patch.lora.exchange import modules as peft_modules
from megatron_lora_patch.lora.exchange.names import Logical, Magnitudes, PeftFormatError
from megatron_lora_patch.lora.layers import trained_fully
from megatron_lora_patch.runtime import agreement

_STACKED_KEY = re.compile(r"^decoder\.layers\.(?P<module>.+?)\.lora\.(?P<factor>[ABm])$")
_EXPERTS_KEY = "mlp.experts.experts."
_LAYER_INDEX = re.compile(r"^(\d+)\.(.+)$")


def logical_from_checkpoint(directory: str) -> Tuple[dict, Logical, Dict[str, torch.Tensor], Magnitudes]:
    """(description, canonical module name -> logical (A, B), canonical module name -> fully trained
    logical weight, canonical module name -> DoRA's logical m) of a checkpoint with adapters (adapter-only, a
    Megatron-LM iteration or `--save` directory; see `checkpoint_source`)."""
    description, plain = checkpoint_source.adapter_tensors(directory)
    full_keys = trained_fully.checkpoint_keys(description)
    full = {full_keys[key]: plain.pop(key) for key in list(plain) if key in full_keys}
    factors: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in plain.items():
        match = _STACKED_KEY.match(key)
        if match is None:
            raise inventory.AdapterCheckpointError(f"{directory}: unexpected tensor {key!r} in an adapter checkpoint")
        module, factor = match.group("module"), match.group("factor")
        for layer, module, per_layer in _per_layer(module, tensor):
            if module.startswith(_EXPERTS_KEY):  # SequentialMLP / TEGroupedMLP: `local_experts.<i>.` -> `experts.`
                linear = module[len(_EXPERTS_KEY) :]
                for expert, value in enumerate(per_layer.unbind(0)):  # axis 1: global expert index
                    name = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}"
                    factors.setdefault(name, {})[factor] = value.clone()
            else:
                factors.setdefault(f"decoder.layers.{layer}.{module}", {})[factor] = per_layer.clone()
    logical = {name: (pair["A"], pair["B"]) for name, pair in sorted(factors.items())}
    return description, logical, full, {name: pair[MAGNITUDE] for name, pair in factors.items() if MAGNITUDE in pair}


def _per_layer(module: str, tensor: torch.Tensor) -> Iterable[Tuple[int, str, torch.Tensor]]:
    """(global layer index, module inside the layer, that layer's tensor) of one checkpoint tensor: stacked over
    the layers (axis 0), or one layer's where the layers differ (Megatron keys non-homogeneous layers, e.g.
    dense and MoE ones by `moe_layer_freq`, `decoder.layers.<i>.<module>`)."""
    index = _LAYER_INDEX.match(module)
    if index is not None:
        return [(int(index.group(1)), index.group(2), tensor)]
    return [(layer, module, per_layer) for layer, per_layer in enumerate(tensor.unbind(0))]


@dataclasses.dataclass(frozen=True)
class ArgumentNames:
    """How error messages name `export_peft`'s arguments (the CLI passes its option names)."""

    checkpoint: str = "checkpoint_dir"
    out: str = "out_dir"
    family: str = "family"
    overwrite: str = "pass overwrite=True"


def _check_apart(checkpoint_dir: str, out_dir: str, names: ArgumentNames) -> None:
    """The output must not be, contain or sit inside the checkpoint (replacing it would destroy the input).
    An empty `out_dir` is left to `staging.check_target` to name (its real path would be the working directory)."""
    if not out_dir:
        return
    source, target = os.path.realpath(checkpoint_dir), os.path.realpath(out_dir)
    if os.path.commonpath([source, target]) in (source, target):
        raise inventory.AdapterCheckpointError(
            f"{names.out} {out_dir} overlaps {names.checkpoint} {checkpoint_dir}; "
            "write the PEFT adapter to a directory outside the checkpoint"
        )


def export_peft(
    checkpoint_dir: str,
    out_dir: str,
    family: Optional[str] = None,
    overwrite: bool = False,
    names: ArgumentNames = ArgumentNames(),
) -> Dict[str, torch.Tensor]:
    """Write the PEFT adapter of a checkpoint with adapters (see `checkpoint_source`) to `out_dir`; returns the PEFT
    tensors.

    Every argument is checked before the checkpoint is loaded, `family` against the model the
    checkpoint records (None: inferred; lora/exchange/families.py); a non-empty `out_dir` is
    refused unless `overwrite`, and replaced only once the new adapter is complete.
    """
    recorded = checkpoint.read_description(checkpoint_source.resolve_save_dir(checkpoint_dir), names.checkpoint)
    family = families.resolve(recorded, family, names.family)
    _check_apart(checkpoint_dir, out_dir, names)  # first: "pass --force" would destroy the checkpoint
    staging.check_target(out_dir, names.out, names.overwrite, overwrite)
    with staging.staged(out_dir, names.out) as partial:
        description, logical, full, magnitudes = logical_from_checkpoint(checkpoint_dir)
        tensors, config = peft.to_peft(logical, description, family, full, magnitudes)
        _write(partial, tensors, config, family, out_dir, names)
    return tensors


def _write(partial: str, tensors: Dict[str, torch.Tensor], config: dict, family: str, out_dir: str,
           names: ArgumentNames) -> None:
    """`files.write` into the staging directory; a failed write (a full disk) is one line (`staged` then removes
    the staging directory, so nothing partial is left and an existing `out_dir` is untouched)."""
    from safetensors import SafetensorError

    try:
        files.write(partial, tensors, config, family)
    except (OSError, SafetensorError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip()
        raise staging.OutputDirectoryError(
            f"{names.out} {out_dir} could not be written ({reason.splitlines()[0] if reason else type(error).__name__}"
            "); nothing was left behind: free space on its filesystem (or name another directory) and export again"
        ) from None


def _all_adapter_names(local: Iterable[str]) -> set:
    """Adapted module names over every rank (pipeline stages and expert ranks hold different ones)."""
    import torch.distributed as dist

    names = set(local)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(names))
        names = set().union(*gathered)
    return names


def _tp_position(adapter: LoraAdapter) -> Tuple[int, int]:
    from megatron.core.utils import get_pg_rank, get_pg_size

    return get_pg_rank(adapter.tp_group), get_pg_size(adapter.tp_group)


def _logical_shapes(adapter: LoraAdapter) -> Tuple[tuple, tuple]:
    _, world = _tp_position(adapter)
    a_shape, b_shape = list(adapter.A.shape), list(adapter.B.shape)
    if adapter.parallel_mode == "column":
        b_shape[0] *= world
    else:
        a_shape[1] *= world
    return tuple(a_shape), tuple(b_shape)


def _local_slices(
    adapter: LoraAdapter, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) cut from the logical factors, the way the adapter was sharded at init."""
    rank, world = _tp_position(adapter)
    if adapter.parallel_mode == "column":
        return lora_a, shard(lora_b, 0, rank, world, getattr(adapter.B, "partition_stride", 1))
    return shard(lora_a, 1, rank, world), lora_b


def load_logical(chunks: Iterable[torch.nn.Module], logical: Logical, magnitudes: Optional[Magnitudes] = None) -> None:
    """Copy this rank's slices of `logical` (canonical name -> (A, B)) and of DoRA's `magnitudes` (canonical
    name -> m: sharded like B's rows on a column-parallel layer, replicated on a row-parallel one) into its
    adapters."""
    with torch.no_grad():
        for name, adapter in inventory.adapters_of(chunks).items():
            local_a, local_b = _local_slices(adapter, *logical[name])
            adapter.A.copy_(local_a)
            adapter.B.copy_(local_b)
            if adapter.magnitude is not None:
                adapter.m.copy_(_local_magnitude(adapter, magnitudes[name], name))


def _local_magnitude(adapter: LoraAdapter, magnitude: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's m from the logical one (one entry per output row of the full layer)."""
    rank, world = _tp_position(adapter)
    rows = adapter.B.shape[0] * (world if adapter.parallel_mode == "column" else 1)
    if tuple(magnitude.shape) != (rows,):
        raise PeftFormatError(f"Megatron {name} needs a magnitude of {rows} rows, the adapter "
                              f"gives {tuple(magnitude.shape)}")
    if adapter.parallel_mode == "column":
        return shard(magnitude, 0, rank, world, getattr(adapter.B, "partition_stride", 1))
    return magnitude


def load_trained_fully(model: torch.nn.Module, full: Dict[str, torch.Tensor], where: str) -> None:
    """Copy this rank's vocabulary rows of each logical fully trained weight (`full`: canonical module
    name -> weight) into the (unwrapped) model, sharded over each module's own TP group."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    with torch.no_grad():
        for module, name in trained_fully.trained_weights(model):
            weight, world = full[name], get_pg_size(module.tp_group)
            want = (world * module.weight.shape[0], module.weight.shape[1])
            if tuple(weight.shape) != want:
                raise PeftFormatError(
                    f"{where}: Megatron {name} needs a weight {want}, the adapter gives {tuple(weight.shape)}"
                )
            module.weight.copy_(shard(weight, 0, get_pg_rank(module.tp_group), world))


def import_peft(chunks: Iterable[torch.nn.Module], peft_dir: str, timeout: float = agreement.DEFAULT_TIMEOUT_S) -> None:
    """Load a PEFT LoRA adapter (with its `modules_to_save` weights) into this rank's adapters and fully
    trained weights (collective over the world: call on every rank; the others must call within `timeout` seconds
    with the same directory, else one line says why)."""
    chunks = list(chunks)
    description = inventory.describe(chunks)
    local = inventory.adapters_of(chunks)

    def check() -> tuple:
        tensors, config, family = files.read(peft_dir)
        if family == "llama" and description.get("multi_latent_attention"):
            family = "deepseek_v3"  # an adapter peft wrote itself names no family; the one with MLA's names is this
        return (*peft_modules.split(tensors, config, description, peft_dir, PeftFormatError), config, family)

    tensors, full, config, family = collective.agreed("import_peft", {"peft_dir": peft_dir}, timeout, check)
    magnitudes: Magnitudes = {}
    logical = peft.from_peft(tensors, config, description, _all_adapter_names(local), peft_dir, family, magnitudes)
    checks.check_shapes(
        {name: logical[name] for name in local}, {name: _logical_shapes(a) for name, a in local.items()}, peft_dir
    )
    load_logical(chunks, logical, magnitudes)
    load_trained_fully(inventory.single_model(chunks), full, peft_dir)
