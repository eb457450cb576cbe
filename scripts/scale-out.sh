#!/usr/bin/env bash
# Scale-out: the checkout saga over RabbitMQ with 1, 2 and 4 `sagabox serve` processes per
# step (payment, inventory, email) as competing consumers of one queue each, on one
# PostgreSQL database, driven by `sagabox demo --external-participants`. Per count: the
# demo's summary (sagas/s, commands delivered, damage: its invariants), the CPU seconds
# each part of the system used during the run (PostgreSQL, RabbitMQ, the serve processes,
# the demo), and what PostgreSQL's active backends were waiting on (pg_stat_activity,
# sampled every 50 ms). Every serve runs the pruner: one pass at a time does the work.
#
#   [CONCURRENCY=64] [SERVE_ARGS=…] scripts/scale-out.sh [ORDERS=3000] [COUNTS="1 2 4"]   (sagas in flight)
#
# Needs psql, a PostgreSQL at $ADMIN_URL (default postgres://postgres@127.0.0.1:5432/postgres),
# RabbitMQ at $AMQP (default amqp://guest:guest@127.0.0.1:5672/%2f) with its management
# plugin; runs target/release/sagabox (cargo build --release first). Databases and queues
# are its own and removed at the end.
set -euo pipefail
ORDERS=${1:-3000}
COUNTS=${2:-"1 2 4"}
ADMIN_URL=${ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres}
AMQP=${AMQP:-amqp://guest:guest@127.0.0.1:5672/%2f}
BIN=${BIN:-target/release/sagabox}
CONCURRENCY=${CONCURRENCY:-64}
# Extra arguments of every serve (e.g. "--workers 1": PostgreSQL's default 100
# connections hold 12 serves of 4 workers and the demo only just not).
SERVE_ARGS=${SERVE_ARGS:-}
ROLES="payment inventory email"

# CPU ticks (user + system) of the given pids, with those of their exited children
# (PostgreSQL's postmaster collects its closed backends').
cpu_of() {
  local ticks=0
  for pid in "$@"; do
    if [ -r "/proc/$pid/stat" ]; then
      ticks=$((ticks + $(awk '{print $14 + $15 + $16 + $17}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
    fi
  done
  echo "$ticks"
}
HZ=$(getconf CLK_TCK)
DB=""
# A run that stops half-way leaves no database behind.
trap '[ -n "$DB" ] && psql -q "$ADMIN_URL" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"' EXIT

for count in $COUNTS; do
  DB="sagabox_scale_$$_$count"
  URL="${ADMIN_URL%/*}/$DB"
  PREFIX="sagabox-scale-$$-$count"
  psql -q "$ADMIN_URL" -c "CREATE DATABASE $DB"
  "$BIN" migrate --database-url "$URL" >/dev/null
  SERVES=()
  for role in $ROLES; do
    for _ in $(seq "$count"); do
      RUST_LOG=error "$BIN" serve --role "$role" --database-url "$URL" --transport "$AMQP" \
        --queue-prefix "$PREFIX" $SERVE_ARGS >/dev/null 2>&1 &
      SERVES+=($!)
    done
  done
  # Ready when every queue has its consumers.
  for role in $ROLES; do
    for _ in $(seq 600); do
      consumers=$(curl -s -u guest:guest "http://127.0.0.1:15672/api/queues/%2F/$PREFIX.$role" |
        python3 -c 'import json,sys; print(json.load(sys.stdin).get("consumers", 0))' 2>/dev/null || echo 0)
      [ "$consumers" -ge "$count" ] && break
      sleep 0.1
    done
  done
  WAITS=$(mktemp)
  # One session sampling (a new connection per sample would cost PostgreSQL more than
  # the samples are worth).
  printf '%s\n' "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') \
    FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() \
    AND datname = current_database()" '\watch 0.05' | psql -Atq "$URL" >>"$WAITS" 2>/dev/null &
  SAMPLER=$!
  pg0=$(cpu_of $(pgrep -x postgres)); mq0=$(cpu_of $(pgrep -x beam.smp)); sv0=$(cpu_of "${SERVES[@]}")
  OUT=$(mktemp)
  /usr/bin/time -f "%U %S" -o "$OUT.time" "$BIN" demo --database-url "$URL" --transport "$AMQP" \
    --queue-prefix "$PREFIX" --external-participants --orders "$ORDERS" --concurrency "$CONCURRENCY" --json >"$OUT" 2>/dev/null || true
  pg1=$(cpu_of $(pgrep -x postgres)); mq1=$(cpu_of $(pgrep -x beam.smp)); sv1=$(cpu_of "${SERVES[@]}")
  kill "$SAMPLER" 2>/dev/null || true
  kill -TERM "${SERVES[@]}" 2>/dev/null || true
  wait "${SERVES[@]}" 2>/dev/null || true
  echo "== $count process(es) per step"
  python3 - "$OUT" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
if "elapsed_ms" not in s:
    print(f"  the demo failed: {s}")
    sys.exit(0)
elapsed = s["elapsed_ms"] / 1000
print(f"  sagas/s {s['sagas_per_sec']:.1f}  commands/s {s['deliveries'] / elapsed:.0f}  "
      f"completed {s['completed']} compensated {s['compensated']} unfinished {s['unfinished']}  "
      f"damage {s['double_charges'] + s['double_refunds'] + s['double_emails'] + s['stock_drift'] + s['unbalanced_refunds']}  "
      f"verdict {s['verdict']}  elapsed {elapsed:.1f} s  retries {s['retries']}  "
      f"duplicates answered {s['duplicate_replies']}")
PY
  # The last line: /usr/bin/time puts "Command exited with non-zero status" before it.
  read -r du ds < <(tail -n 1 "$OUT.time")
  echo "  CPU s: postgres $(echo "scale=1; ($pg1 - $pg0) / $HZ" | bc)  rabbitmq $(echo "scale=1; ($mq1 - $mq0) / $HZ" | bc)  serve $(echo "scale=1; ($sv1 - $sv0) / $HZ" | bc)  demo $(echo "${du:-0} + ${ds:-0}" | bc)"
  echo "  PostgreSQL active backends, by wait (share of samples):"
  grep -v '^$' "$WAITS" | sort | uniq -c | sort -rn | head -6 |
    awk -v total="$(grep -cv '^$' "$WAITS")" '{printf "    %5.1f %%  %s\n", 100 * $1 / total, $2}'
  rm -f "$OUT" "$OUT.time" "$WAITS"
  for role in $ROLES; do
    for queue in "$PREFIX.$role" "$PREFIX.$role.dead"; do
      curl -s -u guest:guest -X DELETE "http://127.0.0.1:15672/api/queues/%2F/$queue" >/dev/null
    done
  done
  psql -q "$ADMIN_URL" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)"
  DB=""
done
