#!/usr/bin/env bash
# One-command check of meshplan on one NVIDIA GPU (H100 / H200), issue #28 item 5.
#
#   benchmarks/gpu_check.sh [--out DIR] [--wheels DIR] [--quick] [--cpu] [--only 05,06,13]
#   benchmarks/gpu_check.sh --download-wheels DIR     # on a machine WITH a package index, beforehand
#
# Steps, each under its own `timeout`, each logging to DIR/NN-name.log (lines time-stamped) and
# appending "name<TAB>exit code<TAB>seconds" to DIR/status.tsv; a failed step does not stop the rest.
# They run in order of what matters most when device time is short (the runs and their memory first):
#   01 plan       meshplan plan gpt2-xl -n 1 on this GPU's preset (batch 8 x 1024)
#   02 run        meshplan run on synthetic data (RunRecord run_synthetic.json)
#   03 plan alt   the same model pinned to another configuration (microbatch 2, full recompute)
#   04 run alt    meshplan run of it (run_alt.json): a second measured point, for calibration transfer
#   05 plan 8B    meshplan plan llama3-8b -n 1, batch 8 x 4096 (the planner's pick at this GPU's memory edge;
#                 QLoRA when nothing else fits)
#   06 run 8B     meshplan run of that plan: does what the planner says fits, fit?
#   05q/06q       the QLoRA plan of the same model and batch, planned and run even where a 16-bit plan fits
#                 (run_8b_qlora.json: the meta build's startup and the QLoRA step on a GPU with room to spare)
#   05r/06r       that QLoRA plan pinned to microbatch BATCH/2 with op recompute (run_8b_qlora_op.json)
#   07 tokens     meshplan prepare-data (byte tokens of the repo's prose, ~0.5 MB) -> tokens.bin
#   08 run        meshplan run on tokens.bin (RunRecord run_tokens.json)
#   09 calibrate  meshplan calibrate on both gpt2-xl default-plan RunRecords -> calibrated.json
#   10 replan     meshplan plan on the calibrated cluster
#   11 transfer   calibrate on run_synthetic.json alone, then price the alt configuration (03) on it: the
#                 prediction for a configuration the fit never saw (#33 item 6), compared with run_alt.json
#   12 bench      benchmarks/bench_gpu.py: hand-written bf16 loop vs the runtime (gpt2-xl, llama-1b)
#   13 profile    meshplan profile --nproc 1 (#28 item 4): one device measured, the links derived
#   14 local      meshplan plan MODEL -n 4 --cluster local (#29 item 3): this GPU profiled once, replicated 4 times
#   15 host       benchmarks/host_overhead.py: the host's per-op dispatch and per-block eager time (host_overhead.json),
#                 what the cost model's host-dispatch floor reads
#   16 pretrained a Hugging Face Llama (random weights of another seed) written with save_pretrained, planned and
#                 run from those weights (`meshplan run --init-from`, RunRecord run_hf.json)
#   17 qlora      benchmarks/qlora_dequant_gpu.py: torchao's eager NF4 dequantization and the QLoRA linear's
#                 forward + backward at Llama-3-8B shapes, CUDA events, each next to its prediction (#33)
#   18 optimizer  18a benchmarks/optimizer_device.py --kernels: the optimizer phase part by part (CUDA events and
#                 host time, one clip+adam's CUDA kernels under torch.profiler) beside its price (optimizer.json);
#                 18b the default plan run again with 5 profiled steps (run_optphase.json: its phases averaged
#                 over 5 steps where run_synthetic.json has 1) (#33, the optimizer phase)
# Then benchmarks/gpu_check_report.py prints (and writes DIR/summary.md) predicted vs measured step
# time and peak memory per run, launch-to-first-step seconds, and the calibrated re-plan.
#
# The GPU machine has no package index (shared/PLATFORM.md "The GPU machine": torch 2.11, no pulp,
# highspy or torchao). --download-wheels DIR fetches cp312 manylinux wheels of the three beforehand; --wheels DIR
# installs them there with --no-index into DIR/site (nothing outside DIR is touched).
# --cpu runs the same steps with tiny models on the CPU (gloo), to check the script itself; --quick
# shortens the GPU runs. Typical wall time on one GPU: about 6-8 minutes with --quick (see
# BENCHMARKS.md); the sum of the step timeouts bounds the worst case.
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
OUT="gpu_check_$(date +%Y%m%d_%H%M%S)"
WHEELS=""
CPU=0
QUICK=0
ONLY=""  # --only: the step numbers to run (a re-run on a short device lease); the rest are skipped
PY=${PYTHON:-python3}

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --quick) QUICK=1; shift ;;
    --only) ONLY=",$2,"; shift 2 ;;
    --download-wheels)
      mkdir -p "$2"
      exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$2" pulp==3.3.2 highspy==1.16.0 torchao==0.18.0 ;;
    -h|--help) sed -n '2,/^set -u/{/^set -u/!p}' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE="$OUT/site"
mkdir -p "$SITE"
# a stuck step prints every thread's stack before its timeout kills it (faulthandler)
cat > "$SITE/sitecustomize.py" <<'EOF'
import faulthandler
import os
import sys

_after = float(os.environ.get("GPU_CHECK_DUMP_AFTER_S", "0") or 0)
if _after > 0:
    faulthandler.dump_traceback_later(_after, exit=False, file=sys.stderr)
EOF
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
: > "$OUT/status.tsv"

stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done; }

# step NAME TIMEOUT_S CMD...: run CMD under timeout, time-stamped log, status line
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",${name%%-*},"* ]]; then return 0; fi
  local log="$OUT/$name.log" t0 rc
  t0=$(date +%s.%N)
  echo "== $name (at most ${limit}s): $*"
  echo "== $*" > "$log"
  printf '%s launch\n' "$t0" >> "$log"
  GPU_CHECK_DUMP_AFTER_S=$((limit > 15 ? limit - 10 : limit)) timeout --kill-after=15 "$limit" "$@" 2>&1 | stamp >> "$log"
  rc=${PIPESTATUS[0]}
  awk -v n="$name" -v rc="$rc" -v t0="$t0" -v t1="$(date +%s.%N)" 'BEGIN { printf "%s\t%s\t%.1f\n", n, rc, t1 - t0 }' \
    >> "$OUT/status.tsv"  # awk, not bc: the GPU machine's image has no bc
  tail -n 4 "$log" | cut -d' ' -f2- | grep -v '^launch$' | sed 's/^/   /'
  [ "$rc" = 124 ] && echo "   TIMED OUT after ${limit}s (stacks in $log)"
  return 0
}

MP=("$PY" -m meshplan.cli)  # `timeout` runs programs, not shell functions

# ---- environment --------------------------------------------------------------------------------
{
  date -u
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv
  git -C "$REPO" rev-parse --short HEAD 2>/dev/null
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
if ! "$PY" -c 'import pulp, highspy, torchao' 2>/dev/null; then
  if [ -n "$WHEELS" ]; then
    "$PY" -m pip install --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl > "$OUT/00-wheels.log" 2>&1 \
      || { echo "installing the wheels of $WHEELS failed: $OUT/00-wheels.log" >&2; exit 2; }
  else
    echo "pulp/highspy/torchao missing: bring wheels (gpu_check.sh --download-wheels DIR elsewhere, then --wheels DIR)" >&2
    exit 2
  fi
fi

if [ "$CPU" = 1 ]; then
  CLUSTER=h100  # predictions for an H100; the report marks them not comparable with a CPU run
  MODEL=gpt-tiny; BATCH=4; SEQ=32; STEPS=3; RUN_EXTRA=(--threads 1)
  BIG=llama-tiny; BIG_SEQ=32; BIG_BATCH=4; BENCH=(--models gpt2-small --batch 2 --seq 64 --steps 2 --warmup 1)
  HF_CFG="num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64"
else
  GPU_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)
  CLUSTER=$("$PY" -c "from meshplan.cost_models.hardware import preset_for_gpu_name as p; print(p('$GPU_NAME') or '')")
  if [ -z "$CLUSTER" ]; then echo "no cluster preset for GPU '$GPU_NAME' (h100, h200, a100 are known)" >&2; exit 2; fi
  MODEL=gpt2-xl; BATCH=8; SEQ=1024; STEPS=12; RUN_EXTRA=()
  BIG=llama3-8b; BIG_SEQ=4096; BIG_BATCH=8; BENCH=(--models gpt2-xl,llama-1b --batch 8 --seq 1024 --steps 15 --warmup 5)
  HF_CFG="num_hidden_layers=8, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048"
  if [ "$QUICK" = 1 ]; then STEPS=8; BENCH=(--models gpt2-xl --batch 8 --seq 1024 --steps 8 --warmup 3); fi
fi
echo "cluster preset: $CLUSTER; results in $OUT"
cd "$OUT" || exit 2

SHAPE=(--global-batch "$BATCH" --seq "$SEQ")
ALT=(--micro-batch 2 --recompute full)  # another configuration of the same model, same batch
step 01-plan 120 "${MP[@]}" plan "$MODEL" -n 1 --cluster "$CLUSTER" "${SHAPE[@]}" -o plan.json
step 02-run-synthetic 240 "${MP[@]}" run plan.json --model "$MODEL" --steps "$STEPS" --log-every 1 \
  --record run_synthetic.json "${RUN_EXTRA[@]}"
step 03-plan-alt 120 "${MP[@]}" plan "$MODEL" -n 1 --cluster "$CLUSTER" "${SHAPE[@]}" "${ALT[@]}" -o plan_alt.json
step 04-run-alt 240 "${MP[@]}" run plan_alt.json --model "$MODEL" --steps "$STEPS" --log-every 1 \
  --record run_alt.json "${RUN_EXTRA[@]}"
step 05-plan-8b 120 "${MP[@]}" plan "$BIG" -n 1 --cluster "$CLUSTER" --global-batch "$BIG_BATCH" --seq "$BIG_SEQ" -o plan_8b.json
if [ ! -s plan_8b.json ]; then  # nothing fits in full precision: the planner's QLoRA plan
  step 05b-plan-8b-qlora 120 "${MP[@]}" plan "$BIG" -n 1 --cluster "$CLUSTER" --global-batch "$BIG_BATCH" --seq "$BIG_SEQ" \
    --quantization qlora -o plan_8b.json
fi
if [ -s plan_8b.json ]; then
  step 06-run-8b 300 "${MP[@]}" run plan_8b.json --model "$BIG" --steps 6 --log-every 1 --profile-steps 0 \
    --record run_8b.json "${RUN_EXTRA[@]}"
fi
# the QLoRA plan of the same model and batch, whether or not a 16-bit plan fits (on an H200 one does): its
# startup is the meta build (each targeted linear initialised on the device and quantized at once)
step 05q-plan-8b-qlora-pinned 120 "${MP[@]}" plan "$BIG" -n 1 --cluster "$CLUSTER" --global-batch "$BIG_BATCH" \
  --seq "$BIG_SEQ" --quantization qlora -o plan_8b_qlora.json
if [ -s plan_8b_qlora.json ]; then
  step 06q-run-8b-qlora 300 "${MP[@]}" run plan_8b_qlora.json --model "$BIG" --steps 6 --log-every 1 --profile-steps 0 \
    --record run_8b_qlora.json "${RUN_EXTRA[@]}"
fi
# the same QLoRA run pinned to half the batch per microbatch with op recompute: what op recompute keeps of a QLoRA
# linear's three matmuls (memory.op_sac_kept_bytes mm_parts), measured
step 05r-plan-8b-qlora-op 120 "${MP[@]}" plan "$BIG" -n 1 --cluster "$CLUSTER" --global-batch "$BIG_BATCH" \
  --seq "$BIG_SEQ" --quantization qlora --micro-batch $((BIG_BATCH / 2)) --recompute op -o plan_8b_qlora_op.json
if [ -s plan_8b_qlora_op.json ]; then
  step 06r-run-8b-qlora-op 300 "${MP[@]}" run plan_8b_qlora_op.json --model "$BIG" --steps 6 --log-every 1 \
    --profile-steps 0 --record run_8b_qlora_op.json "${RUN_EXTRA[@]}"
fi
# a corpus of the repo's own prose (byte tokens): the bundled river_town.txt alone (8.7k tokens) is less than
# one global batch of 8 x 1025 at GPU shapes, for training or for the held-out split
cat "$REPO/tests/data/river_town.txt" "$REPO"/README.md "$REPO"/BENCHMARKS.md "$REPO"/docs/*.md > corpus.txt 2>/dev/null
step 07-tokens 60 "${MP[@]}" prepare-data corpus.txt -o tokens.bin --val-fraction 0.1
step 08-run-tokens 180 "${MP[@]}" run plan.json --model "$MODEL" --steps "$STEPS" --log-every 1 --data tokens.bin \
  --eval-every "$STEPS" --eval-batches 1 --record run_tokens.json "${RUN_EXTRA[@]}"
step 09-calibrate 60 "${MP[@]}" calibrate run_synthetic.json run_tokens.json --cluster "$CLUSTER" -o calibrated.json
step 10-replan 120 "${MP[@]}" plan "$MODEL" -n 1 --cluster calibrated.json "${SHAPE[@]}" -o plan_calibrated.json
step 11a-calibrate-one 60 "${MP[@]}" calibrate run_synthetic.json --cluster "$CLUSTER" -o calibrated_one.json
step 11b-transfer 120 "${MP[@]}" plan "$MODEL" -n 1 --cluster calibrated_one.json "${SHAPE[@]}" "${ALT[@]}" \
  -o plan_alt_calibrated.json
step 12-bench-gpu 240 "$PY" "$REPO/benchmarks/bench_gpu.py" "${BENCH[@]}"
step 13-profile-1dev 90 "${MP[@]}" profile --nproc 1 --quick --budget 45 -o profile_1dev.json
step 14-plan-local 120 env MESHPLAN_PROFILE_DIR="$OUT/profiles" MESHPLAN_LOCAL_BUDGET=45 "${MP[@]}" plan "$MODEL" -n 4 \
  --cluster local "${SHAPE[@]}" -o plan_local.json
step 15-host-overhead "$([ "$CPU" = 1 ] && echo 600 || echo 90)" "$PY" "$REPO/benchmarks/host_overhead.py" --device "$([ "$CPU" = 1 ] && echo cpu || echo cuda)" \
  --out host_overhead.json
# a Hugging Face model's weights, as `save_pretrained` writes them, are where most fine-tuning starts
cat > hf_model.py <<EOF
import torch
from meshplan.models.hf import hf_llama
CFG = dict($HF_CFG, tie_word_embeddings=False, attention_dropout=0.0)
def model():
    return hf_llama(CFG).train()
if __name__ == "__main__":
    torch.manual_seed(7)
    hf_llama(CFG).save_pretrained("hf_weights")
EOF
step 16a-save-pretrained 120 "$PY" hf_model.py
step 16b-plan-hf 120 "${MP[@]}" plan hf_model.py:model -n 1 --cluster "$CLUSTER" "${SHAPE[@]}" -o plan_hf.json
step 16c-run-pretrained 240 "${MP[@]}" run plan_hf.json --model hf_model.py:model --init-from hf_weights --steps "$STEPS" \
  --log-every 1 --record run_hf.json "${RUN_EXTRA[@]}"
if [ "$CPU" = 1 ]; then QL=(--device cpu --scale 32 --reps 2); else QL=(); fi
step 17-qlora-dequant 120 "$PY" "$REPO/benchmarks/qlora_dequant_gpu.py" --json qlora_dequant.json "${QL[@]}"
if [ "$CPU" = 1 ]; then OPT=(--device cpu --model gpt-tiny --preset h100 --reps 2); else OPT=(--kernels); fi
step 18a-optimizer 120 "$PY" "$REPO/benchmarks/optimizer_device.py" --out optimizer.json "${OPT[@]}"
step 18b-run-phases 240 "${MP[@]}" run plan.json --model "$MODEL" --steps 4 --profile-steps 5 --log-every 1 \
  --record run_optphase.json "${RUN_EXTRA[@]}"

"$PY" "$REPO/benchmarks/gpu_check_report.py" "$OUT" | tee "$OUT/summary.md"
