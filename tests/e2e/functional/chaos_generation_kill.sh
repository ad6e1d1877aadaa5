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
# Kill it while it holds work. With 2 or more groups in flight it is frozen (SIGSTOP: it can neither
# deliver a group nor take one back); if it holds undelivered groups the run stalls on them within a
# few steps, with the same groups in flight and no step trained for 1 s (the other worker delivers a
# batch in tens of ms). Then it is killed (SIGKILL) holding them. If nothing is left in flight, it
# held nothing: it is let go (SIGCONT) and frozen again later. (Killing on the in-flight gauge alone raced: the
# victim's groups could be delivered between the scrape and the kill.)
in_flight=$("$FX_PY" - "$url" "${victims[0]}" <<'PY'
import os, re, signal, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])


def scrape():
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    n = sum(float(v) for v in re.findall(r"^sc_grpo_in_flight_groups\{[^}]*\} (\S+)$", body, re.M))
    version = re.search(r"^sc_grpo_trainer_version (\S+)$", body, re.M)
    return n, version and version.group(1)


deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if scrape()[0] < 2:  # freeze it when it probably holds work: 2 or more in flight
        time.sleep(0.02)
        continue
    os.kill(pid, signal.SIGSTOP)
    last, since, give_up = None, time.monotonic(), time.monotonic() + 5
    while time.monotonic() < give_up:
        now = scrape()
        if now[0] == 0:
            break  # nothing in flight: it held nothing (a weight sync may now wait for it)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            os.kill(pid, signal.SIGKILL)
            print(int(now[0]))
            sys.exit(0)
        time.sleep(0.05)
    os.kill(pid, signal.SIGCONT)
    time.sleep(0.5)
sys.exit(1)
PY
) || fx_fail "the run never stalled on groups held by a frozen generation worker within 120 s" "$log"
fx_log "step $(fx_last_step "$log"): killed generation worker ${victims[0]} (kill -9) holding $in_flight groups"
fx_wait_exit "$FX_PID" "$log"
((FX_RC == 0)) || fx_fail "sc-grpo run exited with $FX_RC after a generation worker was killed" "$log"
! grep -q '^Traceback' "$log" || fx_fail "sc-grpo run printed a traceback" "$log"
fx_assert_no_leftovers "$FX_PID"
run=$(fx_run_dir "$log")
fx_check finished "$run" --steps "$STEPS"
fx_check exactly-once "$run" --steps "$STEPS"
fx_check worker-killed "$run" --deaths 1 --workers 2 --min-redispatched 1
