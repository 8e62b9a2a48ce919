"""Rank-side code of the shared-outer tests: an MoE model trained with `expert_shared_outer`, then handed off,
saved and loaded.

`train_world` trains a few Adam steps (the testing driver's model, DDP and optimizer, `resume_worker`'s
step) and returns, per shared outer factor, the tensor every local expert's adapter holds, the grad norm
of each step, the shared factors' squared grad sum of step 0, the full-vocab logits, the `adapter_state`
and the local adapters; then it writes an adapter-only checkpoint. `break_sync` is the negative control: the
shared factors are marked as expert weights (`allreduce=False`) before DDP wraps the model, so they are reduced
over expert-DP only.
"""

from __future__ import annotations

from typing import Dict, List

import persistence_worker
import resume_worker
import torch

SEED = 53


def config(**options):
    return persistence_worker.lora_config(SEED, expert_shared_outer=True, **options)


def shared_factors(chunks) -> Dict[str, List[torch.Tensor]]:
    """Shared factor name -> the tensor each local expert adapter holds as it (CPU copies, in expert order)."""
    from megatron_lora_patch.lora.inventory import adapters_of
    from megatron_lora_patch.lora.layers.shared_outer import OUTER_FACTORS, shared_name

    found: Dict[str, List[torch.Tensor]] = {}
    for name, adapter in sorted(adapters_of(chunks).items()):
        factor = OUTER_FACTORS.get(name.rsplit(".", 1)[-1]) if adapter.expert_index is not None else None
        if factor is not None:
            found.setdefault(f"{shared_name(name)}.{factor}", []).append(getattr(adapter, factor).detach().clone())
    return found


def _shared_params(model_chunks) -> list:
    """The shared outer factors: adapter parameters of an MoE layer's experts module, not of one local expert."""
    return [param for chunk in model_chunks for param in chunk.parameters()
            if getattr(param, "lora_info", None) is not None and ".local_experts." not in param.lora_info.module
            and "experts" in param.lora_info.module]


def _unsync(model_chunks) -> None:
    for param in _shared_params(model_chunks):
        param.allreduce = False


def _shared_grad_square(chunks) -> float:
    """Sum of the squared (reduced) grads of the shared factors after a step: what the grad norm would count once
    more if a second copy of them were counted."""
    return float(sum(param.main_grad.double().square().sum() for param in _shared_params(chunks)))


def train_world(rank: int, world: int, topology: str, spec, steps: int, directory: str, family: str,
                break_sync: bool = False) -> dict:
    from megatron.core.distributed import finalize_model_grads

    from megatron_lora_patch.handoff import adapter_state
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed import model_setup
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    settings = resume_worker.SETTINGS
    persistence_worker.setup(config(), resume_worker.TRAINING_PATCHES)
    parsed = Topology.parse(topology)
    with parsed.world(seed=settings.seed):
        model = build_model(spec, parsed, seed=settings.seed)
        initial = shared_factors(model)
        if break_sync:
            _unsync(model)
        chunks = model_setup.wrap_like_get_model(model, settings)
        optimizer = model_setup.build_optimizer(chunks, settings)
        chunks[0].config.grad_scale_func = optimizer.scale_loss
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
        norms, shared_square = [], None
        for step in range(steps):
            norms.append(float(resume_worker._train_step(chunks, optimizer, spec, step)[1]))
            shared_square = _shared_grad_square(chunks) if step == 0 else shared_square
        state = adapter_state(chunks, family)
        logits = persistence_worker.full_logits(chunks[0].module, spec)
        save_adapters(chunks, directory)
        return {"initial": initial, "shared": shared_factors(chunks), "norms": norms, "shared_square": shared_square,
                "logits": logits,
                "config": state.config, "tensors": state.tensors, "shared_outer": state.shared_outer}


def load_world(rank: int, world: int, topology: str, spec, directory: str, shared: bool = True,
               megatron_load: bool = False) -> dict:
    """Build with other adapters (seed 999), `shared` or not, then load `directory` with `load_adapters` (or, with
    `megatron_load`, with `dist_checkpointing.load` of the adapters' sharded state dict, as Megatron-LM's
    load_checkpoint reaches it): the shared factors before and after, or the refusal."""
    from megatron.core import dist_checkpointing

    from megatron_lora_patch.lora.checkpoints.checkpoint import adapter_only_sharded_state_dict, load_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence_worker.setup(persistence_worker.lora_config(999, expert_shared_outer=shared))
    parsed = Topology.parse(topology)
    with parsed.world():
        chunks = build_model(spec, parsed)
        before = shared_factors(chunks)
        try:
            if megatron_load:
                dist_checkpointing.load(adapter_only_sharded_state_dict(chunks), directory)
            else:
                load_adapters(chunks, directory)
        except Exception as error:  # the refusal is the result
            return {"error": f"{type(error).__name__}: {error}"}
        return {"before": before, "after": shared_factors(chunks), "error": None}


def refusal_world(rank: int, world: int, topology: str, cases: dict, patches=persistence_worker.PATCHES) -> dict:
    """Build each case's `(spec, LoraConfig options)` with the option on (and `patches`): its refusal text, or None
    when it builds."""
    from megatron_lora_patch.lora.config import LoraConfigError, set_active
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence_worker.setup(config(), patches)
    parsed = Topology.parse(topology)
    found = {}
    with parsed.world():
        for label, (spec, options) in cases.items():
            set_active(config(**options))
            try:
                build_model(spec, parsed)
                found[label] = None
            except LoraConfigError as error:
                found[label] = str(error)
    return found
