#!/usr/bin/env bash
# checkpoint_resume: kill -9 the whole run (driver, Ray, workers) mid-run, between checkpoints; no
# process of it may survive. Resume with `sc-grpo run --resume RUN_DIR`: it continues from the newest
# checkpoint, regenerates what was lost, and finishes. Over both halves every step 0..N-1 trained
# groups_per_step prompts, no prompt twice and none lost; metrics.jsonl holds each step once.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

EVERY=$(fx_pick 4 10)
KILL_AT=$(fx_pick 6 15)  # past the first checkpoint: steps after the newest one are lost and redone
MORE=$(fx_pick 6 10)     # steps the resumed run trains past the checkpoint
log1="$FX_OUT/run1.log"
fx_start "$log1" "$FX_CONFIG" "${FX_COMMON[@]}" run.max_steps=100000 checkpoint.every_steps="$EVERY"
fx_wait_step "$FX_PID" "$log1" "$KILL_AT"
fx_kill_run "$FX_PID"
# (the console may lag the controller by a step: the newest checkpoint can be of the last printed step)
done_steps=$(($(fx_last_step "$log1") + 1))
run=$(fx_run_dir "$log1")
ckpt=$("${FX_CHECK[@]}" latest-checkpoint "$run") || fx_fail "no checkpoint after the kill" "$log1"
((ckpt > 0)) || fx_fail "the newest checkpoint is of step $ckpt after $done_steps steps"
STEPS=$((ckpt + MORE))
fx_log "killed (kill -9, whole run) after $done_steps printed steps; resuming from the checkpoint of step $ckpt, to step $STEPS"

log2="$FX_OUT/run2.log"
fx_run "$log2" --resume "$run" run.max_steps="$STEPS"
grep -q "from the checkpoint of step $ckpt\$" "$log2" || fx_fail "the resumed run did not say it continues from step $ckpt" "$log2"
fx_check resumed "$run" --from-step "$ckpt"
fx_check finished "$run" --steps "$STEPS"
fx_check exactly-once "$run" --steps "$STEPS"
