#!/usr/bin/env bash
# metrics: Prometheus (the `prometheus` binary) scrapes a real run every second (its metrics port
# chosen free by the script); once the run is over, the shipped dashboard's pump-lag panels ("Pump wait by
# reason", "Current waits") and buffer-occupancy panels ("Buffer fill", "Buffer occupancy by state
# vs capacity"), their expressions read from deploy/grafana/sc-grpo-dashboard.json, must each return
# data over the run (tests/e2e/functional/prom.py).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

command -v prometheus >/dev/null || fx_fail "the prometheus binary is not installed (apt-get install prometheus)"
STEPS=$(fx_pick 60 100)  # ~10 s of training on the CPU: enough 1 s scrapes for the 4 s rate() windows
log="$FX_OUT/run.log"
# A free port outside the kernel's ephemeral range and Ray's worker ports (tests/helpers/free_ports.py): a
# port the kernel hands out can be taken by one of the run's own processes before the controller
# binds it, and the run then serves on the next port while Prometheus scrapes this one.
port=$("$FX_PY" "$FX_ROOT/tests/helpers/free_ports.py") || fx_fail "no free port for the run's metrics"
fx_start "$log" "$FX_CONFIG" "${FX_COMMON[@]}" run.max_steps="$STEPS" metrics.port="$port"
target=127.0.0.1:$port
# Prometheus starts while the run starts up, and scrapes it until it exits.
"$FX_PY" "$FX_HERE/prom.py" --target "$target" --pid "$FX_PID" --dir "$FX_OUT/prometheus" \
  --panel '^Pump wait by reason' --panel '^Current waits' \
  --panel '^Buffer fill$' --panel '^Buffer occupancy by state' ||
  fx_fail "the dashboard's pump-lag / buffer-occupancy queries did not all return data (see above)" "$log"
fx_wait_exit "$FX_PID" "$log"
[[ "$(fx_metrics_url "$log")" == "http://$target/metrics" ]] || fx_fail "the run did not print its metrics URL http://$target/metrics" "$log"
((FX_RC == 0)) || fx_fail "sc-grpo run exited with $FX_RC" "$log"
fx_assert_no_leftovers "$FX_PID"
run=$(fx_run_dir "$log")
fx_check finished "$run" --steps "$STEPS"
