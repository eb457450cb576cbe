#!/bin/bash
# Times each console page against a database filled by fill.sql (1,000,000 sagas) after a
# `sagabox demo --orders 300` run: each page fetched 10 times, min / median / max of curl's
# total time. Usage:
#   sagabox console --database-url "$DB" --listen 127.0.0.1:8091 &
#   docs/data/console-1m/timing.sh "$DB" [http://127.0.0.1:8091]
set -euo pipefail
DB=$1
BASE=${2:-http://127.0.0.1:8091}
demo_saga=$(psql "$DB" -Atc "SELECT id FROM saga_instances WHERE id NOT LIKE 'synthetic-%' AND status = 'compensated' LIMIT 1")
# The cursor of a page 600,000 sagas deep (the one after synthetic-0600000).
cursor=$(psql "$DB" -Atc "SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"%2B00%3A00\"') || '&after_id=' || id FROM saga_instances WHERE id = 'synthetic-0600000'")
pages=(
  "/"
  "/sagas"
  "/sagas?status=completed"
  "/sagas?status=running"
  "/sagas?status=parked"
  "/sagas?saga=trip"
  "/sagas?status=compensated&saga=checkout&age=7d"
  "/sagas?age=1h"
  "/sagas?after=$cursor"
  "/sagas?status=completed&after=$cursor"
  "/sagas/$demo_saga"
  "/sagas/synthetic-0500000"
  "/inbox"
)
for page in "${pages[@]}"; do
  times=()
  for _ in $(seq 10); do
    read -r code seconds < <(curl -s -o /dev/null -w "%{http_code} %{time_total}\n" "$BASE$page")
    times+=("$seconds")
  done
  python3 - "$page" "$code" "${times[@]}" <<'PY'
import sys
page, code, *times = sys.argv[1:]
ms = sorted(float(t) * 1000 for t in times)
print(f"{code} min {ms[0]:7.1f}  median {ms[len(ms) // 2]:7.1f}  max {ms[-1]:7.1f} ms  {page}")
PY
done
