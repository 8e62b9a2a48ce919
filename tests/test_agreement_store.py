"""The agreement's store keys do not grow with the number of calls (`runtime.agreement._forget`).

A job that agrees every step (an RL loop handing adapters to its engine, a save every few steps) on hundreds of ranks
would otherwise leave one post per rank per call on the rendezvous store for good. Two real ranks make five calls;
only the last two calls' keys remain, and a call whose peer never came keeps its keys (nothing proves its posts read).
"""

from __future__ import annotations

from megatron_lora_patch.proof.testbed.launcher import run_world

CALLS = 5


def _keys(store, prefix: str, ranks) -> list:
    return [store.check([f"{prefix}/args/{rank}"]) for rank in ranks] + [store.check([f"{prefix}/arrived"])]


def agree_calls(rank: int, world_size: int, calls: int, absent_after: int) -> dict:
    """`calls` agreements on the world (rank 1 stops after `absent_after`); which calls' keys the store holds."""
    from torch.distributed import distributed_c10d

    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.runtime import agreement

    call = agreement.Call("test.agree", "test_store", {"value": 1}, lambda field: "pass the same")
    outcomes = []
    with Topology(dp=world_size).world():
        for number in range(1, calls + 1):
            if rank == 1 and number > absent_after:
                break
            try:
                agreement.agree(call, timeout=2.0 if number > absent_after else 60.0)
                outcomes.append("agreed")
            except agreement.CallAgreementError as error:
                outcomes.append(str(error))
        store = distributed_c10d._get_default_store()
        group = agreement.group_key(list(range(world_size)))
        held = {number: _keys(store, f"{agreement._PREFIX}/test_store/{group}/{number}", range(world_size))
                for number in range(1, calls + 1)}
        distributed_c10d.barrier()
    return {"outcomes": outcomes, "held": held}


def test_only_the_last_two_calls_keys_remain():
    ranks = run_world(agree_calls, 2, args=(CALLS, CALLS), name="dp2", timeout=120)
    assert all(rank["outcomes"] == ["agreed"] * CALLS for rank in ranks)
    held = ranks[0]["held"]
    assert [all(held[number]) for number in (CALLS - 1, CALLS)] == [True, True]
    assert not any(any(held[number]) for number in range(1, CALLS - 1)), held


def test_a_call_a_peer_missed_keeps_the_keys_before_it():
    """Rank 1 makes 3 calls, rank 0 makes 5: at call 4 rank 0 forgets call 2 (call 3 was complete), call 4 times
    out, and call 5 forgets nothing of call 3 (call 4 was not complete: a slow peer might still read call 3's posts).
    Rank 1, which stopped, keeps its own post of call 2."""
    ranks = run_world(agree_calls, 2, args=(CALLS, 3), name="dp2", timeout=120)
    assert ranks[0]["outcomes"][:3] == ["agreed"] * 3 and "rank 1 did not call it" in ranks[0]["outcomes"][3]
    held = ranks[0]["held"]  # per call: rank 0's post, rank 1's post, the arrival counter
    assert (held[1], held[2], held[3]) == ([False] * 3, [False, True, False], [True] * 3), held
