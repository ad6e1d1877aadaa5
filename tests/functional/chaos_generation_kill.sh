#!/usr/bin/env bash
# chaos_generation_kill: two generation workers; SIGKILL one of them mid-run (while rollouts are in
# flight: lookahead 1 keeps the workers busy). The run must finish all its steps with exit 0, count
# the death (rollout/worker_deaths, the routable workers dip), and lose or repeat no prompt: with
# rollout.max_retries=0 a failure charged to a prompt would drop it, so the dead worker's prompts
# must have been re-dispatched uncharged; nothing but the run's end may drop a prompt.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

STEPS=$(fx_pick 16 30)
KILL_AT=$(fx_pick 4 10)
log="$FX_OUT/run.log"
fx_start "$log" "$FX_CONFIG" "${FX_COMMON[@]}" run.max_steps="$STEPS" \
  backend.num_generation_workers=2 rollout.max_retries=0
fx_wait_step "$FX_PID" "$log" "$KILL_AT"
mapfile -t victims < <(fx_generation_pids "$FX_PID")
((${#victims[@]} == 2)) || fx_fail "expected 2 generation worker processes in the run, found ${#victims[@]}: ${victims[*]}" "$log"
fx_log "step $(fx_last_step "$log"): kill -9 generation worker ${victims[0]}"
kill -KILL "${victims[0]}"
fx_wait_exit "$FX_PID" "$log"
((FX_RC == 0)) || fx_fail "sc-grpo run exited with $FX_RC after a generation worker was killed" "$log"
! grep -q '^Traceback' "$log" || fx_fail "sc-grpo run printed a traceback" "$log"
fx_assert_no_leftovers "$FX_PID"
run=$(fx_run_dir "$log")
fx_check finished "$run" --steps "$STEPS"
fx_check exactly-once "$run" --steps "$STEPS"
fx_check worker-killed "$run" --deaths 1 --workers 2
