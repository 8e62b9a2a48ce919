"""run_world's ranks are forked from a server that preloaded torch, yet each starts as a fresh interpreter would for
everything this package reads: the caller's environment at the call, the caller's stdout / stderr, and the `.pth`
start-up hook armed (or not) from that environment, never from the one the server started with.

Rank functions live at module level (ranks unpickle them) and import nothing heavy.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from conftest import clean_environ

from megatron_lora_patch.proof.testbed.launcher import run_world

PROBE = "LORA_PATCH_FORK_SERVER_PROBE"


def environment_rank(rank: int, world_size: int) -> str | None:
    return os.environ.get(PROBE)


def hook_state_rank(rank: int, world_size: int) -> dict:
    """Whether the start-up hook is armed in this rank, as the `.pth` line would leave a fresh interpreter."""
    from megatron_lora_patch.runtime import bootstrap

    watching = any(isinstance(finder, bootstrap._MegatronWatcher) for finder in sys.meta_path)
    return {"armed": bootstrap._installed, "watching": watching}


def print_rank(rank: int, world_size: int) -> None:
    print(f"rank {rank} on stdout", flush=True)
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)


def test_a_rank_has_the_callers_environment_at_the_call_not_the_servers(monkeypatch):
    monkeypatch.delenv(PROBE, raising=False)
    assert run_world(environment_rank, 1) == [None]  # the server runs from here on
    monkeypatch.setenv(PROBE, "set after the server started")
    assert run_world(environment_rank, 2) == ["set after the server started"] * 2
    monkeypatch.delenv(PROBE)
    assert run_world(environment_rank, 1) == [None]


def test_a_rank_writes_to_the_callers_stdout_and_stderr(capfd):
    run_world(print_rank, 2)
    out, err = capfd.readouterr()
    assert "rank 0 on stdout" in out and "rank 1 on stdout" in out, (out, err)
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err, (out, err)


# A fresh caller whose environment asks for plugins when its fork server starts: the first world must see the hook
# armed (the rank arms it from its own environment), the second, after the variable is gone, must not (the server
# was started without it, so no rank inherits an armed hook).
CALLER = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from megatron_lora_patch.proof.testbed.launcher import run_world
    from test_launcher_fork_server import hook_state_rank
    asked = run_world(hook_state_rank, 1)[0]
    del os.environ["MEGATRON_PLUGINS"]
    print(json.dumps([asked, run_world(hook_state_rank, 1)[0]]))
    """
)


def test_the_start_up_hook_is_armed_from_the_ranks_environment_only():
    tests = str(pathlib.Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-P", "-c", CALLER, tests],
        env=clean_environ(MEGATRON_PLUGINS="lora_correct"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    asked, unasked = json.loads(done.stdout.strip().splitlines()[-1])
    assert asked == {"armed": True, "watching": True}, done.stderr
    assert unasked == {"armed": False, "watching": False}, done.stderr
