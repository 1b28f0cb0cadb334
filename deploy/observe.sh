#!/usr/bin/env bash
# `make observe`: `tidepool dev` (on its default ports, or those of a
# `--port` given after the binary) with a Prometheus from Debian's
# `prometheus` package scraping its five processes and evaluating the alert
# rules, at http://127.0.0.1:9090. Ctrl-C (or a SIGTERM) stops both.
# Prometheus' data lives in a temporary directory removed on exit.
set -euo pipefail
bin=${1:-./target/release/tidepool}
root=$(cd "$(dirname "$0")/.." && pwd)
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
targets=""
for offset in 90 91 92 93 94; do
  targets="$targets'127.0.0.1:$((port + offset))', "
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
  --web.listen-address=127.0.0.1:9090 > "$work/prometheus.log" 2>&1 &
prom=$!
trap 'kill $prom 2>/dev/null; wait $prom 2>/dev/null; rm -rf "$work"' EXIT
echo "observe: Prometheus at http://127.0.0.1:9090 (alerts: /alerts), log in $work/prometheus.log"
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
