"""run_world: results in rank order, failures and hangs reported per rank, and no process left behind.

Rank functions live at module level (ranks unpickle them) and import nothing heavy (torch is preloaded by the
fork server), so most worlds here start in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from megatron_lora_patch.proof.testbed.launcher import WorldError, WorldTimeout, gloo_process_group, run_world

# Generous bound on spawn + import; the hang test's world must be gone within timeout + this.
STARTUP_SLACK_S = 15.0
# How long a world of sleeping ranks may take to start on a loaded machine (spawn + imports).
WORLD_START_S = 300.0
# How long killing a started world may take, from the interrupt or the parent's death to all ranks gone.
CLEANUP_S = 10.0


def _is_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie waiting for a reaper that is not us)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _read_pids(directory: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(directory.glob("*.pid"))]


def _record_pid(directory: str, label: str, pid: int | None = None) -> None:
    """Write `<label>.pid` atomically: a reader never sees an empty or partial file."""
    partial = Path(directory, f"{label}.pid.partial")
    partial.write_text(str(pid or os.getpid()))
    partial.rename(Path(directory, f"{label}.pid"))


@contextlib.contextmanager
def _readiness_listener():
    """A localhost socket ranks connect to once they run: the test waits on it instead of polling."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server, server.getsockname()[1]


def _wait_for_ranks(server: socket.socket, count: int, timeout: float) -> bool:
    """True once `count` ranks announced themselves on `server`, False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for _ in range(count):
        server.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            connection, _ = server.accept()
        except TimeoutError:
            return False
        connection.close()
    return True


def _assert_all_gone(pids: list[int]) -> None:
    assert pids, "the ranks did not record their pids"
    alive = [pid for pid in pids if not _is_gone(pid)]
    assert not alive, f"processes left behind: {alive}"
    assert multiprocessing.active_children() == []


# ----------------------------------------------------------------------------- rank functions


def _all_reduce_rank(rank: int, world_size: int, offset: float) -> dict:
    import torch
    import torch.distributed as dist

    with gloo_process_group(timeout_s=60):
        total = torch.tensor([rank + offset, 10.0 * rank])
        dist.all_reduce(total)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
    return OrderedDict(
        rank=rank,
        world_size=world_size,
        env={key: os.environ[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
        threads=torch.get_num_threads(),
        total=total,
        transposed_view=base.t()[1:],  # non-contiguous view of a larger storage
        bf16=[torch.full((2,), rank + 0.5, dtype=torch.bfloat16)],
        grad=torch.ones(2, requires_grad=True) * (rank + 1),  # non-leaf that requires grad
    )


def _raise_in_rank1_rank(rank: int, world_size: int, pid_dir: str) -> str:
    _record_pid(pid_dir, f"rank{rank}")
    if rank == 1:
        raise ValueError("boom from rank 1")
    import torch
    import torch.distributed as dist

    with gloo_process_group(timeout_s=60):
        dist.all_reduce(torch.zeros(1))  # rank 1 never joins: this rank errors or is killed
    return "unreachable"


def _exit_hard_rank(rank: int, world_size: int) -> None:
    os._exit(3)


def _hang_in_rank1_rank(rank: int, world_size: int, pid_dir: str) -> int:
    _record_pid(pid_dir, f"rank{rank}")
    if rank == 1:
        grandchild = subprocess.Popen(["sleep", "600"])
        _record_pid(pid_dir, "rank1-grandchild", grandchild.pid)
        time.sleep(600)
    return rank


def _sleep_rank(rank: int, world_size: int, pid_dir: str, ready_port: int) -> None:
    _record_pid(pid_dir, f"rank{rank}")
    socket.create_connection(("127.0.0.1", ready_port)).close()  # "running", to _wait_for_ranks
    time.sleep(600)


# ----------------------------------------------------------------------------- tests


def test_results_come_back_in_rank_order_intact():
    import torch

    results = run_world(_all_reduce_rank, 2, args=(0.25,), name="dp2")

    assert [result["rank"] for result in results] == [0, 1]
    for rank, result in enumerate(results):
        assert isinstance(result, OrderedDict)
        assert result["world_size"] == 2
        assert result["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
        }
        assert result["threads"] == 1
        torch.testing.assert_close(result["total"], torch.tensor([1.5, 10.0]), rtol=0, atol=0)
        expected_view = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank).t()[1:]
        torch.testing.assert_close(result["transposed_view"], expected_view, rtol=0, atol=0)
        assert result["bf16"][0].dtype == torch.bfloat16
        assert result["bf16"][0].tolist() == [rank + 0.5] * 2
        assert result["grad"].tolist() == [rank + 1.0] * 2
    assert multiprocessing.active_children() == []


def test_raising_rank_is_named_with_its_traceback(tmp_path):
    with pytest.raises(WorldError) as caught:
        run_world(_raise_in_rank1_rank, 2, args=(str(tmp_path),), timeout=60, name="tp2-sp")

    error = caught.value
    assert error.name == "tp2-sp"
    assert 1 in error.failures
    assert "ValueError: boom from rank 1" in error.failures[1]
    assert "_raise_in_rank1_rank" in error.failures[1]  # the child's traceback, not a summary
    message = str(error)
    assert message.startswith("world 'tp2-sp': rank 1 failed; rank 0 had not finished and was killed\n")
    assert error.unfinished == (0,)
    assert "ValueError: boom from rank 1" in message
    assert not isinstance(error, WorldTimeout)
    _assert_all_gone(_read_pids(tmp_path))


def test_rank_dying_without_exception_is_reported():
    with pytest.raises(WorldError) as caught:
        run_world(_exit_hard_rank, 1, name="tp1")
    assert str(caught.value).startswith("world 'tp1': rank 0 failed")
    assert "the process exited with code 3 without returning a result" in caught.value.failures[0]


def test_hung_rank_is_killed_with_its_grandchildren(tmp_path):
    timeout = 3.0
    started = time.monotonic()
    with pytest.raises(WorldTimeout) as caught:
        run_world(_hang_in_rank1_rank, 2, args=(str(tmp_path),), timeout=timeout, name="pp2")
    elapsed = time.monotonic() - started

    error = caught.value
    assert error.unfinished == (1,)
    message = str(error)
    assert message.startswith("world 'pp2' timed out after 3s: rank 1 did not finish (1 of 2 returned)")
    assert "--- rank 1 stack at timeout ---" in message
    assert "_hang_in_rank1_rank" in message  # the hung rank's Python stack, via faulthandler
    assert elapsed < timeout + STARTUP_SLACK_S
    pids = _read_pids(tmp_path)
    assert len(pids) == 3  # two ranks and rank 1's grandchild
    _assert_all_gone(pids)


@contextlib.contextmanager
def _restored_sigint(previous):
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_kills_the_world(tmp_path):
    interrupt = {}

    def interrupt_once_ranks_run(server: socket.socket) -> None:
        interrupt["ranks_ran"] = _wait_for_ranks(server, 2, WORLD_START_S)
        interrupt["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)  # also when they never ran: the test must end

    # A shell starts background jobs with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: install it for this test (a Ctrl-C at a terminal has one).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with _readiness_listener() as (server, port), _restored_sigint(previous):
        interrupter = threading.Thread(target=interrupt_once_ranks_run, args=(server,), daemon=True)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            run_world(_sleep_rank, 2, args=(str(tmp_path), port), timeout=WORLD_START_S + 60, name="dp2")
        cleanup_s = time.monotonic() - interrupt["at"]
        interrupter.join()
    assert interrupt["ranks_ran"], f"the ranks did not start within {WORLD_START_S:.0f}s"
    pids = _read_pids(tmp_path)
    assert len(pids) == 2
    _assert_all_gone(pids)  # at once: run_world returns only after killing and reaping every rank
    assert cleanup_s < CLEANUP_S, f"killing the interrupted world took {cleanup_s:.1f}s"


def test_ranks_die_when_the_parent_is_killed(tmp_path):
    parent_script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from megatron_lora_patch.proof.testbed.launcher import run_world
        from test_launcher import _sleep_rank
        if __name__ == "__main__":
            run_world(_sleep_rank, 2, args=({str(tmp_path)!r}, int(sys.argv[1])), timeout={WORLD_START_S + 60})
        """
    )
    script = tmp_path / "parent.py"
    script.write_text(parent_script)
    with _readiness_listener() as (server, port):
        parent = subprocess.Popen([sys.executable, str(script), str(port)])
        try:
            assert _wait_for_ranks(server, 2, WORLD_START_S), f"the ranks did not start within {WORLD_START_S:.0f}s"
            pids = _read_pids(tmp_path)
            assert len(pids) == 2
        finally:
            parent.kill()
            parent.wait()
    deadline = time.monotonic() + CLEANUP_S
    while not all(_is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_all_gone(pids)


def test_unpicklable_function_is_rejected_before_spawning():
    with pytest.raises(TypeError, match=r"run_world\('dp2'\): fn, args and kwargs must be picklable"):
        run_world(lambda rank, world_size: rank, 2, name="dp2")
    assert multiprocessing.active_children() == []


def test_gloo_process_group_refuses_missing_environment(monkeypatch):
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match=r"environment lacks \['MASTER_PORT'"):
        with gloo_process_group():
            pass


class _OnlyPicklable:
    """Pickles fine in a rank but cannot be loaded back (its reconstruction raises)."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def _refuse_to_load():
    raise RuntimeError("cannot rebuild this object")


def _return_unloadable_rank(rank: int, world_size: int) -> object:
    return _OnlyPicklable()


def test_unloadable_result_is_reported_as_that_ranks_failure():
    with pytest.raises(WorldError) as caught:
        run_world(_return_unloadable_rank, 1, name="tp1")
    assert "the parent could not load this rank's return value" in caught.value.failures[0]
    assert "RuntimeError: cannot rebuild this object" in caught.value.failures[0]


def _threads(rank: int, world_size: int) -> int:
    import torch

    return torch.get_num_threads()


def test_rank_threads_probe_raises_the_intra_op_threads(monkeypatch):
    """`LORA_PATCH_RANK_THREADS` (the noise probe, docs/testing.md): each rank runs with that many threads;
    a value that is not a positive integer is refused before any rank starts."""
    from megatron_lora_patch.proof.testbed import launcher

    monkeypatch.setenv(launcher.RANK_THREADS_ENV, "2")
    assert run_world(_threads, 2, name="threads") == [2, 2]
    monkeypatch.setenv(launcher.RANK_THREADS_ENV, "0")
    with pytest.raises(ValueError, match="LORA_PATCH_RANK_THREADS='0': give a positive integer"):
        run_world(_threads, 1, name="threads")
