"""The in-rank training loop: Megatron-LM's `train_step`, on the testbed.

`train_steps` runs inside every rank after the topology initialized `parallel_state`. It builds
the model, wraps it and builds Megatron's optimizer as Megatron-LM's `get_model` and
`setup_model_and_optimizer` do (`testbed.model_setup`), and runs K steps of `get_forward_backward_func()` over several
microbatches, then `optimizer.step()` (clipping inside). It returns a picklable record of
everything the oracle compares, in the rank's local layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List

import torch

from megatron_lora_patch.proof.testbed import data as testing_data
from megatron_lora_patch.proof.testbed import distributed_optimizer, packing
from megatron_lora_patch.proof.testbed.model_setup import (
    build_optimizer,
    resolve_finalize,
    set_sync_callbacks,
    wrap_like_get_model,
)
from megatron_lora_patch.proof.testbed.pretrain import forward_step_for, reduced_lm_loss
from megatron_lora_patch.proof.testbed.rank import to_cpu
from megatron_lora_patch.proof.testbed.recording import (
    ForwardRecorder,
    captured_params,
    grad_of,
    recording_losses,
)
from megatron_lora_patch.proof.testbed.settings import TrainSettings


def _rank_coordinates() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank(),
        "world_size": torch.distributed.get_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "cp_rank": ps.get_context_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_size": ps.get_data_parallel_world_size(),
        "cp_size": ps.get_context_parallel_world_size(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "etp_size": ps.get_expert_tensor_parallel_world_size(),
    }


def _single_chunk(chunks: list) -> torch.nn.Module:
    if len(chunks) != 1:
        raise ValueError(
            f"the testbed records one model chunk per rank; got {len(chunks)} (virtual pipeline "
            "stages are not supported: use pp without vpp)"
        )
    module = chunks[0]
    while hasattr(module, "module"):
        module = module.module
    return module


def _global_batches(spec, settings: TrainSettings) -> List[testing_data.Batch]:
    """Each step's global batch: seeded random tokens, or `settings.data_path`'s first tokens in order;
    packed rows (`testbed.packing`) for a packed spec."""
    per_step = settings.global_batch_size * (spec.seq_length + 1)
    corpus = None
    if settings.data_path:
        corpus = testing_data.read_corpus(settings.data_path, per_step * settings.steps, spec.vocab_size)
    make = packing.make_packed_global_batch if getattr(spec, "packed", False) else testing_data.make_global_batch
    return [
        make(
            settings.seed + step, settings.global_batch_size, spec.seq_length, spec.vocab_size,
            stream=None if corpus is None else corpus[step * per_step : (step + 1) * per_step],
        )
        for step in range(settings.steps)
    ]


def train_steps(spec, topology, settings: TrainSettings = TrainSettings()) -> dict:
    """Run `settings.steps` Megatron training steps on this rank; return its picklable record.

    Returned dict (tensors are CPU copies in this rank's local layout, keyed by the
    local parameter / module name of the unwrapped model):
      coords: rank, world_size and this rank's tp/pp/dp/cp/ep/etp/edp ranks and sizes
      is_last_stage: whether losses were computed here
      num_microbatches: per DP rank
      shards: {name: shards.Shard} where each captured local tensor sits in its logical tensor
      initial_params: {name: tensor} before the first step (after the DP broadcast)
      steps: one dict per step:
        microbatches: this rank's raw loss-function values per microbatch, in order:
                      [{'loss_sum': float, 'num_tokens': int}] (per-token contract) or
                      [{'loss_mean': float}] (legacy; CP ranks hold shares that sum to the
                      mean); empty off the last stage
        lm_loss: the reported loss (train_step's reduction), None off the last stage
        grad_norm: float from optimizer.step() (clipping uses it), None if no params
        update_successful: bool
        grads: {name: tensor} after finalize_model_grads, before clipping
        params: {name: tensor} after the step (every step, or the last one only)
        forward: {module name: [output per microbatch]}
        extra: whatever `capture.on_step_end` added
    """
    from megatron.core import parallel_state

    run = _build_run(spec, topology, settings)
    record = {
        "coords": _rank_coordinates(),
        "is_last_stage": parallel_state.is_pipeline_last_stage(),
        "num_microbatches": run.num_microbatches,
        "shards": {name: shard for name, (_, shard) in run.captured.items()},
        "initial_params": {name: to_cpu(param) for name, (param, _) in run.captured.items()},
        "steps": [],
    }
    try:
        for step, global_batch in enumerate(_global_batches(spec, settings)):
            step_record = _train_step(run, spec, settings, step, global_batch)
            if settings.capture.on_step_end is not None:
                settings.capture.on_step_end(step, step_record, run.chunks)
            record["steps"].append(step_record)
    finally:
        run.recorder.remove()
    return record


@dataclasses.dataclass
class _Run:
    """What every step of one `train_steps` call uses: the wrapped chunks and what drives them."""

    chunks: list
    optimizer: Any
    captured: Dict[str, tuple]
    recorder: Any
    forward_step: Callable
    microbatch_losses: List[dict]
    num_microbatches: int


def _build_run(spec, topology, settings: TrainSettings) -> _Run:
    """Build the model (DDP-wrapped like `get_model`), its optimizer and the step's recorders."""
    from megatron.core import parallel_state

    from megatron_lora_patch.proof.testbed.models import build_model

    # A spec that builds its own model (testbed.args_model: the user's architecture) does so.
    builder = getattr(spec, "build_model", None)
    if builder and settings.model_config:
        raise ValueError("TrainSettings.model_config applies to testbed specs, not to a spec that builds its own model")
    chunks = (
        builder(topology, settings.seed) if builder
        else build_model(spec, topology, seed=settings.seed, **settings.model_config)
    )
    if settings.on_model_built is not None:
        settings.on_model_built(chunks)
    chunks = wrap_like_get_model(chunks, settings)
    optimizer = build_optimizer(chunks, settings)
    config = chunks[0].config
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = resolve_finalize(settings.finalize_model_grads_func)
    set_sync_callbacks(config, chunks, settings)
    losses: List[dict] = []
    return _Run(
        chunks=chunks,
        optimizer=optimizer,
        captured=captured_params(chunks, settings.capture.params),
        recorder=ForwardRecorder(_single_chunk(chunks), settings.capture.forward),
        forward_step=recording_losses(forward_step_for(settings.loss_variant), losses),
        microbatch_losses=losses,
        num_microbatches=testing_data.num_microbatches_for(
            settings.global_batch_size, settings.micro_batch_size, parallel_state.get_data_parallel_world_size()
        ),
    )


def _synced_params(run: _Run, settings: TrainSettings) -> dict:
    """The captured params after the step. With `overlap_param_gather` the step leaves the other DP ranks'
    updated shards to the next forward's pre-hooks; gather them now, as Megatron-LM does before a save."""
    if settings.overlap_param_gather:
        prepare = getattr(run.optimizer, "prepare_model_params_for_param_sync", None)
        if prepare is not None:
            prepare()
        for chunk in run.chunks:
            chunk.start_param_sync(force_sync=True)
    return {name: to_cpu(param) for name, (param, _) in run.captured.items()}


def _train_step(run: _Run, spec, settings: TrainSettings, step: int, global_batch: testing_data.Batch) -> dict:
    """One optimizer step on this DP rank's microbatches of `global_batch`; the step's record."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    microbatches = testing_data.dp_rank_microbatches(global_batch, dp_rank, dp_size, settings.micro_batch_size)
    run.microbatch_losses.clear()
    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=run.forward_step,
        data_iterator=iter(microbatches),
        model=run.chunks,
        num_microbatches=run.num_microbatches,
        seq_length=spec.seq_length,
        micro_batch_size=settings.micro_batch_size,
        decoder_seq_length=spec.seq_length,
        forward_only=False,
    )
    if settings.use_distributed_optimizer and run.captured:
        distributed_optimizer.gather_reduced_grads(run.chunks)
    # Clone now: the optimizer clips these very tensors in place.
    grads = {name: to_cpu(grad_of(param)) for name, (param, _) in run.captured.items()}
    update_successful, grad_norm, _ = run.optimizer.step()
    keep_params = step == settings.steps - 1 or settings.capture.params_every_step
    return {
        "microbatches": list(run.microbatch_losses),
        "lm_loss": reduced_lm_loss(reports),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "update_successful": bool(update_successful),
        "grads": grads,
        "params": _synced_params(run, settings) if keep_params else {},
        "forward": run.recorder.take(),
        "extra": {},
    }
