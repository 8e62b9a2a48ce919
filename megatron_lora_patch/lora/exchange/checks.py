"""Checks that a PEFT adapter fits this model's adapters: its config (LoRA, DoRA as the model's, no bias, valid
patterns), the r and alpha each fused module gets, and the factor shapes; each refusal is one line
naming the module and the setting that would fit (docs/architecture.md section 4, "Layouts")."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

from megatron_lora_patch.lora.config import LoraConfig
from megatron_lora_patch.lora.exchange.names import Logical, PeftFormatError


def check_dora(config: dict, description: dict, where: str) -> None:
    """A PEFT adapter is DoRA (`use_dora`) exactly when the model's adapters are (`MEGATRON_LORA_DORA`), and
    DoRA only on modules (peft's `target_parameters`, the experts, have no DoRA)."""
    use_dora, dora = bool(config.get("use_dora")), bool(description.get("dora"))
    if use_dora != dora:
        raise PeftFormatError(
            f"{where}: use_dora={str(use_dora).lower()} but the model's adapters {'' if dora else 'do not '}use DoRA;"
            f" build them with MEGATRON_LORA_DORA={int(use_dora)}"
        )
    if use_dora and config.get("target_parameters"):
        raise PeftFormatError(f"{where}: DoRA on target_parameters (MoE experts) is not supported (peft has none "
                              "either); export the experts without DoRA or drop them from the adapter")


def check_config(config: dict, description: dict, where: str) -> None:
    if config.get("peft_type") != "LORA":
        raise PeftFormatError(f"{where}: peft_type is {config.get('peft_type')!r}, only 'LORA' is supported")
    if config.get("fan_in_fan_out"):
        raise PeftFormatError(f"{where}: fan_in_fan_out=true is not supported by Megatron LoRA adapters")
    check_dora(config, description, where)
    if config.get("bias", "none") != "none":
        raise PeftFormatError(f"{where}: bias={config['bias']!r} is not supported (LoRA adapters have no bias)")
    rslora = bool(config.get("use_rslora"))
    if rslora != LoraConfig.from_description(description).rslora:
        raise PeftFormatError(
            f"{where}: use_rslora={str(rslora).lower()} but the model's adapters {'do not ' if rslora else ''}use "
            f"rsLoRA; build them with MEGATRON_LORA_RSLORA={int(rslora)}"
        )
    for field, value in (("r", config.get("r")), ("lora_alpha", config.get("lora_alpha"))):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise PeftFormatError(f"{where}: {field}={value!r} is not a positive number")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) for v in pattern.values()):
            raise PeftFormatError(f"{where}: {field} must map module patterns to numbers, got {pattern!r}")
        for key in pattern:
            try:
                re.compile(key)
            except re.error as error:
                raise PeftFormatError(f"{where}: {field} key {key!r} is not a valid regex: {error}") from None


def peft_pattern_value(pattern: Dict[str, Any], path: str, default: Any) -> Any:
    """PEFT's per-module value: the first key whose regex matches the end of `path` at a name boundary."""
    key = next((key for key in pattern if re.match(rf"(.*\.)?({key})$", path)), None)
    return default if key is None else pattern[key]


def check_declared_rank(config: dict, path: str, lora_a: Any, where: str, experts: int = 1) -> None:
    """The r the adapter's config gives `path` (`r` or its `rank_pattern`) is the rank of its lora_A (`experts`
    ranks packed in it). Checked before the model's rank: otherwise a config that lies about its tensors is
    answered with advice to build the model at the config's r, which the shapes then refuse."""
    declared = peft_pattern_value(config.get("rank_pattern") or {}, path, config["r"])
    rows = lora_a.shape[0] if lora_a.dim() == 2 else None  # another shape: the shape checks name it
    if rows is not None and rows % experts == 0 and rows != experts * declared:
        field = "rank_pattern" if config.get("rank_pattern") and declared != config["r"] else "r"
        raise PeftFormatError(
            f"{where}: adapter_config.json gives {path} r={declared} but its lora_A has rank {rows // experts} "
            f"(shape {tuple(lora_a.shape)}); the config does not describe its tensors: correct {field} there "
            "or export the adapter again"
        )


def check_scaling(config: dict, description: dict, name: str, paths: List[str], where: str) -> None:
    """The PEFT r and alpha of `paths` (the projections of Megatron `name`) are the model's for `name`."""
    ranks = [peft_pattern_value(config.get("rank_pattern") or {}, path, config["r"]) for path in paths]
    alphas = [peft_pattern_value(config.get("alpha_pattern") or {}, path, config["lora_alpha"]) for path in paths]
    for values, field in ((ranks, "r"), (alphas, "lora_alpha")):
        if len({float(value) for value in values}) > 1:
            raise PeftFormatError(
                f"{where}: {paths} have {field} {values}; the fused Megatron {name} has one adapter for all its "
                "projections, so this adapter cannot be expressed"
            )
    model = LoraConfig.from_description(description)
    for field, pattern_field, value, want, noun in (
        ("r", "rank_pattern", ranks[0], model.rank_for(name), "rank"),
        ("lora_alpha", "alpha_pattern", alphas[0], model.alpha_for(name), "alpha"),
    ):
        if float(value) != float(want):
            pattern = config.get(pattern_field)
            fix = (
                f"MEGATRON_LORA_{pattern_field.upper()} matching {pattern_field} {pattern}"
                if pattern
                else f"MEGATRON_LORA_{noun.upper()}={value}"
            )
            raise PeftFormatError(
                f"{where}: {field}={value} for {paths[0]} but the model's adapter {name} has {noun} {want}; "
                f"build them with {fix}"
            )


def check_shapes(logical: Logical, shapes: Dict[str, Tuple[tuple, tuple]], where: str) -> None:
    """Every logical factor has the model's shape for it (`shapes`: name -> (A shape, B shape))."""
    for name, (lora_a, lora_b) in logical.items():
        want_a, want_b = shapes[name]
        if tuple(lora_a.shape) != tuple(want_a) or tuple(lora_b.shape) != tuple(want_b):
            raise PeftFormatError(
                f"{where}: Megatron {name} needs A {tuple(want_a)} and B {tuple(want_b)}, the adapter gives "
                f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}"
            )
