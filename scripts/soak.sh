#!/usr/bin/env bash
# Soak: `sagabox demo` under faults (half the commands delivered twice, 10 % of replies
# lost, 10 % of handler runs failing after their write, 5 % declines) on a fresh PostgreSQL database,
# sampled every INTERVAL seconds — sagas finished (by SQL), throughput over the interval,
# the process's resident memory (VmRSS) and the inbox's partitions (oldest month and
# count) — then the demo's own summary.
#
#   scripts/soak.sh [ORDERS=200000] [INTERVAL=10]
#   CLOCK_SPEED=43200 scripts/soak.sh     # the run's clock a month a minute: the pruner
#                                         # drops expired months while orders flow
#
# Needs psql and a PostgreSQL at $ADMIN_URL (default postgres://postgres@127.0.0.1:5432/postgres);
# runs target/release/sagabox (cargo build --release first). The database is dropped at the end.
set -euo pipefail
ORDERS=${1:-200000}
INTERVAL=${2:-10}
ADMIN_URL=${ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres}
DB="sagabox_soak_$$"
URL="${ADMIN_URL%/*}/$DB"
BIN=${BIN:-target/release/sagabox}
CLOCK_SPEED=${CLOCK_SPEED:-1}
psql -q "$ADMIN_URL" -c "CREATE DATABASE $DB"
trap 'psql -q "$ADMIN_URL" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"' EXIT
OUT=$(mktemp)
"$BIN" demo --database-url "$URL" --orders "$ORDERS" --concurrency 32 \
  --duplicate-rate 0.5 --lost-reply-rate 0.1 --fail-rate 0.1 --decline-rate 0.05 --json \
  --clock-speed "$CLOCK_SPEED" \
  >"$OUT" 2>/dev/null &
PID=$!
echo "elapsed_s,finished,sagas_per_s,rss_kb,oldest_month,partitions"
START=$(date +%s)
LAST=0
while kill -0 "$PID" 2>/dev/null; do
  sleep "$INTERVAL"
  RSS=$(awk '/VmRSS/ {print $2}' "/proc/$PID/status" 2>/dev/null || echo 0)
  DONE=$(psql -qtA "$URL" -c "SELECT COUNT(*) FROM saga_instances WHERE status IN ('completed','compensated')" 2>/dev/null || echo "$LAST")
  PARTS=$(psql -qtA -F, "$URL" -c "SELECT MIN(c.relname), COUNT(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'sagabox_inbox'::regclass" 2>/dev/null || echo ",")
  NOW=$(date +%s)
  echo "$((NOW - START)),$DONE,$(( (DONE - LAST) / INTERVAL )),${RSS:-0},${PARTS#sagabox_inbox_}"
  LAST=$DONE
done
# The demo exits 3 when it finds damage: the summary is printed either way, then its
# exit status is the script's.
rc=0
wait "$PID" || rc=$?
cat "$OUT"
exit "$rc"
