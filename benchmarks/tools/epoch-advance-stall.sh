#!/bin/bash
# Writes across an epoch advance: what a cluster's puts do while every
# shard applies the drop of an expiring namespace.
#
# A release `tidepool dev` (4 shards, no splits) gets 18,000 durable 64 KiB
# blobs (1.1 GiB per replica) and then 7,000 16 KiB blobs (110 MiB) in
# `scratch`, a namespace keeping one epoch. Then 16 writers put 1 KiB
# blobs for 30 s (`tidectl load`); at the tenth second the epoch advances.
# Prints the puts acknowledged in each second, the longest stretch without
# an acknowledgement, the slowest put, and how long after the advance every
# shard had applied the drop.
#
#   cargo build --release -p tidepool -p tidectl
#   benchmarks/tools/epoch-advance-stall.sh [BIN_DIR] [LABEL]
#
# BIN_DIR holds `tidepool` and `tidectl` (default: target/release). Uses
# port 7500 and up, and a scratch directory under /tmp (removed at the end).
set -euo pipefail
BIN=$(realpath "${1:-target/release}")
LABEL=${2:-$BIN}
DIR=$(mktemp -d /tmp/epoch-stall-XXXX)
export TIDEPOOL_COORDINATOR=http://127.0.0.1:7500
ctl() { "$BIN/tidectl" "$@" --insecure; }

"$BIN/tidepool" dev --insecure --shards 4 --split-mib 0 --split-rps 0 \
    --data-dir "$DIR/dev" --port 7500 >"$DIR/dev.log" 2>&1 &
DEV=$!
trap 'kill $DEV 2>/dev/null; wait $DEV 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 1 120); do
    ctl cluster status >/dev/null 2>&1 && break
    sleep 0.5
done
sleep 3
ctl namespace create scratch --retain 1 >/dev/null
ctl bench default --concurrency 16 --size 65536 --seconds 0 --count 18000 \
    --keys 100000000 --prefix d- >"$DIR/fill-durable.txt" 2>&1
ctl bench scratch --concurrency 16 --size 16384 --seconds 0 --count 7000 \
    --keys 100000000 --prefix s- >"$DIR/fill-scratch.txt" 2>&1
echo "== $LABEL: data directory after the fill: $(du -sh "$DIR/dev" | cut -f1)"

ctl load default --writers 16 --size 1024 --seconds 30 --prefix m- \
    --record "$DIR/acknowledged" --json >"$DIR/load.json" &
LOAD=$!
dropped() {
    ctl cluster status --json | python3 -c '
import json, sys
drops = [d for d in json.load(sys.stdin).get("epoch_drops") or [] if d["namespace"] == "scratch"]
sys.exit(0 if drops and all(d["drop_below"] >= 2 and d["shards_done"] == d["shards_total"] for d in drops) else 1)'
}
advance() {
    local start
    start=$(date +%s.%N)
    ctl epoch advance >/dev/null
    for _ in $(seq 1 600); do
        if dropped 2>/dev/null; then
            echo "drop applied on every shard $(echo "$(date +%s.%N) - $start" | bc) s after the advance" >"$DIR/applied"
            return
        fi
        sleep 0.1
    done
    echo "drop not applied within 60 s" >"$DIR/applied"
}
previous=0
timeline=""
for second in $(seq 1 30); do
    sleep 1
    now=$(wc -l <"$DIR/acknowledged" 2>/dev/null || echo 0)
    timeline+="$((now - previous)) "
    previous=$now
    if [ "$second" = 10 ]; then
        advance &
        ADVANCE=$!
    fi
done
wait $LOAD
wait $ADVANCE
echo "puts acknowledged per second (advance at the 10th): $timeline"
cat "$DIR/applied"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print("acknowledged %d, failed %d, %.0f puts/s, longest gap %d ms, slowest put %d ms" % (
    d["acknowledged"], d["failed"], d["puts_per_second"], d["longest_gap_ms"], d["slowest_put_ms"]))' "$DIR/load.json"
echo "data directory at the end: $(du -sh "$DIR/dev" | cut -f1)"
