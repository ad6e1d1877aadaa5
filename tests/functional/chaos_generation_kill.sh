#!/usr/bin/env bash
# chaos_generation_kill: two generation workers; SIGKILL one of them mid-run while groups are in
# flight on it (watched through the run's metrics endpoint). The run must finish all its steps with exit 0, count
# the death (rollout/worker_deaths, the routable workers dip), and lose or repeat no prompt: with
# rollout.max_retries=0 a failure charged to a prompt would drop it, so the dead worker's prompts
# must have been re-dispatched uncharged (at least one was: the victim held work); nothing but the
# run's end may drop a prompt.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

STEPS=$(fx_pick 24 40)
KILL_AT=$(fx_pick 4 10)
log="$FX_OUT/run.log"
fx_start "$log" "$FX_CONFIG" "${FX_COMMON[@]}" run.max_steps="$STEPS" \
  backend.num_generation_workers=2 rollout.max_retries=0
fx_wait_step "$FX_PID" "$log" "$KILL_AT"
mapfile -t victims < <(fx_generation_pids "$FX_PID")
((${#victims[@]} == 2)) || fx_fail "expected 2 generation worker processes in the run, found ${#victims[@]}: ${victims[*]}" "$log"
url=$(fx_metrics_url "$log")
[[ -n "$url" ]] || fx_fail "the run printed no metrics URL" "$log"
# Kill while groups are in flight (the run's own gauge, polled every 20 ms): with 2 or more in flight
# and least-loaded routing, each worker holds at least one, so the victim dies holding work.
in_flight=$("$FX_PY" - "$url" "${victims[0]}" <<'PY'
import os, re, signal, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    n = sum(float(v) for v in re.findall(r"^sc_grpo_in_flight_groups\{[^}]*\} (\S+)$", body, re.M))
    if n >= 2:
        os.kill(pid, signal.SIGKILL)
        print(int(n))
        sys.exit(0)
    time.sleep(0.02)
sys.exit(1)
PY
) || fx_fail "never saw 2 groups in flight within 120 s to kill a worker under" "$log"
fx_log "step $(fx_last_step "$log"), $in_flight groups in flight: killed generation worker ${victims[0]} (kill -9)"
fx_wait_exit "$FX_PID" "$log"
((FX_RC == 0)) || fx_fail "sc-grpo run exited with $FX_RC after a generation worker was killed" "$log"
! grep -q '^Traceback' "$log" || fx_fail "sc-grpo run printed a traceback" "$log"
fx_assert_no_leftovers "$FX_PID"
run=$(fx_run_dir "$log")
fx_check finished "$run" --steps "$STEPS"
fx_check exactly-once "$run" --steps "$STEPS"
fx_check worker-killed "$run" --deaths 1 --workers 2 --min-redispatched 1
