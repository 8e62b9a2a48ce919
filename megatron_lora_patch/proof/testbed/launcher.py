"""Run a function on N local ranks (processes) that can form a gloo world on 127.0.0.1.

``run_world(fn, world_size)`` is the multi-process harness every numeric test uses:

* Each rank runs ``fn(rank, world_size, *args, **kwargs)`` in a process forked from a fork server that
  imported torch and its compiler stack once (`FORK_SERVER_PRELOAD`), so a rank starts in milliseconds; it
  still starts as a fresh interpreter would for what this package reads: the caller's environment at the call,
  the caller's stdout / stderr, the `.pth` start-up hook armed from that environment. It runs with
  ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
  ``LOCAL_WORLD_SIZE`` set, and torch limited to one intra-op thread (the server starts with
  ``OMP_NUM_THREADS=1`` and friends, so no thread pool exists to fork, and the rank sets torch's thread count;
  ``LORA_PATCH_RANK_THREADS`` raises it, to probe reduction-order noise). Megatron and this package's plugins
  are imported by the rank itself.
* The rendezvous store is hosted by the parent (like ``torchrun``'s agent store, with
  ``TORCHELASTIC_USE_AGENT_STORE=True``), so there is no race on a "free" port between
  choosing it and binding it. Ranks join with :func:`gloo_process_group` or plain
  ``torch.distributed.init_process_group("gloo")``.
* Return values come back in rank order; tensors (nested in dicts, lists, tuples) are
  detached, copied to CPU and sent with ``torch.save``, so any picklable value works.
* A rank that raises makes ``run_world`` raise :class:`WorldError` naming the rank(s)
  and carrying their traceback text; a world still running after ``timeout`` seconds is
  killed and :class:`WorldTimeout` names the ranks that did not finish, with their
  Python stacks at the moment of the timeout.
* No process outlives ``run_world``: each rank leads its own process group, which is
  killed (grandchildren included) on error, timeout and ``KeyboardInterrupt``; ranks
  also die with ``SIGKILL`` when the parent dies (the fork server exits with it, and a rank dies with the server:
  ``PR_SET_PDEATHSIG`` on Linux).

The launcher itself never initializes ``torch.distributed``; ranks do that themselves
(see :func:`gloo_process_group`, or ``Topology.world()`` which also sets up Megatron).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_lora_patch.proof.testbed import rank as rank_side
from megatron_lora_patch.proof.testbed.rank import gloo_process_group

__all__ = ["WorldError", "WorldTimeout", "gloo_process_group", "run_world"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
# After the first rank fails, the others get this long to finish or fail on their own
# (a peer's death usually breaks their collectives within milliseconds) before being killed.
FAILURE_GRACE_S = 3.0
# How long a hung rank gets to write its Python stack after SIGUSR1, before SIGKILL.
STACK_DUMP_WAIT_S = 1.0
# How long ranks that already sent their result get to exit before being killed.
FINISHED_EXIT_WAIT_S = 10.0
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: Intra-op threads per rank (default 1). A noise probe, not a setting: more threads split GEMMs and
#: reductions differently, which is how another CPU's reduction order shows on this one (docs/testing.md).
RANK_THREADS_ENV = "LORA_PATCH_RANK_THREADS"


class WorldError(RuntimeError):
    """One or more ranks of a world failed.

    Attributes: ``name`` (the world's name, e.g. a topology string), ``failures``
    (rank -> traceback text of that rank) and ``unfinished`` (ranks killed before they
    returned).
    """

    def __init__(self, message: str, *, name: str, failures: dict[int, str], unfinished: Sequence[int]):
        super().__init__(message)
        self.name = name
        self.failures = dict(failures)
        self.unfinished = tuple(unfinished)


class WorldTimeout(WorldError):
    """The world did not finish within its timeout; ``unfinished`` lists the hung ranks."""


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Any  # parent end of a one-way pipe; the rank sends exactly one message
    stack_file: str
    done: bool = False


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    name: str = "world",
    warnings: str = "default",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results in rank order.

    ``fn``, ``args`` and ``kwargs`` must be picklable (``fn`` a module-level function).
    ``name`` labels the world in errors (pass the topology string). ``warnings`` is the
    ranks' ``warnings.simplefilter`` action: ``"ignore"`` silences Megatron's and torch's
    start-up noise (Apex / Transformer Engine fallbacks, deprecations). Raises
    :class:`WorldError` if any rank raises or dies, :class:`WorldTimeout` if the world
    is still running after ``timeout`` seconds; in every case all ranks are gone on return.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = rank_threads()
    try:
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as error:
        raise TypeError(
            f"run_world({name!r}): fn, args and kwargs must be picklable (fn a module-level function): {error}"
        ) from error

    import torch.distributed as dist

    # world_size=1 as seen by the store: it only counts the master itself and we host no rank.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    context = _rank_context()
    stack_dir = tempfile.mkdtemp(prefix="mlp-world-")
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            env = _rank_env(rank, world_size, store.port, threads)
            stack_file = os.path.join(stack_dir, f"rank{rank}.stack")
            process = context.Process(
                target=rank_side.rank_main,
                args=(payload, {**os.environ, **env}, sender, stack_file, warnings, _InheritedFd(1), _InheritedFd(2)),
                name=f"{name}-rank{rank}",
                daemon=False,
            )
            process.start()
            sender.close()  # only the rank holds the sending end, so its death closes the pipe
            ranks.append(_Rank(rank, process, receiver, stack_file))
        results = _collect(ranks, timeout=timeout, name=name)
        _join_finished(ranks)
        return results
    finally:
        _kill_all(ranks)
        shutil.rmtree(stack_dir, ignore_errors=True)
        del store


#: What every rank imports first and what reads nothing of this package's environment nor patches anything: the
#: fork server imports it once, so a rank starts in milliseconds instead of paying torch's and its compiler stack's
#: import (about 6 s of the 8 s a Megatron-Core import takes; Megatron itself is imported by each rank, after its
#: environment is set, so plugins still load as in a fresh interpreter).
CUDA_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
FORK_SERVER_PRELOAD = (
    "megatron_lora_patch.proof.testbed.rank",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._inductor.compile_fx",
)


def _rank_context() -> Any:
    """The fork-server context, its server started with no `MEGATRON_*` variable (so the `.pth` start-up hook never
    arms in the server: each rank arms it from its own environment), one intra-op thread (no OpenMP pool exists
    to fork) and CUDA left uninitialized (`CUDA_CHECK_ENV`)."""
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    saved = dict(os.environ)
    try:
        for key in [key for key in os.environ if key[:9].upper() == "MEGATRON_"]:
            del os.environ[key]
        os.environ.update({key: "1" for key in _THREAD_ENV})
        # The preloaded imports ask torch whether CUDA is there; its default answer marks every process later forked
        # from the server as unable to start CUDA (seen on an H200, benchmarks/README.md "gpu/run.sh"), the answer
        # through NVML does not.
        os.environ[CUDA_CHECK_ENV] = "1"
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


class _InheritedFd:
    """One of the parent's file descriptors, passed to a rank started by the fork server (which would otherwise
    write to the server's stdout / stderr, not the caller's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (rank_side.adopt_fd, (reduction.DupFd(self.fd),))


def _rank_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the parent hosts the store: every rank is a client
    }
    env.update({key: str(threads) for key in _THREAD_ENV})
    return env


def rank_threads() -> int:
    """Intra-op threads each rank runs with: `LORA_PATCH_RANK_THREADS` (a positive integer), else 1."""
    text = os.environ.get(RANK_THREADS_ENV, "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{RANK_THREADS_ENV}={text!r}: give a positive integer (intra-op threads per rank)")
    return int(text)


def _collect(ranks: list[_Rank], *, timeout: float, name: str) -> list[Any]:
    start = time.monotonic()
    deadline = start + timeout
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first_failure: float | None = None
    by_conn = {r.conn: r for r in ranks}
    by_sentinel = {r.process.sentinel: r for r in ranks}
    while len(results) + len(failures) < len(ranks):
        now = time.monotonic()
        if first_failure is not None and now >= first_failure + FAILURE_GRACE_S:
            break
        if now >= deadline:
            _raise_timeout(ranks, results, failures, timeout=timeout, name=name)
        wait_until = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_S)
        pending = [r for r in ranks if not r.done]
        ready = multiprocessing.connection.wait(
            [r.conn for r in pending] + [r.process.sentinel for r in pending], timeout=max(0.0, wait_until - now)
        )
        for handle in ready:
            entry = by_conn.get(handle) or by_sentinel[handle]
            if entry.done:
                continue
            outcome = _receive(entry)
            if outcome is None:
                continue  # alive and silent: woken by a pipe that holds nothing yet
            entry.done = True
            kind, value = outcome
            if kind == "ok":
                results[entry.rank] = value
            else:
                failures[entry.rank] = value
                first_failure = first_failure if first_failure is not None else time.monotonic()
    if failures:
        unfinished = [r.rank for r in ranks if not r.done]
        raise WorldError(
            _failure_message(name, failures, unfinished), name=name, failures=failures, unfinished=unfinished
        )
    log.debug("world %r finished in %.1fs", name, time.monotonic() - start)
    return [results[rank] for rank in range(len(ranks))]


def _receive(entry: _Rank) -> tuple[str, Any] | None:
    """Read the rank's one message; ``None`` if it is alive and has not sent anything yet."""
    if entry.conn.poll():
        try:
            kind, body = entry.conn.recv()
        except EOFError:
            return _died(entry)
        if kind != "ok":
            return "error", body
        try:
            return "ok", rank_side.loads(body)
        except Exception:
            return "error", "the parent could not load this rank's return value:\n" + traceback.format_exc()
    if entry.process.is_alive():
        return None
    return _died(entry)


def _died(entry: _Rank) -> tuple[str, str]:
    entry.process.join(timeout=5)
    code = entry.process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return "error", f"the process {how} without returning a result or raising a Python exception (see its stderr)\n"


def _failure_message(name: str, failures: dict[int, str], unfinished: list[int]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(failures.items()):
        groups.setdefault(text, []).append(rank)
    failed = sorted(failures)
    lines = [f"world {name!r}: {_ranks_text(failed)} failed"]
    if unfinished:
        killed = "was killed" if len(unfinished) == 1 else "were killed"
        lines[0] += f"; {_ranks_text(unfinished)} had not finished and {killed}"
    for text, group in groups.items():
        lines.append(f"--- {_ranks_text(group)} traceback ---")
        lines.append(text.rstrip())
    return "\n".join(lines)


def _raise_timeout(
    ranks: list[_Rank], results: dict[int, Any], failures: dict[int, str], *, timeout: float, name: str
) -> None:
    hung = [r for r in ranks if not r.done]
    stacks = _dump_stacks(hung)
    lines = [
        f"world {name!r} timed out after {timeout:g}s: {_ranks_text([r.rank for r in hung])} did not finish "
        f"({len(results)} of {len(ranks)} returned); all ranks were killed. "
        "Raise timeout= if the work is just slow; "
        "otherwise a rank is stuck (often a collective another rank never joined)."
    ]
    for rank, text in sorted(failures.items()):
        lines += [f"--- rank {rank} traceback ---", text.rstrip()]
    for entry, stack in zip(hung, stacks):
        lines += [f"--- rank {entry.rank} stack at timeout ---", stack.rstrip() or "(no Python stack was written)"]
    raise WorldTimeout("\n".join(lines), name=name, failures=failures, unfinished=[r.rank for r in hung])


def _dump_stacks(hung: list[_Rank]) -> list[str]:
    """Ask each hung rank for its Python stack (faulthandler on SIGUSR1) and read it back."""
    for entry in hung:
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry.process.pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT_S)
    stacks = []
    for entry in hung:
        try:
            with open(entry.stack_file, encoding="utf-8", errors="replace") as handle:
                stacks.append(handle.read())
        except OSError:
            stacks.append("")
    return stacks


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _join_finished(ranks: list[_Rank]) -> None:
    """Let ranks that returned exit on their own (atexit handlers, flushes) before the kill sweep."""
    deadline = time.monotonic() + FINISHED_EXIT_WAIT_S
    for entry in ranks:
        entry.process.join(timeout=max(0.0, deadline - time.monotonic()))


def _kill_all(ranks: list[_Rank]) -> None:
    """SIGKILL every rank's process group (grandchildren included) and reap the ranks."""
    for entry in ranks:
        pid = entry.process.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # each rank made itself a group leader (pgid == pid)
        with contextlib.suppress(Exception):
            entry.process.kill()  # in case it died or was killed before calling setpgid
    for entry in ranks:
        entry.process.join()
        entry.conn.close()
        entry.process.close()
