"""Rank-side resume: Megatron-LM-style training steps with a full (model + optimizer) dist checkpoint.

The model, DDP wrapping, optimizer and data are the testing driver's; the loop is its
step loop with two additions the driver does not expose: saving / loading the model's
and the optimizer's sharded state dicts the way Megatron-LM's checkpointing does
(`{"model": model.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(model_sd)}`).
"""

from __future__ import annotations

from typing import Optional

import persistence_worker

from megatron_lora_patch.proof.testbed.settings import TrainSettings

TRAINING_PATCHES = persistence_worker.PATCHES + ("finalize_grads", "loss_normalization")
SETTINGS = TrainSettings(global_batch_size=4, lr=1e-2)


def _state(chunks, optimizer, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_state = chunks[0].module.sharded_state_dict()  # inside DDP, keys without "module."
    if not with_optimizer:
        return {"model": model_state}
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def _train_step(chunks, optimizer, spec, step: int) -> tuple:
    """One optimizer step on this DP rank's microbatches of the step's global batch; `optimizer.step()`'s
    (update successful, grad norm, zeros)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lora_patch.proof.testbed import data
    from megatron_lora_patch.proof.testbed.pretrain import PER_TOKEN, forward_step_for

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    global_batch = data.make_global_batch(
        SETTINGS.seed + step, SETTINGS.global_batch_size, spec.seq_length, spec.vocab_size
    )
    microbatches = data.dp_rank_microbatches(global_batch, dp_rank, dp_size, SETTINGS.micro_batch_size)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step_for(PER_TOKEN),
        data_iterator=iter(microbatches),
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=spec.seq_length,
        micro_batch_size=SETTINGS.micro_batch_size,
        decoder_seq_length=spec.seq_length,
        forward_only=False,
    )
    return optimizer.step()


def train_world(
    rank: int,
    world: int,
    topology: str,
    spec,
    lora_seed: int,
    steps: range,
    load_dir: Optional[str] = None,
    save_dir: Optional[str] = None,
    save_before: Optional[int] = None,
    load_optimizer: bool = True,
) -> dict:
    """Run `steps` (global step indices pick the data); load first / save before step `save_before`.

    Returns the local adapters after loading (or building), when saved, and after the last step.
    `load_optimizer=False` restores the model only (the tests' proof that optimizer state matters).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import finalize_model_grads

    from megatron_lora_patch.proof.testbed import model_setup
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence_worker.setup(persistence_worker.lora_config(lora_seed), TRAINING_PATCHES)
    parsed = Topology.parse(topology)
    with parsed.world(seed=SETTINGS.seed):
        chunks = model_setup.wrap_like_get_model(build_model(spec, parsed, seed=SETTINGS.seed), SETTINGS)
        optimizer = model_setup.build_optimizer(chunks, SETTINGS)
        config = chunks[0].config
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if load_dir is not None:
            # Without the optimizer entry: its is_loading state dict pre-fills Adam moments (no step).
            request = _state(chunks, optimizer, is_loading=True, with_optimizer=load_optimizer)
            loaded = dist_checkpointing.load(request, load_dir)
            chunks[0].module.load_state_dict(loaded["model"])
            if load_optimizer:
                optimizer.load_state_dict(loaded["optimizer"])
        record = {"start": persistence_worker.local_adapters(chunks)}
        for step in steps:
            if step == save_before:
                dist_checkpointing.save(_state(chunks, optimizer, is_loading=False), save_dir)
                record["saved"] = persistence_worker.local_adapters(chunks)
            _train_step(chunks, optimizer, spec, step)
        record["end"] = persistence_worker.local_adapters(chunks)
        return record


def train_and_save_world(
    rank: int, world: int, topology: str, spec, lora_seed: int, steps: int, adapters_dir: str
) -> dict:
    """Train the adapters `steps` steps (Adam), then: full-vocab logits of `persistence_worker.batch`,
    an adapter-only checkpoint in `adapters_dir`, and the local adapters."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed import model_setup
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence_worker.setup(persistence_worker.lora_config(lora_seed), TRAINING_PATCHES)
    parsed = Topology.parse(topology)
    with parsed.world(seed=SETTINGS.seed):
        chunks = model_setup.wrap_like_get_model(build_model(spec, parsed, seed=SETTINGS.seed), SETTINGS)
        optimizer = model_setup.build_optimizer(chunks, SETTINGS)
        chunks[0].config.grad_scale_func = optimizer.scale_loss
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
        for step in range(steps):
            _train_step(chunks, optimizer, spec, step)
        logits = persistence_worker.full_logits(chunks[0].module, spec)
        save_adapters(chunks, adapters_dir)
        return {"adapted": logits, "adapters": persistence_worker.local_adapters(chunks)}
