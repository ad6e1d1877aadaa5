# Shared helpers of the functional scripts (tests/e2e/functional/*.sh), sourced by each of them.
#
# A functional script runs the real `sc-grpo run` (vLLM generation + the Megatron trainer, the
# config configs/functional.yaml) as a user does, and asserts on what it leaves behind: exit code,
# metrics.jsonl, prompt_ledger.json, summary.json, checkpoints, Prometheus, leftover processes.
#
# Environment:
#   SC_GRPO_DEVICE            cpu (default): vLLM's CPU engine + Megatron over gloo (CPU emulation),
#                             smaller limits; gpu: vLLM on one GPU, the Megatron rank on another
#                             (needs 2 CUDA GPUs), larger limits
#   SC_GRPO_FUNCTIONAL_WORK   a directory shared by the scripts of one suite: the model directory
#                             is written there once and reused (default: a fresh temporary one,
#                             removed when the script passes)
#   PYTHON                    the interpreter (default python3)
# The scripts always run the checkout they belong to (its root is put first on PYTHONPATH).
#
# Every run starts in a session of its own (setsid): "the run" is every process of that session,
# Ray's included, so kills and the leftover check never touch another run on the same machine.
# On exit (pass, fail or signal) whatever is left of this script's runs is killed.

set -euo pipefail

FX_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FX_ROOT=$(cd "$FX_HERE/../../.." && pwd)
export PYTHONPATH="$FX_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
FX_PY=${PYTHON:-python3}
FX_NAME=$(basename "$0" .sh)
FX_DEVICE=${SC_GRPO_DEVICE:-cpu}
FX_CONFIG="$FX_ROOT/configs/functional.yaml"
FX_CHECK=("$FX_PY" "$FX_HERE/check.py")
FX_SESSIONS=()
FX_T0=$SECONDS

if [[ -n "${SC_GRPO_FUNCTIONAL_WORK:-}" ]]; then
  FX_WORK=$SC_GRPO_FUNCTIONAL_WORK
  FX_OWN_WORK=0
else
  FX_WORK=$(mktemp -d "${TMPDIR:-/tmp}/sc-grpo-functional.XXXXXX")
  FX_OWN_WORK=1
fi
mkdir -p "$FX_WORK"
FX_WORK=$(cd "$FX_WORK" && pwd)
FX_OUT="$FX_WORK/$FX_NAME-$$"  # this script's run directories and logs
mkdir -p "$FX_OUT"
cd "$FX_WORK"  # the config's model.path (runs/models/...) is relative: shared by the suite

# The device twin: everything else is the same config and the same script.
case "$FX_DEVICE" in
  cpu) FX_DEVICE_OVERRIDES=() ;;
  gpu) FX_DEVICE_OVERRIDES=(vllm.device=cuda megatron.cpu_emulation=false) ;;
  *) echo "FAIL [$FX_NAME]: SC_GRPO_DEVICE must be cpu or gpu, not '$FX_DEVICE'" >&2; exit 2 ;;
esac
# Overrides every run of a script gets (before the script's own).
FX_COMMON=("run.output_dir=$FX_OUT" "${FX_DEVICE_OVERRIDES[@]}")

fx_log() { echo "[$FX_NAME $((SECONDS - FX_T0))s] $*" >&2; }

# fx_fail MESSAGE [LOG]: print one readable line (and the end of LOG) and stop the script with 1.
fx_fail() {
  echo "FAIL [$FX_NAME]: $1" >&2
  if [[ -n "${2:-}" && -f "$2" ]]; then
    echo "---- last lines of $2 ----" >&2
    grep -v -e '^\s*$' -e 'Warning\|warn(' "$2" | tail -n 25 >&2 || true
  fi
  exit 1
}

# fx_pick CPU_VALUE GPU_VALUE: the value for this device (smaller limits on the CPU).
fx_pick() { if [[ "$FX_DEVICE" == gpu ]]; then echo "$2"; else echo "$1"; fi; }

# fx_check SUBCOMMAND ARGS...: an assertion of check.py; on failure its message (what is wrong, with
# the numbers) is the FAIL line.
fx_check() {
  local out
  if out=$("${FX_CHECK[@]}" "$@" 2>&1); then
    echo "$out" >&2
  else
    fx_fail "$out"
  fi
}

# fx_start LOG ARGS...: start `sc-grpo run ARGS` in a session of its own, output to LOG; sets FX_PID
# (= the session id). ARGS is a config file or --resume DIR, then key=value overrides.
fx_start() {
  local log=$1
  shift
  setsid "$FX_PY" -m single_controller run "$@" >"$log" 2>&1 </dev/null &
  FX_PID=$!
  FX_SESSIONS+=("$FX_PID")
  local sid t0=$SECONDS
  while sid=$(ps -o sid= -p "$FX_PID" | tr -d ' ') && [[ "$sid" != "$FX_PID" ]]; do  # setsid not done yet
    ((SECONDS - t0 < 10)) || fx_fail "the run (pid $FX_PID) did not get a session of its own (sid $sid)"
    sleep 0.05
  done
  fx_log "started sc-grpo run $* (pid $FX_PID, log $log)"
}

# fx_last_step LOG: the highest step the run printed (-1: none yet).
fx_last_step() { awk 'match($0, /^step +[0-9]+\//) { s = substr($0, RSTART + 5, RLENGTH - 6) + 0; if (s > m) m = s } END { print (NR && m != "" ? m : -1) }' m=-1 "$1"; }

# fx_wait_step PID LOG STEP [TIMEOUT_S]: wait until the run printed step STEP (or a later one).
fx_wait_step() {
  local pid=$1 log=$2 step=$3 timeout=${4:-600} t0=$SECONDS
  while (($(fx_last_step "$log") < step)); do
    kill -0 "$pid" 2>/dev/null || fx_fail "the run ended before step $step" "$log"
    ((SECONDS - t0 < timeout)) || fx_fail "the run did not reach step $step within ${timeout}s" "$log"
    sleep 0.2
  done
}

# fx_wait_exit PID LOG [TIMEOUT_S]: wait for the run to exit; sets FX_RC to its exit code.
fx_wait_exit() {
  local pid=$1 log=$2 timeout=${3:-900} t0=$SECONDS
  while kill -0 "$pid" 2>/dev/null && [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" != Z* ]]; do
    ((SECONDS - t0 < timeout)) || fx_fail "the run did not exit within ${timeout}s" "$log"
    sleep 1
  done
  FX_RC=0
  wait "$pid" || FX_RC=$?
}

# fx_run LOG ARGS...: run `sc-grpo run ARGS` to its end; fail unless it exits 0 without a traceback,
# and unless nothing of it is left running afterwards.
fx_run() {
  local log=$1
  fx_start "$@"
  fx_wait_exit "$FX_PID" "$log"
  ((FX_RC == 0)) || fx_fail "sc-grpo run exited with $FX_RC" "$log"
  ! grep -q '^Traceback' "$log" || fx_fail "sc-grpo run printed a traceback" "$log"
  fx_assert_no_leftovers "$FX_PID"
}

# fx_run_dir LOG: the run directory the run printed.
fx_run_dir() {
  local d
  d=$(sed -n -e 's/^sc-grpo: run directory //p' -e 's/^sc-grpo: resuming \(.*\) from the checkpoint of step [0-9]*$/\1/p' "$1" | head -n 1)
  [[ -n "$d" ]] || fx_fail "no run directory in the output" "$1"
  echo "$d"
}

# fx_metrics_url LOG: the Prometheus endpoint the run printed ("" while not printed yet).
fx_metrics_url() { sed -n 's/^sc-grpo: metrics on //p' "$1" | head -n 1; }

# fx_session_procs SID: "pid args" of every live (non-zombie) process of session SID.
fx_session_procs() {
  ps -e -o pid=,sid=,stat=,args= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ { $2 = ""; $3 = ""; print }'
}

# fx_generation_pids SID: pids of the run's generation worker actors (vLLM or torch).
fx_generation_pids() { fx_session_procs "$1" | awk '$2 ~ /^ray::[A-Za-z]*GenerationActor/ { print $1 }'; }

# fx_kill_run SID: kill -9 the whole run: the driver and every process of its session.
fx_kill_run() {
  local sid=$1 t0=$SECONDS pids
  kill -KILL -- "-$sid" 2>/dev/null || true
  while :; do
    pids=$(fx_session_procs "$sid" | awk '{ print $1 }')
    [[ -z "$pids" ]] && break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    ((SECONDS - t0 < 30)) || fx_fail "processes of the killed run survive: $pids"
    sleep 0.2
  done
  { wait "$sid"; } 2>/dev/null || true  # (without bash's "Killed" job notice)
}

# fx_assert_no_leftovers SID: after the run exited, no process of its session may stay (30 s grace).
fx_assert_no_leftovers() {
  local sid=$1 t0=$SECONDS left
  while left=$(fx_session_procs "$sid") && [[ -n "$left" ]]; do
    if ((SECONDS - t0 >= 30)); then
      fx_kill_run "$sid"
      fx_fail "processes of the finished run (session $sid) are still running 30 s after it exited:
$left"
    fi
    sleep 1
  done
}

fx_cleanup() {
  local rc=$? sid
  for sid in "${FX_SESSIONS[@]}"; do
    if [[ -n "$(fx_session_procs "$sid")" ]]; then
      kill -KILL -- "-$sid" 2>/dev/null || true
      fx_session_procs "$sid" | awk '{ print $1 }' | xargs -r kill -KILL 2>/dev/null || true
    fi
  done
  if [[ -n "${FX_PROM_PID:-}" ]]; then kill -KILL "$FX_PROM_PID" 2>/dev/null || true; fi
  if ((rc == 0)); then
    echo "PASS [$FX_NAME] in $((SECONDS - FX_T0))s (device $FX_DEVICE)" >&2
    ((FX_OWN_WORK == 0)) || rm -rf "$FX_WORK"
  else
    echo "[$FX_NAME] kept $FX_OUT for inspection" >&2
  fi
}
trap fx_cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
