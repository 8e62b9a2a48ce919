"""Before a collective call moves anything, its ranks agree on it: the same call, the same arguments, all present.

A collective that ranks enter with different arguments (each waits for a peer's part that never comes), or that one
rank never enters, blocks the others until the process group's timeout (10 to 30 minutes) with nothing naming the
cause. `agree` runs first, on the world's rendezvous store (no collective, so it needs no backend and cannot hang):
each rank posts its fields under the call's key (the n-th call of its `namespace` among the same peers), counts itself
in, and waits at most `timeout` seconds for the others. A mismatch is then the same one line on every rank; a rank
missing at the deadline is named by the ranks that waited, and a rank arriving after they gave up learns so at once
(the arrival counter is closed atomically, so a late rank never enters a collective the others left). The store keeps
the keys of a group's last two calls only (`_forget`): a job agreeing every step would otherwise grow it for good.
Used by the hand-off (docs/handoff.md section 1), the DoRA merge (docs/configuration.md, DoRA) and the adapter I/O
calls (`lora/checkpoints/collective.py`, docs/checkpoints.md section 1).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from megatron_lora_patch.runtime.errors import UsageError

#: How long a rank waits for its peers to make the same call (seconds) unless the caller says otherwise.
DEFAULT_TIMEOUT_S = 300.0
_PREFIX = "megatron_lora_patch/agreement"
_CLOSED = 1 << 40  # added to the arrival count by a rank that stops waiting: later arrivals see it
_calls: Dict[Tuple[str, str], int] = collections.defaultdict(int)  # this rank's calls per (namespace, peers)
_complete: Dict[Tuple[str, str], int] = collections.defaultdict(int)  # the last of them every peer arrived at


CHECKS = "its checks"  # the field `agree_after` adds: each rank's refusal of the call, "passed" where none
_Result = TypeVar("_Result")


class CallAgreementError(UsageError, RuntimeError):
    """The ranks did not make the same collective call (different arguments, or a rank absent); one line."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One rank's collective call, as its refusals name it.

    `label`: the call as the user wrote it ("handoff.stream"); `namespace`: the calls counted together (the n-th
    call of a namespace on each peer is one collective call); `fields`: what every peer must pass alike, in the order
    they are checked; `fix(field)`: what the user must do about a mismatch there; `peers`: the global ranks that take
    part (None: the world), described in the refusals as `peers_text`; `error`: the UsageError subclass raised.
    """

    label: str
    namespace: str
    fields: Dict[str, object]
    fix: Callable[[str], str]
    peers: Optional[Sequence[int]] = None
    peers_text: str = "every rank of the world"
    error: type = CallAgreementError


def check_timeout(label: str, timeout: float, error: type = CallAgreementError) -> None:
    """A timeout that bounds nothing (0, negative, infinite, NaN) is refused before any rank waits."""
    if not 0 < timeout < float("inf"):
        raise error(f"{label}: timeout must be a positive number of seconds, got {timeout!r}")


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _disagreement(call: Call, peers: List[int], posts: List[dict]) -> Optional[str]:
    """The first field the peers' posts differ in, as the one-line refusal; None when they agree."""
    for field in call.fields:
        values = [post.get(field) for post in posts]
        if len(set(map(repr, values))) > 1:
            seen = ", ".join(f"rank {rank}: {value!r}" for rank, value in zip(peers, values))
            fix = call.fix(field)
            return f"{call.label}: the ranks disagree on {field} ({seen}); it is collective: every rank must {fix}"
    return None


def _absent(call: Call, store, keys: List[str], peers: List[int], timeout: float, me: int) -> str:
    """The refusal of a rank that waited `timeout` seconds: the peers that never posted."""
    missing = [rank for rank, key in zip(peers, keys) if not store.check([key])]
    return (f"{call.label}: {_ranks(missing or [me])} did not call it within {timeout:g} s of rank {me}; it is "
            f"collective: call it on {call.peers_text} (or pass a larger timeout if a rank is only late)")


def _read_all(store, keys: List[str]) -> list:
    """Every peer's post in one store request (`multi_get`): one request per rank, not one per peer, so a world of
    hundreds of ranks does not send the store world-squared requests."""
    if hasattr(store, "multi_get"):
        return store.multi_get(keys)
    return [store.get(key) for key in keys]  # a torch without multi_get


def group_key(peers: List[int]) -> str:
    """The peers' part of a call's store keys: their count and a digest, not the list. Each rank reads every peer's
    key, so a 256-rank group's keys naming all 256 ranks (963 bytes each) made every call move 68 MB through the
    store's host; with the digest (70 bytes) 9.5 MB."""
    return f"{len(peers)}-{hashlib.sha1(json.dumps(peers).encode()).hexdigest()[:16]}"


def _forget(store, prefix: str, me: int, peers: List[int]) -> None:
    """Delete this rank's post of an earlier call (the first peer: its counters too), so that a job agreeing every
    step (an RL loop's hand-off) keeps two calls' keys on the store, not all of them. Only called for the call before
    the last complete one: every peer reached that complete call, so each had read the earlier call's posts."""
    if not hasattr(store, "delete_key"):
        return
    store.delete_key(f"{prefix}/args/{me}")
    if me == peers[0]:
        store.delete_key(f"{prefix}/arrived")
        store.delete_key(f"{prefix}/complete")


def agree(call: Call, timeout: float) -> None:
    """Return once every peer made this call with the same fields; else a one-line `call.error` on each rank (every
    peer present: the same line on all). One peer, or no process group: nothing to agree."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    check_timeout(call.label, timeout, call.error)
    if not dist.is_initialized():
        return
    me = dist.get_rank()
    peers = sorted(call.peers) if call.peers is not None else list(range(dist.get_world_size()))
    if len(peers) < 2:
        return
    group = group_key(peers)
    _calls[(call.namespace, group)] += 1
    number = _calls[(call.namespace, group)]
    store = distributed_c10d._get_default_store()
    if _complete[(call.namespace, group)] == number - 1 > 1:
        _forget(store, f"{_PREFIX}/{call.namespace}/{group}/{number - 2}", me, peers)
    prefix = f"{_PREFIX}/{call.namespace}/{group}/{number}"
    keys = [f"{prefix}/args/{rank}" for rank in peers]
    store.set(keys[peers.index(me)], json.dumps(call.fields))
    arrived = store.add(f"{prefix}/arrived", 1)
    if arrived > _CLOSED:
        raise call.error(f"{call.label}: the other ranks stopped waiting for rank {me} after their timeout; call it "
                         f"on {call.peers_text} at the same point (or pass a larger timeout)")
    if arrived == len(peers):
        store.set(f"{prefix}/complete", "1")
    else:
        try:
            store.wait([f"{prefix}/complete"], datetime.timedelta(seconds=timeout))
        except RuntimeError:  # DistStoreError: the deadline passed; close the call unless the last rank just came
            if store.add(f"{prefix}/arrived", _CLOSED) % _CLOSED < len(peers):
                raise call.error(_absent(call, store, keys, peers, timeout, me)) from None
    _complete[(call.namespace, group)] = number
    problem = _disagreement(call, peers, [json.loads(post) for post in _read_all(store, keys)])
    if problem:
        raise call.error(problem)


def agree_after(call: Call, timeout: float, check: Callable[[], _Result]) -> _Result:
    """Run this rank's `check` of the call (which may read files only this rank sees), then `agree` on the call and
    on each rank's outcome: a refusal every rank made alike is raised on each, one only some ranks made is one line
    on all naming which (they see different files), never a collective the others wait in. `call.fix(CHECKS)` says
    what to do about the latter. Returns what `check` returned."""
    outcome, raised, result = "passed", None, None
    try:
        result = check()
    except Exception as error:  # noqa: BLE001 (re-raised below, once the peers know)
        first = (str(error).strip().splitlines() or [""])[0]
        outcome, raised = (first if isinstance(error, UsageError) else f"{type(error).__name__}: {first}"), error
    agree(dataclasses.replace(call, fields={**call.fields, CHECKS: outcome}), timeout)
    if raised is not None:
        raise raised
    return result
