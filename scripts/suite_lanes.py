"""Run the test files in parallel lanes, longest first, one pytest process per file (scripts/run-tests.sh).

Usage: python suite_lanes.py --lanes N --record FILE [--] PYTHON [PYTEST ARGS...]

Each lane takes the next file from one shared queue when its last one is done, so the lanes end within about one
file of each other. The queue starts with the files that took longest in the run recorded in FILE (a JSON map
file -> seconds, outside the checkout), files it does not know first of all (by size). A file's result line is
printed when it ends, its whole output only if it failed. At the end: every file's wall time, slowest first (where
CI's time goes), and the total. Exit status 1 if any file failed. Standard library only: it runs under the test
environment's interpreter before anything is imported there.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import queue
import subprocess
import sys
import threading
import time

#: pytest's exit status when a file's every test was deselected (`-m "not slow"` on a slow-only file).
NO_TESTS_COLLECTED = 5


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--record", type=pathlib.Path, required=True, help="JSON of each file's last wall time")
    parser.add_argument("--tests", type=pathlib.Path, default=pathlib.Path("tests"))
    parser.add_argument("python", help="the interpreter that runs pytest")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed to every pytest run")
    return parser.parse_args(argv)


def ordered_files(tests: pathlib.Path, record: dict[str, float]) -> list[str]:
    """Test files, longest first: unknown ones (largest first) before the recorded ones (slowest first)."""
    files = sorted(str(path) for path in tests.glob("test_*.py"))
    unknown = sorted((f for f in files if f not in record), key=lambda f: -pathlib.Path(f).stat().st_size)
    known = sorted((f for f in files if f in record), key=lambda f: -record[f])
    return unknown + known


class Lanes:
    """The shared queue, the printed results (one lock, so lines never interleave) and the failures."""

    def __init__(self, files: list[str], command: list[str], deselecting: bool) -> None:
        self.pending: queue.SimpleQueue[str] = queue.SimpleQueue()
        for file in files:
            self.pending.put(file)
        self.command = command
        self.deselecting = deselecting
        self.seconds: dict[str, float] = {}
        self.failed: list[str] = []
        self.lock = threading.Lock()

    def work(self, lane: int) -> None:
        while True:
            try:
                file = self.pending.get_nowait()
            except queue.Empty:
                return
            start = time.monotonic()
            done = subprocess.run([*self.command, file], capture_output=True, text=True)
            self.report(lane, file, done, time.monotonic() - start)

    def report(self, lane: int, file: str, done: subprocess.CompletedProcess, seconds: float) -> None:
        passed = done.returncode == 0 or (done.returncode == NO_TESTS_COLLECTED and self.deselecting)
        # pytest's summary is stdout's last line (stderr may end with a faulthandler stack dump of a long test)
        summary = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or ["no output"])[-1]
        with self.lock:
            self.seconds[file] = seconds
            print(f"[lane {lane}] {file}: {summary} ({seconds:.0f} s)", flush=True)
            if not passed:
                self.failed.append(file)
                print(done.stdout + done.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    record = json.loads(args.record.read_text()) if args.record.is_file() else {}
    command = [args.python, "-P", "-m", "pytest", "-p", "no:cacheprovider", "-q", *pytest_args]
    lanes = Lanes(ordered_files(args.tests, record), command, deselecting="-m" in pytest_args)
    start = time.monotonic()
    threads = [threading.Thread(target=lanes.work, args=(lane,)) for lane in range(1, args.lanes + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"== {len(lanes.seconds)} test files in {time.monotonic() - start:.0f} s, {args.lanes} lanes; by wall time:")
    for file, seconds in sorted(lanes.seconds.items(), key=lambda item: -item[1]):
        print(f"{seconds:8.0f} s  {file}")
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps({**record, **lanes.seconds}, indent=1, sort_keys=True))
    if lanes.failed:
        print("== failed: " + " ".join(lanes.failed))
    return 1 if lanes.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
