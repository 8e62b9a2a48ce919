"""The adapter I/O calls every rank makes together agree first: `save_adapters`, `load_adapters`, `import_peft`.

Each is collective over the world (a distributed checkpoint's save or load, an all-gather of the adapted names). A
rank that never calls, passes another path, or refuses the call where the others do not (a directory only its node
sees, a file it cannot read) would leave the others waiting in the collective until the process group's timeout
(10 to 30 minutes), with nothing naming the cause. Each runs its argument checks, then agrees with the other ranks on
the call, its arguments and every rank's checks (`runtime.agreement.agree_after`: the store, a bounded wait) before
its first collective. The n-th call of any of them on each rank is one collective call (docs/checkpoints.md).
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

from megatron_lora_patch.runtime import agreement

CALLS = ("save_adapters", "load_adapters", "import_peft")
_Result = TypeVar("_Result")


def agreed(call: str, arguments: Mapping[str, object], timeout: float, check: Callable[[], _Result]) -> _Result:
    """`check()` on this rank, then the agreement with every rank on (`call`, `arguments`, each rank's checks); returns
    what `check` returned, else the refusal (the same line on every rank present)."""

    def fix(field: str) -> str:
        if field == "call":
            return f"call the same function ({', '.join(CALLS)})"
        if field == agreement.CHECKS:
            return "see the same files there (a filesystem every rank shares) and build the same model"
        return f"pass the same {field} to {call}"

    return agreement.agree_after(
        agreement.Call(call, "adapter_io", {"call": call, **arguments}, fix), timeout, check
    )
