#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run calls exactly this).
# Builds two throwaway environments from this checkout and runs pytest in each:
#   newest supported Megatron-Core (0.16.x): the whole suite (slow matrix too unless SKIP_SLOW=1);
#   oldest supported Megatron-Core (0.13.x, needs numpy<2): runtime tests + one multi-rank LoRA run.
# torch is pinned to the local CPU build so no CUDA wheels are downloaded. The package is
# installed as a wheel (its .pth start-up hook included) and pytest runs as a script, so the
# checkout directory never shadows the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="torch==2.13.0"
status=0

make_env() {  # make_env DIR MEGATRON_SPEC [EXTRA...]
  local dir=$1; shift
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check "$TORCH"
  "$dir/bin/pip" install -q --disable-pip-version-check "$@" ".[test]"
}

echo "== megatron-core 0.16.x: full suite"
make_env .venv-test-newest "megatron-core>=0.16,<0.17"
marker=()
[ "${SKIP_SLOW:-0}" = 1 ] && marker=(-m "not slow")
.venv-test-newest/bin/pytest "${marker[@]}" || status=$?

echo "== megatron-core 0.13.x: runtime + smoke"
make_env .venv-test-oldest "megatron-core>=0.13,<0.14" "numpy<2"
# Runtime, topology, and one multi-rank run through every default patch (tp2-sp LoRA step vs world-1).
.venv-test-oldest/bin/pytest tests/test_runtime.py tests/test_flags.py tests/test_bootstrap.py tests/test_topology.py \
  "tests/test_oracle.py::test_correct_canonicalization_passes" || status=$?

exit $status
