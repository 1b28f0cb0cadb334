#!/usr/bin/env bash
# `make observe`: `tidepool dev` (on its default ports, or those of a
# `--port` given after the binary) with a Prometheus from Debian's
# `prometheus` package scraping its five processes and evaluating the alert
# rules, at http://127.0.0.1:9090 (OBSERVE_PROMETHEUS_PORT overrides the
# port). Ctrl-C (or a SIGTERM) stops both. Prometheus' data lives in a
# temporary directory removed on exit.
set -euo pipefail
bin=${1:-./target/release/tidepool}
root=$(cd "$(dirname "$0")/.." && pwd)
prom_port=${OBSERVE_PROMETHEUS_PORT:-9090}
case "$prom_port" in
  ''|*[!0-9]*) echo "observe: OBSERVE_PROMETHEUS_PORT must be a port number, not $prom_port" >&2; exit 2 ;;
esac
command -v prometheus >/dev/null || { echo "observe: prometheus not found: run make deps" >&2; exit 1; }
# The dev cluster serves metrics on its --port + 90 (coordinator), + 91..93
# (nodes), + 94 (gateway).
port=7400
prev=""
for arg in "${@:2}"; do
  case "$arg" in
    --port=*) port=${arg#--port=} ;;
    *) if [ "$prev" = --port ]; then port=$arg; fi ;;
  esac
  prev=$arg
done
case "$port" in
  ''|*[!0-9]*|0) echo "observe: needs the dev cluster on fixed ports (--port N, 1 to 65441), not --port $port: Prometheus scrapes --port + 90 .. + 94" >&2; exit 2 ;;
esac
targets=""
for offset in 90 91 92 93 94; do
  targets="$targets'127.0.0.1:$((10#$port + offset))', "
done
work=$(mktemp -d)
cat > "$work/prometheus.yml" <<YAML
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - $root/helm/tidepool/alerts/tidepool-rules.yaml
scrape_configs:
  - job_name: tidepool-dev
    static_configs:
      - targets: [${targets%, }]
YAML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address=127.0.0.1:$prom_port > "$work/prometheus.log" 2>&1 &
prom=$!
# Each step may fail (Prometheus gone already) without stopping the
# others: under `set -e` a failed kill ended the trap before the removal.
trap 'kill $prom 2>/dev/null || true; wait $prom 2>/dev/null || true; rm -rf "$work"' EXIT
# Said only once it listens: before, a Prometheus that failed (port 9090
# taken, a bad rule file) was announced all the same.
ready() {
  # Bounded: something else on the port may accept and never answer.
  timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$prom_port && printf 'GET /-/ready HTTP/1.0\r\n\r\n' >&3 && grep -q 'is Ready' <&3" 2>/dev/null
}
listening=""
for _ in $(seq 1 300); do
  kill -0 $prom 2>/dev/null || break
  if ready; then
    # Another server's answer on the port: ours exits on its bind error.
    sleep 0.5
    kill -0 $prom 2>/dev/null && listening=1
    break
  fi
  sleep 0.1
done
if [ -z "$listening" ]; then
  echo "observe: Prometheus did not start (is port $prom_port taken?); its log ($work/prometheus.log, removed now):" >&2
  cat "$work/prometheus.log" >&2
  exit 1
fi
echo "observe: Prometheus at http://127.0.0.1:$prom_port (alerts: /alerts), log in $work/prometheus.log"
shift || true
# In the background, so that a SIGTERM to this script (bash defers traps
# while a foreground child runs) reaches the dev cluster too: before, the
# script waited for `tidepool dev`, which went on running.
"$bin" dev "$@" &
dev=$!
trap 'kill -TERM $dev 2>/dev/null' INT TERM
status=0
wait $dev || status=$?
# A signal ended the first wait; the dev cluster is stopping: wait for it.
if kill -0 $dev 2>/dev/null; then wait $dev || status=$?; fi
exit $status
