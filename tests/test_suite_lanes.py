"""scripts/suite_lanes.py, the suite's two lanes in the README's test command: every file runs, longest first by the
recorded times, a failed file fails the run with its output shown, and the times are recorded for the next run."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

FILES = {
    "test_quick.py": "def test_quick():\n    pass\n",
    "test_slow.py": "def test_slow():\n    pass\n",
    "test_broken.py": "def test_broken():\n    assert 1 == 2, 'the broken file'\n",
}


def _lanes(tmp_path, record: dict, *pytest_args: str) -> subprocess.CompletedProcess:
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    for name, text in FILES.items():
        (tests / name).write_text(text)
    (tmp_path / "times.json").write_text(json.dumps(record))
    command = [sys.executable, str(REPO / "scripts" / "suite_lanes.py"), "--lanes", "1", "--tests", "tests"]
    command += ["--record", "times.json", sys.executable, *pytest_args]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_every_file_runs_longest_first_and_a_failure_fails_the_run(tmp_path):
    record = {"tests/test_quick.py": 1.0, "tests/test_slow.py": 50.0, "tests/test_broken.py": 9.0}
    done = _lanes(tmp_path, record)
    ran = [line.split()[2].rstrip(":") for line in done.stdout.splitlines() if line.startswith("[lane 1]")]
    assert ran == ["tests/test_slow.py", "tests/test_broken.py", "tests/test_quick.py"], done.stdout
    assert done.returncode == 1 and "the broken file" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "== failed: tests/test_broken.py"
    assert set(json.loads((tmp_path / "times.json").read_text())) == set(record)


def test_a_file_deselected_whole_passes_only_under_a_marker(tmp_path):
    done = _lanes(tmp_path, {}, "-k", "nothing_matches")
    assert done.returncode == 1, done.stdout  # no test ran: that proves nothing
    done = _lanes(tmp_path, {}, "-m", "not slow", "-k", "quick or slow")
    assert done.returncode == 0, done.stdout
    assert "== 3 test files in" in done.stdout
