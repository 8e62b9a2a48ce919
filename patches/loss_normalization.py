"""`loss_normalization`: the step loss is summed loss / GLOBAL trainable-token count (docs/architecture.md section 5).

Megatron-Core does this when `config.calculate_per_token_loss` is on (the schedule keeps each
microbatch's loss a SUM, `finalize_model_grads` divides by the count all-reduced over DP x CP, DDP
sums); off (the default), each rank divides by its own token count and DDP averages over DP: a mean
of per-rank means, wrong whenever ranks or microbatches hold different numbers of trainable tokens.
What it changes (it turns the mode on as early as possible and checks each loss function's result
against that contract):
- `TransformerConfig.__post_init__` sets `calculate_per_token_loss = True` (MoE routers read it
  when they are built);
- `DistributedDataParallel.__init__` does the same for a config built before the patch and
  turns off `ddp_config.average_in_collective` (the collective must SUM);
- the schedule's loss step (`forward_step_calc_loss` from 0.14, `forward_step` in 0.13)
  checks each loss function's result: a legacy 2-tuple `(mean, report)` raises (strict) or
  warns once and reproduces Megatron's own legacy mean-of-means gradients, never silently
  summed over DP; a step whose config still has per-token loss off is reported the same way.
The reported loss is untouched.

Each `patch_*` function is the hook for one Megatron module; torch / Megatron are imported
inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types

from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime import registry
from megatron_lora_patch.runtime.patching import Patcher, PatchSpec

log = logging.getLogger(__name__)

LEGACY_LOSS = (
    "the loss function returned the legacy 2-tuple (pre-normalized mean, report): averaging per microbatch "
    "and per rank weights tokens by how many share their microbatch (a mean of means), so no reduction "
    "afterwards can recover the global token mean. Fix: return (sum of per-token losses * loss_mask, "
    "number of trainable tokens as an int tensor, report), as Megatron-LM's pretrain_gpt.py loss_func does"
)
LEGACY_FALLBACK = "; this run keeps Megatron's legacy mean-of-means gradients"
CONFIG_BEFORE_PATCH = (
    "a training step runs with config.calculate_per_token_loss off: the model config and DDP were built "
    "before the loss_normalization patch was applied, so the loss stays a mean of per-rank means. Fix: "
    "apply megatron_lora_patch (MEGATRON_PLUGINS=lora_correct) before building the config and DDP, or set "
    "calculate_per_token_loss=True in the TransformerConfig and average_in_collective=False in the DDP config"
)


# -- config and DDP ------------------------------------------------------------------------


def _per_token_after_post_init(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    instance.calculate_per_token_loss = True
    return result


def patch_transformer_config(patcher: Patcher, module: types.ModuleType) -> None:
    """Every new config has per-token loss on (MoE routers read it when they are built)."""
    patcher.wrap(module.TransformerConfig, "__post_init__", _per_token_after_post_init)


def _per_token_before_ddp(wrapped, instance, args, kwargs):
    """Per-token loss needs the DP collective to SUM (finalize divides by the global count)."""
    config = args[0] if args else kwargs["config"]
    ddp_config = args[1] if len(args) > 1 else kwargs["ddp_config"]
    if not config.calculate_per_token_loss:
        config.calculate_per_token_loss = True
        if getattr(config, "num_moe_experts", None):
            registry.warn_once(
                "late-config",
                "calculate_per_token_loss turned on at DDP construction: the config was built before the "
                "loss_normalization patch, so MoE routers built from it keep the per-microbatch aux-loss scaling",
            )
    if ddp_config.average_in_collective:
        log.info("megatron-lora-patch: average_in_collective turned off (per-token loss sums over DP)")
        ddp_config.average_in_collective = False
    return wrapped(*args, **kwargs)


def patch_ddp(patcher: Patcher, module: types.ModuleType) -> None:
    """A config built before the patch gets per-token loss at DDP construction; DP SUMs."""
    patcher.wrap(module.DistributedDataParallel, "__init__", _per_token_before_ddp)


# -- loss contract -------------------------------------------------------------------------


def _context_parallel_size(explicit) -> int:
    if explicit is not None:
        return int(explicit)
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def guard_loss_func(loss_func, config, cp_group_size=None):
    """Wrap one microbatch's loss function so its result is checked against the per-token contract."""
    if loss_func is None:
        return None

    @functools.wraps(loss_func)
    def checked_loss_func(output_tensor, *args, **kwargs):
        outputs = loss_func(output_tensor, *args, **kwargs)
        if kwargs.get("non_loss_data") or len(outputs) != 2:
            return outputs
        if not config.calculate_per_token_loss:  # Megatron's own legacy path runs; it is a mean of means
            registry.report_problem("legacy-loss", LEGACY_LOSS)
            return outputs
        registry.report_problem("legacy-loss", LEGACY_LOSS, LEGACY_FALLBACK)
        import torch

        mean, report = outputs
        # finalize divides by sum over DP x CP of one token per microbatch = microbatches * DP * CP;
        # the legacy path divides by microbatches * DP after multiplying by CP: same gradients.
        one_token = torch.ones((), dtype=torch.int, device=mean.device)
        return mean * _context_parallel_size(cp_group_size), one_token, report

    return checked_loss_func


def _check_config(config) -> None:
    if not config.calculate_per_token_loss:
        registry.report_problem("config-before-patch", CONFIG_BEFORE_PATCH)


def patch_schedules(patcher: Patcher, schedules: types.ModuleType) -> None:
    """0.14+: the loss function is an argument of forward_step_calc_loss (also used by combined
    1F1B); 0.13: forward_step gets it from forward_step_func's result."""
    if hasattr(schedules, "forward_step_calc_loss"):
        signature = inspect.signature(schedules.forward_step_calc_loss)

        def guard_calc_loss(wrapped, instance, args, kwargs):
            bound = signature.bind(*args, **kwargs)
            config = bound.arguments["config"]
            _check_config(config)
            bound.arguments["loss_func"] = guard_loss_func(
                bound.arguments["loss_func"], config, bound.arguments.get("cp_group_size")
            )
            return wrapped(*bound.args, **bound.kwargs)

        patcher.wrap(schedules, "forward_step_calc_loss", guard_calc_loss)
        return

    signature = inspect.signature(schedules.forward_step)

    def guard_forward_step(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        config = bound.arguments["config"]
        _check_config(config)
        forward_step_func = bound.arguments["forward_step_func"]

        @functools.wraps(forward_step_func)
        def guarded_forward_step_func(*step_args, **step_kwargs):
            output_tensor, loss_func = forward_step_func(*step_args, **step_kwargs)
            return output_tensor, guard_loss_func(loss_func, config)

        bound.arguments["forward_step_func"] = guarded_forward_step_func
        return wrapped(*bound.args, **bound.kwargs)

    patcher.wrap(schedules, "forward_step", guard_forward_step)


SPEC = PatchSpec(
    name="loss_normalization",
    summary="global token normalization: calculate_per_token_loss on before DDP is built, "
    "legacy 2-tuple loss functions detected at the first microbatch",
    hooks={
        "megatron.core.transformer.transformer_config": patch_transformer_config,
        "megatron.core.distributed.distributed_data_parallel": patch_ddp,
        "megatron.core.pipeline_parallel.schedules": patch_schedules,
    },
    versions=tested_range(),
    default=True,
)
