#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run calls exactly this).
#
# Environments live outside the checkout, under $LORA_PATCH_TEST_CACHE (default
# ~/.cache/megatron-lora-patch-tests), and are reused while their requirements are unchanged:
#   base-py3.11, base-py3.12   torch==2.13.0 and the test tools, no Megatron-Core
#   mc-0.NN                    an overlay on a base (a .pth line) holding one Megatron-Core minor
#                              and this checkout's freshly built wheel (its .pth start-up hook too)
#   lint                       the linter (ruff, configured in pyproject.toml), run first
# Matrix (the range the patches declare is the range tested):
#   newest minor (0.19.x, Python 3.12): the whole suite (SKIP_SLOW=1 leaves out the 4+ rank matrix);
#   every other minor (0.13-0.16 on Python 3.11, 0.17-0.18 on 3.12): the runtime tests and
#   `megatron-lora-patch oracle` on its default topologies;
#   the newest minor again with a newer pinned torch ($NEWER_TORCH): the runtime tests and the oracle.
#   The whole suite runs in two lanes (a shared queue of test files, longest first), then the other legs two at
#   a time (each leg's output printed whole, in order).
# pytest runs with `python -P`, so the checkout never shadows the installed wheel. A skip is a
# failure unless it needs CUDA / Transformer Engine (tests/conftest.py).
set -euo pipefail
shopt -s inherit_errexit  # a failed install inside $(...) stops the run before its stamp is written
cd "$(dirname "$0")/.."
CACHE=${LORA_PATCH_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-lora-patch-tests}
TORCH="torch==2.13.0"
NEWER_TORCH="torch==2.14.1"  # users bring their own torch: a newer release runs the runtime tests and the oracle too
RUFF="ruff==0.17.6"
TOOLS=(pytest setuptools wheel matplotlib "transformers>=5.0" "peft>=0.17" wrapt pluggy packaging safetensors psutil numpy)
NEWEST=0.19
SMOKE=(0.13 0.14 0.15 0.16 0.17 0.18)
RUNTIME_TESTS=(tests/test_runtime.py tests/test_flags.py tests/test_bootstrap.py tests/test_topology.py tests/test_patch_contract.py)
# Tests whose cases depend on the Megatron-Core minor ("not applicable to this Megatron-Core" skips):
# they also run on every other minor, so each case runs where it applies.
VERSIONED_TESTS=(tests/test_null_tokenizer.py tests/test_megatron_compat.py tests/test_preflight_hybrid.py)
export LORA_PATCH_TEST_STRICT_SKIPS=1
mkdir -p "$CACHE"
status=0

python_for() {  # python_for MINOR -> the interpreter version that minor needs (0.17+ require 3.12)
  case $1 in 0.1[3-6]) echo 3.11 ;; *) echo 3.12 ;; esac
}

interpreter() {  # interpreter PYVER -> a python of that version (PATH, else pyenv's installs)
  local candidate
  for candidate in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1"; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$1'.split('.')))" 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  echo "run-tests.sh: Python $1 not found (Megatron-Core 0.17+ needs 3.12); install it, e.g. pyenv install $1" >&2
  return 1
}

base_env() {  # base_env PYVER [TORCH] -> path of a venv with that torch (default $TORCH) and the test tools
  local torch=${2:-$TORCH} dir="$CACHE/base-py$1" stamp
  [ "$torch" = "$TORCH" ] || dir="$dir-${torch//=/}"
  stamp="$torch ${TOOLS[*]}"
  if [ ! -f "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$stamp" ]; then
    rm -rf "$dir"
    "$(interpreter "$1")" -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check "$torch" >&2
    "$dir/bin/pip" install -q --disable-pip-version-check "$torch" "${TOOLS[@]}" >&2
    echo "$stamp" > "$dir/.stamp"
  fi
  echo "$dir"
}

megatron_env() {  # megatron_env MINOR WHEEL [TORCH] -> python of an overlay holding that minor and our wheel
  local minor=$1 wheel=$2 torch=${3:-$TORCH} pyver base dir site extra=()
  pyver=$(python_for "$minor"); base=$(base_env "$pyver" "$torch"); dir="$CACHE/mc-$minor"
  [ "$torch" = "$TORCH" ] || dir="$dir-${torch//=/}"
  [ "$minor" = 0.13 ] && extra=("numpy<2")  # 0.13 breaks on numpy 2
  if [ ! -f "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$minor ${extra[*]}" ]; then
    rm -rf "$dir"
    "$base/bin/python" -m venv --without-pip "$dir"
    site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/zz_base.pth"
    "$base/bin/pip" --python "$dir/bin/python" install -q --disable-pip-version-check --no-deps \
      "megatron-core~=$minor.0" "${extra[@]}" >&2
    echo "$minor ${extra[*]}" > "$dir/.stamp"
  fi
  "$base/bin/pip" --python "$dir/bin/python" install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel" >&2
  echo "$dir/bin/python"
}

lint_env() {  # lint_env -> path of a venv holding the pinned linter (built once)
  local dir="$CACHE/lint"
  if [ ! -f "$dir/.stamp" ] || [ "$(cat "$dir/.stamp")" != "$RUFF" ]; then
    rm -rf "$dir"
    "$(interpreter 3.11)" -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check "$RUFF" >&2
    echo "$RUFF" > "$dir/.stamp"
  fi
  echo "$dir"
}

echo "== lint: ruff check (pyproject.toml [tool.ruff])"
"$(lint_env)/bin/ruff" check --no-cache . || status=$?

WHEELS=$(mktemp -d); LOGS=$(mktemp -d); trap 'rm -rf "$WHEELS" "$LOGS"' EXIT
"$(base_env 3.11)/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$WHEELS" . >&2
rm -rf build ./*.egg-info
WHEEL=$(ls "$WHEELS"/*.whl)

# The whole suite runs in two lanes (scripts/suite_lanes.py): one pytest per test file, each lane taking the next
# file from a shared queue, longest first by the last run's times ($CACHE/suite-times.json). Much of a test's time is
# single-threaded (interpreter start-up, Megatron's import), so one lane would leave a core idle.
echo "== megatron-core $NEWEST.x (Python $(python_for $NEWEST)): full suite, in two lanes (at ${SECONDS} s)"
python=$(megatron_env "$NEWEST" "$WHEEL")
marker=()
[ "${SKIP_SLOW:-0}" = 1 ] && marker=(-m "not slow")
"$python" scripts/suite_lanes.py --lanes 2 --record "$CACHE/suite-times.json" "$python" "${marker[@]}" || status=$?

smoke_leg() {  # smoke_leg MINOR [TORCH]: the runtime tests (the versioned ones too) and the default oracle
  local minor=$1 torch=${2:-$TORCH} python versioned=() rc=0
  if [ "$torch" = "$TORCH" ]; then
    echo "== megatron-core $minor.x (Python $(python_for "$minor")): runtime tests + the default oracle"
    versioned=("${VERSIONED_TESTS[@]}")
    [ "$minor" = 0.13 ] && versioned=(tests/test_null_tokenizer.py)  # test_megatron_compat applies tp_invariant (0.14+)
  else
    echo "== megatron-core $minor.x with $torch: runtime tests + the default oracle"
  fi
  python=$(megatron_env "$minor" "$WHEEL" "$torch")
  "$python" -P -m pytest -q "${RUNTIME_TESTS[@]}" "${versioned[@]}" || rc=$?
  "$python" -P -m megatron_lora_patch oracle || rc=$?
  return $rc
}

lane() {  # lane LEG...: each leg (MINOR or MINOR:TORCH) in turn, its output into $LOGS/LEG.log; fails if any did
  local leg rc=0
  for leg in "$@"; do
    # a background job keeps errexit (a failed install stops its leg before the stamp); `|| ...` would not
    smoke_leg ${leg/:/ } >"$LOGS/$leg.log" 2>&1 &
    wait $! || { rc=1; echo "== leg $leg FAILED (its output above)" >>"$LOGS/$leg.log"; }
  done
  return $rc
}

# The other legs run in two lanes at once: most of their time is single-threaded interpreter start-up (a fresh
# process per patch, per hook, per oracle rank), so two lanes keep both cores busy. Each leg's output is printed
# whole, in order, once both lanes are done.
LEGS=("${SMOKE[@]}" "$NEWEST:$NEWER_TORCH")
echo "== the other legs, in two lanes (at ${SECONDS} s): ${LEGS[*]}"
lane "${LEGS[@]:0:1}" "${LEGS[@]:2:1}" "${LEGS[@]:4:1}" "${LEGS[@]:6}" & first=$!
lane "${LEGS[@]:1:1}" "${LEGS[@]:3:1}" "${LEGS[@]:5:1}" & second=$!
wait "$first" || status=1
wait "$second" || status=1
for leg in "${LEGS[@]}"; do cat "$LOGS/$leg.log"; done

echo "== done in $SECONDS s"
exit $status
