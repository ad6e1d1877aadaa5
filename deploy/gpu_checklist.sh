#!/usr/bin/env bash
# The GPU checklist (docs/gpu.md), as one script: run it on a CUDA machine with the `gpu` extra
# installed, from the repository root, and paste its summary into docs/gpu.md.
#
#   deploy/gpu_checklist.sh              # on the GPU machine (steps needing 2 GPUs skip, saying so, on 1)
#   deploy/gpu_checklist.sh --dry-run    # on a CPU machine: each step's CPU twin, to prove the script
#   deploy/gpu_checklist.sh --one-gpu [--dry-run]   # step 5 alone, then step 1 (one GPU: what fits it)
#
# Steps (each prints "== step: ..." and its figures; the summary is $OUT/gpu_checklist.md):
#   1. the `gpu`-marked tests (skipped cleanly without CUDA)
#   2. the 2-GPU functional suite (tests/e2e/functional/*.sh with SC_GRPO_DEVICE=gpu)
#   3. `sc-grpo bench sync` over NCCL (2+ GPUs: the sender and each worker a GPU of their own)
#   4. a short bf16 run of a 0.4 B-parameter random-init Qwen2 (hidden 1024, 24 layers, tied) (vLLM + Megatron, one GPU each): tokens/s,
#      step time, sync time from metrics.jsonl, peak GPU memory from nvidia-smi
#   5. one GPU (`sc-grpo bench one-gpu`, configs/one_gpu.yaml): vLLM alone, sc-grpo colocated on the
#      GPU in both forms (shared, turns) and TRL's colocated GRPOTrainer, same model and settings:
#      steps/s, the step's split, tokens/s per phase, MFU, peak memory, mismatch KL, the two ratios
# Environment: OUT (default runs/gpu_checklist), STEPS (default 20, step 4's run.max_steps), STEPS_ONE
# (step 5's --steps, default 6), ONLY (step 5's contenders, default all five), TESTS=0 (skip step 1).
# On a machine with no network the packages travel first: deploy/gpu_carry.sh (docs/gpu.md).
set -uo pipefail

DRY=0
ONE=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    --one-gpu) ONE=1 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_checklist}
STEPS=${STEPS:-20}
mkdir -p "$OUT"
SUMMARY="$OUT/gpu_checklist.md"
: > "$SUMMARY"
GPUS=0
if [[ $DRY == 0 ]] && command -v nvidia-smi > /dev/null; then
  GPUS=$(nvidia-smi --list-gpus | wc -l)
fi
note() { echo "$*" | tee -a "$SUMMARY"; }
step() { echo; echo "== step: $*"; }

note "# GPU checklist, $(date -u +%F) ($([[ $DRY == 1 ]] && echo "dry run on CPU" || echo "$GPUS GPU(s)"))"
if [[ $GPUS -gt 0 ]]; then
  note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
fi
note "$($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"

gpu_tests() {
  step "1. gpu-marked tests"
  T0=$SECONDS
  $PY -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
  note "| gpu tests | $(tail -1 "$OUT/gpu_tests.log") ($((SECONDS - T0)) s) |"
}

if [[ $ONE == 1 ]]; then
  step "5. one GPU: vLLM alone, sc-grpo shared and turns, TRL colocated (bench one-gpu)"
  ARGS=(configs/one_gpu.yaml --steps "${STEPS_ONE:-6}" --out "$OUT/one_gpu")
  [[ $DRY == 1 ]] && ARGS+=(--dry-run)
  [[ -n "${ONLY:-}" ]] && ARGS+=(--only $ONLY)
  T0=$SECONDS
  PYTHONUNBUFFERED=1 $PY -m single_controller bench one-gpu "${ARGS[@]}" 2>&1 | tee "$OUT/one_gpu.log" | tail -25
  RC=${PIPESTATUS[0]}
  cat "$OUT/one_gpu/one_gpu.md" >> "$SUMMARY" 2> /dev/null || note "| bench one-gpu | no table: see $OUT/one_gpu.log |"
  note "| bench one-gpu | exit $RC, $((SECONDS - T0)) s |"
  [[ ${TESTS:-1} == 1 ]] && gpu_tests
  echo; echo "summary: $SUMMARY"; cat "$SUMMARY"
  exit $RC
fi

gpu_tests

step "2. functional suite on 2 GPUs"
if [[ $GPUS -ge 2 ]]; then
  T0=$SECONDS
  RC=0
  for s in tests/e2e/functional/*.sh; do
    [[ $(basename "$s") == lib.sh ]] && continue
    SC_GRPO_DEVICE=gpu bash "$s" > "$OUT/$(basename "$s" .sh).log" 2>&1 || { RC=1; note "| functional $(basename "$s") | FAILED (see $OUT) |"; }
  done
  note "| functional suite (gpu) | $([[ $RC == 0 ]] && echo passed || echo failed) ($((SECONDS - T0)) s) |"
else
  note "| functional suite (gpu) | skipped: needs 2 GPUs, has $GPUS |"
fi

step "3. bench sync"
if [[ $GPUS -ge 2 ]]; then
  WORKERS="1"; [[ $GPUS -ge 3 ]] && WORKERS="1 2"
  $PY -m single_controller bench sync --backend nccl --params 100M 500M --workers $WORKERS \
    --json "$OUT/bench_sync.json" 2>&1 | tee "$OUT/bench_sync.log" | tail -8
elif [[ $DRY == 1 ]]; then  # the CPU twin: gloo, a small model
  $PY -m single_controller bench sync --params 10M --workers 1 --repeats 1 \
    --json "$OUT/bench_sync.json" 2>&1 | tee "$OUT/bench_sync.log" | tail -4
else
  echo "skipped: NCCL needs a GPU per process (2+)" | tee "$OUT/bench_sync.log"
fi
note '```'; grep -E "^ *(params|[0-9]+M) " "$OUT/bench_sync.log" >> "$SUMMARY" || note "(no bench rows)"; note '```'

step "4. a 0.4 B-parameter Qwen2 in bf16, vLLM + Megatron"
MODEL="$OUT/qwen2-0.5b-class"
# configs/functional.yaml: vLLM + Megatron on the built-in digit task (so the character tokenizer)
if [[ $DRY == 1 ]]; then  # the same arch and options, CPU-sized, through vLLM's CPU engine and Megatron over gloo
  SIZE=(--hidden-size 64 --num-layers 2 --head-dim 32)
  RUN=(configs/functional.yaml)
else
  SIZE=(--hidden-size 1024 --num-layers 24 --head-dim 64)
  RUN=(configs/functional.yaml vllm.device=cuda megatron.cpu_emulation=false)
fi
[[ -d "$MODEL" ]] || $PY -m single_controller init-model "$MODEL" --arch qwen2 --tokenizer char --tie-embeddings "${SIZE[@]}" > /dev/null
PARAMS=$($PY -c "import json,sys; c=json.load(open(sys.argv[1]+'/config.json')); h,l,v,i=c['hidden_size'],c['num_hidden_layers'],c['vocab_size'],c['intermediate_size']; print(f'{(l*(4*h*h+3*h*i)+v*h)/1e6:.1f}M')" "$MODEL")
if [[ $DRY == 1 || $GPUS -ge 2 ]]; then
  SMI=""
  if [[ $GPUS -gt 0 ]]; then
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_memory.csv" &
    SMI=$!
  fi
  T0=$SECONDS
  $PY -m single_controller run "${RUN[@]}" model.path="$MODEL" model.create=false model.dtype=bfloat16 \
    run.max_steps="$STEPS" run.stop_at_success_rate=null run.output_dir="$OUT/runs" run.name=qwen2-bf16 \
    run.progress_bar=false run.plot=false metrics.port=0 > "$OUT/qwen2_run.log" 2>&1
  RC=$?
  [[ -n "$SMI" ]] && kill "$SMI"
  RUN_DIR=$(ls -td "$OUT"/runs/qwen2-bf16-* 2> /dev/null | head -1)
  $PY - "$RUN_DIR" "$OUT/gpu_memory.csv" "$RC" "$((SECONDS - T0))" "$PARAMS" >> "$SUMMARY" << 'EOF'
import json, os, statistics, sys
run_dir, smi, rc, wall, params = sys.argv[1:]
rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))] if run_dir else []
def med(key):
    vals = [r[key] for r in rows[2:] if r.get(key) is not None]  # past the first steps' warm-up
    return f"{statistics.median(vals):.3g}" if vals else "n/a"
peak = "n/a"
if os.path.exists(smi) and os.path.getsize(smi):
    by_gpu = {}
    for line in open(smi):
        i, used = (x.strip() for x in line.split(","))
        by_gpu[i] = max(by_gpu.get(i, 0), int(used))
    peak = ", ".join(f"GPU {i} {m} MiB" for i, m in sorted(by_gpu.items()))
print(f"| qwen2 {params} bf16 run | rc {rc}, {len(rows)} steps, {wall} s; gen tokens/s {med('throughput/gen_tokens_per_s')}, "
      f"train tokens/s {med('throughput/train_tokens_per_s')}, step {med('time/step_s')} s, train step "
      f"{med('train/step_s')} s, sync {med('sync/last_s')} s, mismatch_kl {med('train/mismatch_kl')}, "
      f"gen_logprob_gap {med('train/gen_logprob_gap')}; peak {peak} |")
EOF
else
  note "| qwen2 $PARAMS bf16 run | skipped: vLLM and the Megatron rank need a GPU each, has $GPUS |"
fi
echo; echo "summary: $SUMMARY"; cat "$SUMMARY"
