"""LoRA+ (PEFT's `loraplus_lr_ratio`, `LoraConfig.plus_ratio`): every LoRA B learns at `ratio` times A's rate.

Through Megatron's own parameter-group overrides, so its learning-rate scheduler, the plain and the
distributed optimizer and their checkpoints carry the ratio like any other group setting:
- Megatron-Core 0.16+ (`get_megatron_optimizer(config_overrides=...)`): one more `ParamKey` whose
  predicate selects the B factors, overriding `max_lr` and `min_lr` (the scheduler's bounds: warm-up and
  decay scale with them) and `lr` (the rate before a scheduler's first step, and the rate of a loop
  without one) by the ratio. The caller's overrides (None: Megatron's standard ones) are kept; one that
  also sets a learning rate on a B factor (decoupled lr, MuP) stops with one line, as the two cannot
  both hold.
- 0.13-0.15 (`scale_lr_cond` / `lr_mult`): `scale_lr_cond` selects the B factors, `lr_mult` is the
  ratio (the scheduler multiplies every rate it sets by it); the groups' starting `lr` is multiplied
  likewise. A caller's own non-trivial `scale_lr_cond` stops with one line.
The group's settings are part of the optimizer's state dict, so a resumed run gets them back: a checkpoint's
groups are matched to the optimizer's by `lr_mult` (among others) on 0.13-0.18, so the B group carries
`lr_mult` = ratio on 0.16+ too (where no scheduler reads it), and by `max_lr` / `min_lr` too on 0.19.
"""

from __future__ import annotations

import inspect
from typing import Any

from megatron_lora_patch.lora.adapters.metadata import adapter_info
from megatron_lora_patch.runtime.errors import UsageError

LR_KEYS = ("lr", "max_lr", "min_lr")


def is_plus_factor(param: Any) -> bool:
    """The factors LoRA+ speeds up: every B (PEFT's `create_loraplus_optimizer` puts `lora_B` in its fast group)."""
    info = adapter_info(param)
    return info is not None and info.factor == "B"


def _is_plus_factor_now(param: Any) -> bool:
    """`is_plus_factor`, looked up at call time (an oracle mutation swaps it)."""
    return is_plus_factor(param)


def _scale_lr_cond(name: str, param: Any) -> bool:
    """`scale_lr_cond` of Megatron-Core 0.13-0.15."""
    return _is_plus_factor_now(param)


def build_optimizer(wrapped, args: tuple, kwargs: dict, ratio: float, label: str):
    """`get_megatron_optimizer(*args, **kwargs)` with the B factors at `ratio` times the learning rate;
    `label` names the setting in error messages (`MEGATRON_LORA_PLUS_RATIO`, `LoraConfig.plus_ratio`)."""
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    if "config_overrides" in arguments:
        arguments["config_overrides"] = _with_override(arguments, ratio, label)
        return wrapped(*bound.args, **bound.kwargs)
    if arguments["scale_lr_cond"] is not None and arguments["lr_mult"] != 1.0:
        raise UsageError(
            f"{label}={ratio:g} (LoRA+) needs get_megatron_optimizer's scale_lr_cond / lr_mult, which the caller "
            f"already uses (lr_mult={arguments['lr_mult']:g}); unset {label} or drop the caller's scale_lr_cond"
        )
    arguments["scale_lr_cond"], arguments["lr_mult"] = _scale_lr_cond, ratio
    optimizer = wrapped(*bound.args, **bound.kwargs)
    for group in optimizer.param_groups:  # the scheduler multiplies by lr_mult; the starting rate must too
        group["lr"] = group["lr"] * group.get("lr_mult", 1.0)
    return optimizer


def _with_override(arguments: dict, ratio: float, label: str) -> dict:
    """The caller's overrides (None: Megatron's standard ones) plus the B factors' scaled rates."""
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamPredicate

    config = arguments["config"]
    given = arguments["config_overrides"]
    overrides = dict(get_standard_config_overrides(config) if given is None else given)
    _refuse_other_lr_overrides(overrides, arguments["model_chunks"], ratio, label)
    # lr_mult: no scheduler of 0.16+ reads it, but 0.16-0.18 match a checkpoint's groups to the optimizer's by
    # (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) only: without it the B group would take A's rates
    # on resume (or A the B group's); 0.19 matches by max_lr / min_lr too.
    scaled = {"lr": ratio * config.lr, "max_lr": ratio * config.lr, "lr_mult": ratio}
    if config.min_lr is not None:
        scaled["min_lr"] = ratio * config.min_lr
    overrides[ParamKey(predicate=ParamPredicate(name="lora_plus_b_factor", fn=_is_plus_factor_now))] = scaled
    return overrides


def _refuse_other_lr_overrides(overrides: dict, model_chunks, ratio: float, label: str) -> None:
    """One line when another override sets a learning rate on a B factor (Megatron would raise a conflict
    deep inside the optimizer build, or, for equal values, silently drop the ratio)."""
    setting = [(key, sorted(k for k in value if k in LR_KEYS)) for key, value in overrides.items()]
    setting = [(key, keys) for key, keys in setting if keys]
    if not setting:
        return
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not (param.requires_grad and is_plus_factor(param)):
                continue
            for key, keys in setting:
                if key.matches(param, name):
                    raise UsageError(
                        f"{label}={ratio:g} (LoRA+) sets the learning rate of LoRA B factors, but a "
                        f"config_overrides entry also sets {', '.join(keys)} on {name}; unset {label} or "
                        "leave the LoRA factors out of that override"
                    )
