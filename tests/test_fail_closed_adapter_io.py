"""The collective adapter I/O calls never hang on a caller's mistake (lora/checkpoints/collective.py).

`save_adapters`, `load_adapters` and `import_peft` are collective over the world. Two real ranks (a TP2 model) make
the calls of each case: a rank that never calls, ranks passing different directories or calling different
functions, and a refusal only one rank makes (a directory only its node sees, stood in for by `adapter_io_worker`'s
local views) must end with one line on every rank within seconds, where the others used to wait in the checkpoint's
collective until the process group's timeout (run_world's own timeout, far below that, would catch a hang). A
refusal both ranks make is raised alike on both; after a refused call the ranks are in step and the proper call
saves and loads. Negative control, measured: without the agreement 6 of these 7 fail (run_world sees a rank fail
or time out); the seventh, a refusal every rank makes, passes either way.
"""

from __future__ import annotations

import adapter_io_worker
import pytest

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

BOUND_S = 60.0  # far under any collective timeout (10 to 30 minutes)
SHARED = "see the same files there (a filesystem every rank shares) and build the same model"


def run_calls(calls: dict) -> list:
    return run_world(adapter_io_worker.calls_world, 2, args=("tp2", TinyGPTSpec(), 7, calls), name="tp2", timeout=180)


def _all_within_bound(ranks: list) -> bool:
    return all(seconds < BOUND_S for outcomes in ranks for _, seconds in outcomes)


def test_a_rank_that_never_saves_is_named_after_the_timeout(tmp_path):
    ranks = run_calls({0: [("save_adapters", {"directory": str(tmp_path / "a"), "timeout": 3.0}, None)], 1: [None]})
    (outcome, seconds), = ranks[0]
    assert outcome == ("save_adapters: rank 1 did not call it within 3 s of rank 0; it is collective: call it on "
                       "every rank of the world (or pass a larger timeout if a rank is only late)")
    assert 3.0 <= seconds < BOUND_S
    assert not (tmp_path / "a").exists()  # nothing written


def test_different_directories_are_one_line_on_both_then_the_ranks_save_and_load(tmp_path):
    first, second, good = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "good")
    calls = {rank: [("save_adapters", {"directory": directory}, None), ("save_adapters", {"directory": good}, None),
                    ("load_adapters", {"directory": good}, None)]
             for rank, directory in ((0, first), (1, second))}
    ranks = run_calls(calls)
    message = (f"save_adapters: the ranks disagree on directory (rank 0: {first!r}, rank 1: {second!r}); it is "
               "collective: every rank must pass the same directory to save_adapters")
    assert [outcomes[0][0] for outcomes in ranks] == [message, message]
    assert [outcome for outcomes in ranks for outcome, _ in outcomes[1:]] == ["ok"] * 4  # in step after it
    assert _all_within_bound(ranks)


def test_a_non_empty_directory_only_one_rank_sees_is_one_line_on_both(tmp_path):
    """Node-local disks: rank 1 sees a stale checkpoint where rank 0 sees none; rank 1's refusal alone used to leave
    rank 0 waiting in the checkpoint's first barrier."""
    target = str(tmp_path / "out")
    (tmp_path / "out").mkdir()  # empty where rank 0 looks
    ranks = run_calls({0: [("save_adapters", {"directory": target}, None)],
                       1: [("save_adapters", {"directory": target}, "stale")]})
    refusal = (f"save_adapters: directory {target} is not empty; pass overwrite=True to replace it, or name a new "
               "directory")
    message = (f"save_adapters: the ranks disagree on its checks (rank 0: 'passed', rank 1: {refusal!r}); it is "
               f"collective: every rank must {SHARED}")
    assert [outcomes[0][0] for outcomes in ranks] == [message, message]  # the same line on every rank
    assert _all_within_bound(ranks)


def test_a_refusal_every_rank_makes_is_raised_alike(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "base.safetensors").write_text("")
    ranks = run_calls({rank: [("save_adapters", {"directory": str(target)}, None)] for rank in (0, 1)})
    refusal = (f"save_adapters: directory {target} is not empty; pass overwrite=True to replace it, or name a new "
               "directory")
    assert [outcomes[0][0] for outcomes in ranks] == [refusal, refusal]


@pytest.mark.parametrize("function, argument, refusal", [
    ("load_adapters", "directory", "adapter checkpoint {} does not exist"),
    ("import_peft", "peft_dir", "{}: no adapter_model.safetensors"),
])
def test_a_directory_one_rank_cannot_see_stops_both_loads(tmp_path, function, argument, refusal):
    """Rank 1 does not see the directory: its refusal and the other's wait end in one line each."""
    saved, peft_dir = str(tmp_path / "saved"), str(tmp_path / "peft")
    export = ("export_peft", {"checkpoint_dir": saved, "out_dir": peft_dir}, None)
    source = saved if function == "load_adapters" else peft_dir
    calls = {rank: [("save_adapters", {"directory": saved}, None), export if rank == 0 else None,
                    (function, {argument: source}, "missing" if rank == 1 else None)] for rank in (0, 1)}
    ranks = run_calls(calls)
    assert [outcomes[0][0] for outcomes in ranks] == ["ok", "ok"] and ranks[0][1][0] == "ok"
    zero, one = ranks[0][2][0], ranks[1][2][0]
    assert zero == one and zero.startswith(f"{function}: the ranks disagree on its checks (rank 0: 'passed', rank 1: "
                                           f"'{refusal.format(source)}") and zero.endswith(SHARED)
    assert _all_within_bound(ranks)


def test_ranks_calling_different_functions_get_one_line_each(tmp_path):
    saved = str(tmp_path / "saved")
    ranks = run_calls({0: [("save_adapters", {"directory": saved}, None)],
                       1: [("load_adapters", {"directory": saved}, None)]})
    assert ranks[0][0][0].startswith("save_adapters: the ranks disagree on call (rank 0: 'save_adapters', rank 1: "
                                     "'load_adapters'); it is collective: every rank must call the same function")
    assert ranks[1][0][0].startswith("load_adapters: the ranks disagree on")  # its own checks or the call
    assert _all_within_bound(ranks)
