"""Rank-side LoRA+ (`LoraConfig.plus_ratio`, the `lora_plus` patch): one Adam step per ratio, a learning-rate
schedule, and a save / resume of model + optimizer through Megatron's distributed checkpointing.

Models, DDP wrapping, data and the step are the testing driver's and `resume_worker`'s; the optimizer is built
by Megatron's `get_megatron_optimizer` with a cosine schedule from `MAX_LR` down to `MIN_LR`.
"""

from __future__ import annotations

import persistence_worker
import resume_worker

PATCHES = resume_worker.TRAINING_PATCHES + ("lora_plus",)
MAX_LR, MIN_LR, DECAY_STEPS = 1e-2, 1e-3, 4


def _build(spec, topology, ratio: float, distributed: bool, lora_seed: int = 5):
    """(chunks, optimizer, scheduler) of a fresh model whose B factors learn at `ratio` x A's rate."""
    import dataclasses

    persistence_worker.setup(persistence_worker.lora_config(lora_seed, plus_ratio=ratio), PATCHES)
    # Imported after the patches applied, as a user's script imports Megatron after the plugin activated.
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_lora_patch.proof.testbed import model_setup
    from megatron_lora_patch.proof.testbed.models import build_model

    settings = dataclasses.replace(resume_worker.SETTINGS, use_distributed_optimizer=distributed)
    chunks = model_setup.wrap_like_get_model(build_model(spec, topology, seed=settings.seed), settings)
    optimizer = get_megatron_optimizer(_optimizer_config(chunks, distributed), chunks)
    chunks[0].config.grad_scale_func = optimizer.scale_loss
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=0, lr_decay_steps=DECAY_STEPS,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=DECAY_STEPS, wd_incr_style="constant",
    )
    return chunks, optimizer, scheduler


def _optimizer_config(chunks, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=MAX_LR, min_lr=MIN_LR, weight_decay=0.01, clip_grad=1.0, bf16=False, fp16=False,
        params_dtype=chunks[0].config.params_dtype, use_distributed_optimizer=distributed,
    )


def _group_lrs(optimizer) -> list:
    """The learning rates of the groups that hold parameters on this rank, sorted."""
    return sorted(group["lr"] for group in optimizer.param_groups if group["params"])


def _refusal(chunks, distributed: bool) -> str:
    """The one line that stops a build where the caller's own overrides also set B's learning rate
    (`config_overrides` on 0.16+, `scale_lr_cond` / `lr_mult` on 0.13-0.15)."""
    import inspect

    from megatron.core import optimizer

    from megatron_lora_patch.runtime.errors import UsageError

    if "config_overrides" in inspect.signature(optimizer.get_megatron_optimizer).parameters:
        caller = {"config_overrides": {optimizer.ParamKey(name="*.lora.B"): {"max_lr": MAX_LR / 2}}}
    else:
        caller = {"scale_lr_cond": lambda name, param: name.endswith(".lora.B"), "lr_mult": 0.5}
    try:
        optimizer.get_megatron_optimizer(_optimizer_config(chunks, distributed), chunks, **caller)
    except UsageError as error:
        return str(error)
    return "built"


def deltas_world(rank: int, world: int, topology: str, spec, distributed: bool) -> dict:
    """Per ratio (1 and 4): the group learning rates at build and the local adapters before and after one step;
    then the refusal of a caller's learning-rate override on B."""
    from megatron_lora_patch.proof.testbed.topology import Topology

    parsed = Topology.parse(topology)
    record = {}
    with parsed.world(seed=resume_worker.SETTINGS.seed):
        for ratio in (1.0, 4.0):
            chunks, optimizer, _ = _build(spec, parsed, ratio, distributed)
            lrs = _group_lrs(optimizer)
            before = persistence_worker.local_adapters(chunks)
            resume_worker._train_step(chunks, optimizer, spec, 0)
            record[ratio] = {"lrs": lrs, "before": before, "after": persistence_worker.local_adapters(chunks)}
        record["refusal"] = _refusal(chunks, distributed)
    return record


def resume_world(rank: int, world: int, topology: str, spec, distributed: bool, directory: str) -> dict:
    """Ratio 4: step 0, a scheduler step, save (model, optimizer), step 1; then a model built from another seed
    loads the checkpoint and the scheduler's state and takes step 1 again. The group rates and adapters of both."""
    from megatron.core import dist_checkpointing

    from megatron_lora_patch.proof.testbed.topology import Topology

    parsed = Topology.parse(topology)
    with parsed.world(seed=resume_worker.SETTINGS.seed):
        chunks, optimizer, scheduler = _build(spec, parsed, 4.0, distributed)
        resume_worker._train_step(chunks, optimizer, spec, 0)
        scheduler.step(1)
        saved = {"lrs": _group_lrs(optimizer), "scheduler": scheduler.state_dict()}
        dist_checkpointing.save(resume_worker._state(chunks, optimizer, is_loading=False), directory)
        resume_worker._train_step(chunks, optimizer, spec, 1)
        saved["end"] = persistence_worker.local_adapters(chunks)

        chunks, optimizer, scheduler = _build(spec, parsed, 4.0, distributed, lora_seed=999)
        loaded = dist_checkpointing.load(resume_worker._state(chunks, optimizer, is_loading=True), directory)
        chunks[0].module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        resumed = {"lrs": _group_lrs(optimizer)}
        resume_worker._train_step(chunks, optimizer, spec, 1)
        resumed["end"] = persistence_worker.local_adapters(chunks)
    return {"saved": saved, "resumed": resumed}
