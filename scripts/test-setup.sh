#!/usr/bin/env bash
# Makes this machine ready for sagabox's tests, and says each thing it changes:
#   - starts PostgreSQL, RabbitMQ, NATS (JetStream), Redis and MariaDB where one is down
#     (the commands of this machine kind, Debian's packages);
#   - enables RabbitMQ's management plugin (the queues' real retention is read from it);
#   - installs Debian's chromium and chromium-driver when missing (the console's browser
#     test);
#   - makes PostgreSQL ask one role, sagabox_password, for its password (scram-sha-256,
#     a line at the top of pg_hba.conf), so the test of PGPASSWORD and ~/.pgpass is real;
#     every other role keeps the machine's trust authentication;
#   - makes the TLS test material and the servers' TLS listeners (scripts/tls-setup.sh).
# Each step is skipped when it is done already, so running it again changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "test-setup: $*"; }
answers() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }

ensure_service() {
  local name=$1 port=$2 start=$3
  if answers "$port"; then
    say "$name answers on 127.0.0.1:$port"
    return
  fi
  say "$name is down, starting it: $start"
  bash -c "$start" || true
  for _ in $(seq 1 60); do
    if answers "$port"; then
      say "$name is up"
      return
    fi
    sleep 1
  done
  say "$name did not come up on 127.0.0.1:$port" >&2
  exit 1
}

ensure_service PostgreSQL 5432 'pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start'
ensure_service RabbitMQ 5672 'rabbitmq-server -detached'
# Consumers read their queues' real retention (x-message-ttl, policies) from it at start.
ensure_service 'RabbitMQ management API' 15672 'rabbitmq-plugins enable rabbitmq_management'
ensure_service NATS 4222 'start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log'
ensure_service Redis 6379 'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log'
ensure_service MariaDB 3306 'start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd'

# The console's browser test drives Debian's chromium through chromedriver, and fails
# (never skips) without them.
if ! [ -x /usr/bin/chromium ] || ! [ -x /usr/bin/chromedriver ]; then
  say "installing chromium and chromium-driver (Debian) for the console's browser test"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver ||
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }
fi

hba=$(psql -X -q -A -t -h 127.0.0.1 -U postgres -d postgres -c 'SHOW hba_file')
if ! grep -q '^host all sagabox_password ' "$hba"; then
  say "PostgreSQL: password authentication for the role sagabox_password (top of $hba), then a reload"
  sed -i '1i host all sagabox_password 127.0.0.1/32 scram-sha-256' "$hba"
  psql -X -q -h 127.0.0.1 -U postgres -d postgres -c 'SELECT pg_reload_conf()' >/dev/null
fi

bash scripts/tls-setup.sh
