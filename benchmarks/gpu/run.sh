#!/usr/bin/env bash
# The GPU device script (issue 34): everything a lent GPU's short slot is for, in one run of under 8 minutes.
#
#   bash benchmarks/gpu/run.sh OUT_DIR             on the GPU machine, from the repository root, with .whl/ holding
#                                                  the megatron-core 0.19.2 wheel and this project's wheel
#   bash benchmarks/gpu/run.sh OUT_DIR --dry-run   here on CPU (gloo, cpu_testbed, tiny shapes): checks the script
#
# Steps (each step's output in OUT_DIR/<step>.txt; a failed step is reported and the next one still runs):
#   loop        benchmarks/gpu/megatron_lm_cuda.py: Megatron-LM's loop on CUDA + NCCL with the plugin alone
#   layer_cost  benchmarks/gpu/layer_cost.py: LoRA's cost per MLP layer pair at hidden 4096 / 8192, TP 1 / 8 shards
#   preflight   `megatron-lora-patch preflight` on a tiny dense bf16 model at DP2 against one rank (its ranks are a
#               gloo world: on the GPU machine this shows whether it runs where CUDA is present)
# The GPU machine has no network: the wheels install into a venv that sees its torch, transformers and peft
# (a venv, not --target: the package's .pth start-up hook must run, or the plugin would never activate).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR [--dry-run]}
mode=${2:-}
mkdir -p "$out"
failed=0

if [ "$mode" = --dry-run ]; then
  python=${PYTHON:-python}
  loop=(--dry-run --iterations 4)
  loop_limit=1200  # four Megatron-LM runs on a loaded 2-core CPU
  cost=(--device cpu --dtype fp32 --hidden 128 --tp 1,8 --ranks 16 --tokens 64 --reps 2)
else
  python3 -m venv --system-site-packages /tmp/gpu-venv || exit 1
  /tmp/gpu-venv/bin/pip install -q --no-index --no-deps .whl/*.whl || exit 1
  python=/tmp/gpu-venv/bin/python
  loop=(--iterations 20)
  loop_limit=240
  cost=()
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt"
fi

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, output to OUT_DIR/NAME.txt
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  local status=$?
  echo "== $name: exit $status in $((SECONDS - started)) s" | tee -a "$out/summary.txt"
  [ $status -eq 0 ] || failed=1
}

step loop "$loop_limit" "$python" -P benchmarks/gpu/megatron_lm_cuda.py "$out/loop" "${loop[@]}"
step layer_cost 150 "$python" -P benchmarks/gpu/layer_cost.py --json "$out/layer_cost.json" "${cost[@]}"
step preflight 120 "$python" -P -m megatron_lora_patch preflight --data-parallel-size 2 \
  --json "$out/preflight.json" -- \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
  --ffn-hidden-size 128 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
  --untie-embeddings-and-output-weights --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 \
  --global-batch-size 8 --lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --bf16
tail -n 8 "$out"/loop.txt "$out"/layer_cost.txt "$out"/preflight.txt
exit $failed
