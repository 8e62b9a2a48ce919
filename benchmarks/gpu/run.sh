#!/usr/bin/env bash
# The GPU device script (issue 34): everything a lent GPU's short slot is for, in one run of about 8 minutes (487 s
# on an H200, 2026-11-28).
#
#   bash benchmarks/gpu/run.sh OUT_DIR             on the GPU machine, from the repository root, with .whl/ holding
#                                                  the megatron-core 0.19.2 wheel and this project's wheel
#   bash benchmarks/gpu/run.sh OUT_DIR --dry-run   here on CPU (gloo, cpu_testbed, tiny shapes): checks the script
#
# Steps (each step's output in OUT_DIR/<step>.txt; a failed step is reported and the next one still runs;
# STEPS="name ..." runs only those, for a rerun of what failed):
#   loop         benchmarks/gpu/megatron_lm_cuda.py: Megatron-LM's loop on CUDA + NCCL with the plugin alone
#   layer_cost   benchmarks/gpu/layer_cost.py: LoRA's cost per MLP layer pair at hidden 4096 / 8192, TP 1 / 8 shards
#   invariant_cost  benchmarks/tp_invariant.py --device cuda --topology tp1: the layout_invariant mode's step cost and
#                memory at world size 1 against the default mode
#   preflight    `megatron-lora-patch preflight --device cuda` at world size 1 on a tiny dense bf16 model with the
#                GPU path's fusions: the bf16 rule against an fp32 run (proof/oracle/bf16_rule.py); must PASS (exit 0)
#   pf_mutation  the same with --mutation wrong_qkv_packing (bites at world size 1): must FAIL (exit 1)
#   pf_refuse    the same with Megatron-LM's default --transformer-impl transformer_engine on a node without
#                Transformer Engine: must refuse in one line (exit 2)
# The GPU machine has no network: the wheels install into its python3's environment beside torch, transformers and
# peft (not --target: the package's .pth start-up hook must run, or the plugin would never activate).
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
  invariant=(--device cpu --hidden 64 --seq 32 --rounds 2 --steps 2 --global-batch 4)
  device=(--device cpu)
  world=(--data-parallel-size 2)  # one CPU rank compares nothing (a GPU run's world size 1 checks its kernels)
else
  python=$(command -v python3)  # itself a venv there (/opt/torch/.venv): a venv on top would not see its torch
  "$python" -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
  # The megatron-core wheel ships the compiled dataset helpers but not their Makefile, and Megatron-LM's `pretrain()`
  # runs `make` in that folder on rank 0 (a source checkout has it; on CPU the cpu_testbed plugin skips the make):
  # a Makefile whose default target only checks that the shipped library is there.
  datasets=$("$python" -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))" 2>/dev/null)
  printf 'default:\n\t@ls helpers_cpp*.so\n' > "$datasets/Makefile"
  loop=(--iterations 20)
  loop_limit=420  # four launches of about 50 s each on an H200 machine, then the checks (CPU, GPUs hidden)
  cost=()
  invariant=(--device cuda --hidden 1024 --seq 1024 --rounds 4 --steps 4 --global-batch 8)
  device=(--device cuda)
  world=(--data-parallel-size 1)  # one GPU: NCCL refuses two ranks on one device
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt"
  "$python" -c "import sys, torch, transformers, peft, megatron.core as mc; print(sys.version.split()[0], 'torch',
    torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__,
    'megatron-core', mc.__version__)" >> "$out/device.txt" 2>&1
fi

step() {  # step NAME SECONDS EXPECTED_EXIT COMMAND...: run it under a time limit, output to OUT_DIR/NAME.txt
  local name=$1 limit=$2 expected=$3 started=$SECONDS
  shift 3
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  local status=$?
  echo "== $name: exit $status (expected $expected) in $((SECONDS - started)) s" | tee -a "$out/summary.txt"
  [ $status -eq "$expected" ] || failed=1
}

preflight() {  # preflight NAME EXPECTED_EXIT [OPTIONS...] -- [EXTRA MEGATRON ARGS...]: the tiny dense bf16 model
  local name=$1 expected=$2
  shift 2
  step "$name" 100 "$expected" "$python" -P -m megatron_lora_patch preflight "${device[@]}" --steps 3 \
    --json "$out/$name.json" "$@" --num-layers 2 --hidden-size 256 --num-attention-heads 4 --group-query-attention \
    --num-query-groups 2 --ffn-hidden-size 512 --swiglu --normalization RMSNorm --position-embedding-type rope \
    --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer \
    --vocab-size 512 --bf16
}

step loop "$loop_limit" 0 "$python" -P benchmarks/gpu/megatron_lm_cuda.py "$out/loop" "${loop[@]}"
step layer_cost 100 0 "$python" -P benchmarks/gpu/layer_cost.py --json "$out/layer_cost.json" "${cost[@]}"
step invariant_cost 150 0 "$python" -P benchmarks/tp_invariant.py --topology tp1 "${invariant[@]}"
local_kernels=(--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm
               --no-masked-softmax-fusion --no-rope-fusion)
preflight preflight 0 "${world[@]}" -- "${local_kernels[@]}"
preflight pf_mutation 1 --data-parallel-size 1 --mutation wrong_qkv_packing -- "${local_kernels[@]}"
preflight pf_refuse 2 --data-parallel-size 1 --
for name in loop layer_cost invariant_cost preflight pf_mutation pf_refuse; do
  [ -f "$out/$name.txt" ] && tail -n 8 "$out/$name.txt"
done
exit $failed
