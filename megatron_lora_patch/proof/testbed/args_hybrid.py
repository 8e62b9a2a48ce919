"""The user's hybrid model (`--hybrid-layer-pattern`) for the preflight: its layer kinds, the pattern
kept after the depth cut, and the `HybridModel` built from it (docs/architecture.md section 8, the proof; section 9,
Megatron-Core on CPU).

Megatron-LM's `validate_args` parses the pattern (`|` pipeline stage boundaries, `/` MTP depths)
and sets `--num-layers` from it; here each layer of the main pattern becomes a kind (`*`
attention, `-` MLP, `E` MoE), `args_model.scaled_kinds` keeps the fewest layers holding every
kind (a multiple of the pipeline size) and `kept_pattern` writes them back as a pattern with a
`|` at each stage boundary. Layers the preflight cannot build stop with one UsageError line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
from typing import Any, List, Sequence

from megatron_lora_patch.runtime.errors import UsageError

#: Pattern symbol -> layer kind, for the layers the preflight builds (Megatron's `Symbols`).
KINDS = {"*": "attention", "-": "mlp", "E": "moe"}
SYMBOLS = {kind: symbol for symbol, kind in KINDS.items()}
#: Layers whose mixers live in megatron.core.ssm: (name, the CUDA / Triton kernels they need).
SSM_LAYERS = {"M": ("Mamba", "mamba_ssm, causal_conv1d"), "G": ("gated delta net", "fla")}
#: Layers the preflight's CPU build has no local spec for (Megatron's hybrid spec is TE-only there).
NO_LOCAL_SPEC = {"+": "multi-latent attention", "D": "DeepSeek sparse attention"}


def hybrid_layer_kinds(args: argparse.Namespace) -> List[str]:
    """The kind of every layer of the user's main pattern (pipes dropped), or one UsageError line."""
    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        raise UsageError(
            "preflight builds --hybrid-layer-pattern models as Megatron-Core's HybridModel, which needs "
            "megatron-core >= 0.18; upgrade megatron-core, or drop --hybrid-layer-pattern to check a GPT model"
        )
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    pattern = args.hybrid_layer_pattern
    parsed = parse_hybrid_pattern(pattern)
    if parsed.mtp_pattern:
        raise UsageError(
            f"preflight does not support multi-token prediction layers yet: drop the MTP part "
            f"('/{parsed.mtp_pattern}...') of --hybrid-layer-pattern for the preflight"
        )
    layers = (parsed.main_pattern or "").replace(Symbols.PIPE, "")
    _refuse_unbuildable(pattern, layers)
    return [KINDS[symbol] for symbol in layers]


def _refuse_unbuildable(pattern: str, layers: str) -> None:
    """One UsageError for layers the CPU build has no modules for; the fix names the pattern that can run."""
    ssm = [symbol for symbol in SSM_LAYERS if symbol in layers]
    if ssm:
        named = " and ".join(f"{SSM_LAYERS[symbol][0]} ({symbol})" for symbol in ssm)
        kernels = ", ".join(SSM_LAYERS[symbol][1] for symbol in ssm)
        rest = "".join(symbol for symbol in layers if symbol not in SSM_LAYERS)
        fix = (
            f"check the attention / MLP / MoE layers it adapts with --hybrid-layer-pattern '{rest}' (yours without "
            f"{', '.join(ssm)})"
            if rest
            else "your pattern has no attention / MLP / MoE layer for LoRA to adapt"
        )
        raise UsageError(
            f"preflight cannot build the {named} layers of --hybrid-layer-pattern '{pattern}': its ranks run on CPU, "
            f"where their mixers' kernels ({kernels}) do not run, and LoRA does not adapt mixer linears (it refuses "
            f"them as targets); {fix}"
        )
    other = [symbol for symbol in NO_LOCAL_SPEC if symbol in layers]
    if other:
        named = ", ".join(f"{NO_LOCAL_SPEC[symbol]} ({symbol})" for symbol in other)
        raise UsageError(
            f"preflight does not support {named} layers in --hybrid-layer-pattern yet: use '*' attention layers "
            "for the preflight"
        )


def kept_pattern(kinds: Sequence[str], pp: int) -> str:
    """The hybrid pattern of `kinds`, a `|` at each of the pp stage boundaries (Megatron's explicit layout)."""
    symbols = "".join(SYMBOLS[kind] for kind in kinds)
    per_stage = len(symbols) // pp
    return "|".join(symbols[start : start + per_stage] for start in range(0, len(symbols), per_stage))


def build_hybrid_model(spec: Any, args: argparse.Namespace, config: Any, gpt_layer_spec) -> Any:
    """This rank's HybridModel of `spec` (an `ArgsModelSpec`), built with the arguments Megatron-LM's
    `hybrid_config_from_args` / `HybridModelBuilder` pass; `gpt_layer_spec(num_experts)` gives the local
    GPT layer spec the CPU stack is cut from. Needs parallel_state."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_lora_patch.proof.testbed.hybrid_stack import local_final_norm, local_stack_spec

    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as stack_spec

        building = contextlib.nullcontext()
    else:
        moe = gpt_layer_spec(args.num_experts) if "moe" in spec.kinds else None
        stack_spec, building = local_stack_spec(gpt_layer_spec(None), moe, final_norm=True), local_final_norm(LNImpl)
    with building:
        return HybridModel(
            config=config,
            hybrid_stack_spec=stack_spec,
            hybrid_layer_pattern=args.hybrid_layer_pattern,
            seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
            **spec.model_arguments(args),
        )
