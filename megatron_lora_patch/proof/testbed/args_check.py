"""What Megatron-LM would refuse in the user's arguments, said before any rank starts (docs/fail-closed.md,
"preflight"): an argument `pretrain_gpt.py` does not know (its parser is strict; a misspelled
`--sequence-paralel` ignored would check another topology), and a width Megatron splits over TP that the
TP size does not divide (Megatron asserts it only when a rank builds the layer: "800 is not divisible by 3").
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Sequence

from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.flags import closest

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<arguments>.+)$")


def rejection(line: str, parsers: Sequence[argparse.ArgumentParser]) -> str:
    """Megatron-LM's error `line`, with a "did you mean" for an unrecognized option close to one it knows."""
    match = _UNRECOGNIZED.search(line)
    if match is None or not parsers:
        return f"Megatron-LM rejects the arguments: {line}"
    unknown = next((item for item in match.group("arguments").split() if item.startswith("--")), None)
    options = [option for option in parsers[-1]._option_string_actions if option.startswith("--")]
    suggestion = closest(unknown, options) if unknown else None
    hint = f"did you mean {suggestion}?" if suggestion else "leave out the arguments your own script adds"
    return f"Megatron-LM rejects the arguments: {line}; {hint}"


def check_widths(spec: Any, topology: Any) -> None:
    """Every width a TP (expert: ETP) group splits is a multiple of its size, as Megatron's `divide` asserts."""
    args, kinds = spec.args, set(spec.kinds)
    tp, etp = topology.tp, getattr(topology, "etp", 1)
    widths = []
    if kinds & {"dense", "mlp"}:  # a dense MLP (GPT) or MLP layer (hybrid)
        widths.append(("--ffn-hidden-size", args.ffn_hidden_size, tp, "--tensor-model-parallel-size"))
    if "moe" in kinds:
        widths.append(("--moe-ffn-hidden-size", args.moe_ffn_hidden_size or args.ffn_hidden_size, etp,
                       "--expert-tensor-parallel-size"))
        if args.moe_shared_expert_intermediate_size:
            widths.append(("--moe-shared-expert-intermediate-size", args.moe_shared_expert_intermediate_size, tp,
                           "--tensor-model-parallel-size"))
    for option, width, size, parallel in widths:
        if width and width % size:
            raise UsageError(
                f"Megatron-Core rejects this model: {option} {width} is not divisible by {parallel} {size} "
                "(its linears are split over those ranks); choose sizes that divide"
            )


def failure_reason(error: BaseException) -> str:
    """The error's message, or the failing check's source line for a bare `assert`."""
    import traceback

    text = str(error).strip()
    if text:
        return text
    frames = traceback.extract_tb(error.__traceback__)
    return f"failed check `{frames[-1].line}`" if frames and frames[-1].line else type(error).__name__
