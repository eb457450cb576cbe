#!/usr/bin/env bash
# The README's test command. Readies this machine first (scripts/test-setup.sh: starts a
# server that is down, enables RabbitMQ's management plugin, installs chromium and
# chromium-driver when missing, makes the TLS test material and turns on the servers'
# TLS listeners), then runs every test of the workspace, then the PostgreSQL suites of
# the inbox, the sagas, batches and the outbox once more over TLS (`sslmode=verify-full`
# with the test CA). Arguments go to the first `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/test-setup.sh
cargo test --workspace "$@"

tls_dir=${SAGABOX_TLS_DIR:-/etc/sagabox-test/tls}
echo "test: the inbox, saga, batch and outbox suites again, over TLS to PostgreSQL"
DATABASE_URL="postgres://postgres@localhost:5432/postgres?sslmode=verify-full&sslrootcert=$tls_dir/ca.pem" \
  cargo test --test inbox --test orchestrator --test saga_ops --test saga_start \
  --test batch --test outbox
