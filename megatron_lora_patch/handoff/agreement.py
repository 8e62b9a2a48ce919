"""Before a hand-off moves anything, every rank agrees on the call: same function, `dst` and family, all present.

`adapter_state` / `stream` are collective. Ranks that pass different `dst` (each would wait for sends meant
for another rank), or a rank that never calls, would block every other rank in the metadata exchange until
the process group's timeout (10 to 30 minutes), with nothing naming the cause. `agree` runs first, on the
world's rendezvous store (no collective, so it needs no backend and cannot hang): each rank posts its
arguments under the call's key (the n-th hand-off call of each rank), counts itself in, and waits at most
`timeout` seconds for the others. A mismatch is then the same one line on every rank; a rank missing at the
deadline is named by the ranks that waited, and a rank arriving after they gave up learns so at once
(the arrival counter is closed atomically, so a late rank never enters a collective the others left).
docs/handoff.md section 1.
"""

from __future__ import annotations

import datetime
import itertools
import json
from typing import List, Optional

from megatron_lora_patch.runtime.errors import UsageError

#: How long a rank waits for the others to call the same hand-off (seconds) unless the caller says otherwise.
DEFAULT_TIMEOUT_S = 300.0
_PREFIX = "megatron_lora_patch/handoff"
_CLOSED = 1 << 40  # added to the arrival count by a rank that stops waiting: later arrivals see it
_calls = itertools.count(1)  # this rank's hand-off calls; the n-th call of every rank is one collective call


class HandoffCallError(UsageError, RuntimeError):
    """The ranks did not make the same hand-off call (different arguments, or a rank absent); one line."""


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _disagreement(call: str, posts: List[dict]) -> Optional[str]:
    """The first field the ranks' posts differ in, as the one-line refusal; None when they agree."""
    for field in ("call", "dst", "family"):
        values = [post[field] for post in posts]
        if len(set(map(repr, values))) > 1:
            seen = ", ".join(f"rank {rank}: {value!r}" for rank, value in enumerate(values))
            fix = ("call the same hand-off function (handoff.adapter_state or handoff.stream)" if field == "call"
                   else f"pass the same {field} to handoff.{call}")
            return f"handoff.{call}: the ranks disagree on {field} ({seen}); it is collective: every rank must {fix}"
    return None


def _absent(call: str, store, keys: List[str], timeout: float, me: int) -> str:
    """The refusal of a rank that waited `timeout` seconds: the ranks that never posted."""
    missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
    return (f"handoff.{call}: {_ranks(missing or [me])} did not call it within {timeout:g} s of rank {me}; it is "
            "collective: call it on every rank of the world (or pass a larger timeout if a rank is only late)")


def agree(call: str, dst: int, family: Optional[str], timeout: float) -> None:
    """Return once every rank made this same call (`call`, `dst`, `family`); else a one-line `HandoffCallError`
    on each rank (every rank present: the same line on all). World size 1 or no process group: nothing to agree."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not 0 < timeout < float("inf"):
        raise HandoffCallError(f"handoff.{call}: timeout must be a positive number of seconds, got {timeout!r}")
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    me, world = dist.get_rank(), dist.get_world_size()
    store, prefix = distributed_c10d._get_default_store(), f"{_PREFIX}/{next(_calls)}"
    keys = [f"{prefix}/args/{rank}" for rank in range(world)]
    store.set(keys[me], json.dumps({"call": call, "dst": dst, "family": family}))
    arrived = store.add(f"{prefix}/arrived", 1)
    if arrived > _CLOSED:
        raise HandoffCallError(f"handoff.{call}: the other ranks stopped waiting for rank {me} after their timeout; "
                               "call it on every rank at the same point (or pass a larger timeout)")
    if arrived == world:
        store.set(f"{prefix}/complete", "1")
    else:
        try:
            store.wait([f"{prefix}/complete"], datetime.timedelta(seconds=timeout))
        except RuntimeError:  # DistStoreError: the deadline passed; close the call unless the last rank just came
            if store.add(f"{prefix}/arrived", _CLOSED) % _CLOSED < world:
                raise HandoffCallError(_absent(call, store, keys, timeout, me)) from None
    problem = _disagreement(call, [json.loads(store.get(key)) for key in keys])
    if problem:
        raise HandoffCallError(problem)
