#!/usr/bin/env bash
# TLS material for the tests, and the local servers' TLS listeners that use it.
#
# Makes (once; kept while it stays valid) in $SAGABOX_TLS_DIR (default
# /etc/sagabox-test/tls), with openssl:
#   ca.pem, ca.key              a test CA
#   server.pem, server.key      signed by it, for the host name `localhost` only
#   client.pem, client.key      signed by it, for client-certificate authentication
#   other-ca.pem                an unrelated CA, for "wrong CA" tests
#   expired.pem, expired.key    signed by the test CA for `localhost`, expired in 2020
# and configures, when it is not so already:
#   RabbitMQ  an AMQPS listener on 127.0.0.1:5671 and the management API over HTTPS on
#             127.0.0.1:15671, both with server.pem (a file in /etc/rabbitmq/conf.d,
#             then a restart of the broker); the plain listeners stay as they were.
#   PostgreSQL ssl on with server.pem as its certificate (the key copied as
#             postgres-server.key, owned by postgres), and ssl_ca_file = ca.pem, so a
#             client certificate signed by the test CA is verified and shown in
#             pg_stat_ssl (ALTER SYSTEM, then a reload).
# NATS needs nothing here: its TLS tests start their own nats-server with these files.
#
# The material is for tests on this machine only: the keys are readable by the servers'
# users, and the CA is trusted by nothing but the tests that name it.
set -euo pipefail

dir=${SAGABOX_TLS_DIR:-/etc/sagabox-test/tls}
days=825

say() { echo "tls-setup: $*"; }
answers() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }

if ! command -v openssl >/dev/null; then
  say "installing openssl"
  apt-get install -y openssl || { apt-get update && apt-get install -y openssl; }
fi

still_valid() { # file: a certificate valid for at least another 30 days
  [ -s "$1" ] && openssl x509 -in "$1" -noout -checkend $((30 * 86400)) >/dev/null 2>&1
}

make_material() {
  say "making the test CA and certificates in $dir"
  mkdir -p "$dir"
  local work
  work=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" RETURN
  local key_args=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)

  openssl req -x509 "${key_args[@]}" -keyout "$dir/ca.key" -out "$dir/ca.pem" \
    -days "$days" -subj "/CN=sagabox test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -x509 "${key_args[@]}" -keyout "$work/other-ca.key" -out "$dir/other-ca.pem" \
    -days "$days" -subj "/CN=sagabox unrelated CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

  cat >"$work/server.ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost
EOF
  cat >"$work/client.ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
EOF
  openssl req "${key_args[@]}" -keyout "$dir/server.key" -out "$work/server.csr" -subj "/CN=localhost" 2>/dev/null
  openssl x509 -req -in "$work/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -CAserial "$work/ca.srl" -days "$days" -extfile "$work/server.ext" -out "$dir/server.pem" 2>/dev/null
  openssl req "${key_args[@]}" -keyout "$dir/client.key" -out "$work/client.csr" -subj "/CN=sagabox-client" 2>/dev/null
  openssl x509 -req -in "$work/client.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -CAserial "$work/ca.srl" -days "$days" -extfile "$work/client.ext" -out "$dir/client.pem" 2>/dev/null

  # An expired server certificate: `openssl ca` is the one command that sets both dates.
  openssl req "${key_args[@]}" -keyout "$dir/expired.key" -out "$work/expired.csr" -subj "/CN=localhost" 2>/dev/null
  mkdir -p "$work/ca"
  : >"$work/ca/index.txt"
  echo 1000 >"$work/ca/serial"
  cat >"$work/ca.cnf" <<EOF
[ca]
default_ca = test
[test]
dir = $work/ca
database = \$dir/index.txt
serial = \$dir/serial
new_certs_dir = \$dir
default_md = sha256
policy = any
copy_extensions = none
x509_extensions = server
[any]
commonName = supplied
[server]
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost
EOF
  openssl ca -batch -config "$work/ca.cnf" -cert "$dir/ca.pem" -keyfile "$dir/ca.key" \
    -in "$work/expired.csr" -out "$dir/expired.pem" -notext \
    -startdate 20200101000000Z -enddate 20200201000000Z 2>/dev/null

  chmod 0755 "$dir"
  chmod 0644 "$dir"/*.pem
  # The servers run as their own users (rabbitmq, postgres) and must read the keys.
  chmod 0644 "$dir"/server.key "$dir"/client.key "$dir"/expired.key
  chmod 0600 "$dir"/ca.key
}

if still_valid "$dir/ca.pem" && still_valid "$dir/server.pem" && still_valid "$dir/client.pem" &&
  [ -s "$dir/other-ca.pem" ] && [ -s "$dir/expired.pem" ]; then
  say "test certificates in $dir are in place"
else
  make_material
fi

# RabbitMQ: AMQPS on 5671 and the management API over HTTPS on 15671.
rabbit_conf=/etc/rabbitmq/conf.d/50-sagabox-test-tls.conf
want=$(
  cat <<EOF
# Written by sagabox's scripts/tls-setup.sh: TLS listeners for its tests.
listeners.ssl.default = 127.0.0.1:5671
ssl_options.cacertfile = $dir/ca.pem
ssl_options.certfile = $dir/server.pem
ssl_options.keyfile = $dir/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
management.tcp.port = 15672
management.ssl.port = 15671
management.ssl.ip = 127.0.0.1
management.ssl.cacertfile = $dir/ca.pem
management.ssl.certfile = $dir/server.pem
management.ssl.keyfile = $dir/server.key
EOF
)
if [ "$(cat "$rabbit_conf" 2>/dev/null)" != "$want" ] || ! answers 5671 || ! answers 15671; then
  say "configuring RabbitMQ's TLS listeners ($rabbit_conf) and restarting it"
  mkdir -p "$(dirname "$rabbit_conf")"
  printf '%s\n' "$want" >"$rabbit_conf"
  rabbitmq-plugins enable --offline rabbitmq_management >/dev/null
  rabbitmqctl stop >/dev/null 2>&1 || true
  for _ in $(seq 1 30); do answers 5672 || break; sleep 1; done
  rabbitmq-server -detached
  for _ in $(seq 1 90); do
    if answers 5672 && answers 5671 && answers 15672 && answers 15671; then break; fi
    sleep 1
  done
  for port in 5672 5671 15672 15671; do
    answers $port || { say "RabbitMQ did not come up on 127.0.0.1:$port" >&2; exit 1; }
  done
  say "RabbitMQ answers on 5672, 5671 (TLS), 15672 and 15671 (TLS)"
else
  say "RabbitMQ's TLS listeners are in place"
fi

# PostgreSQL: serve the test CA's certificate for `localhost`, and verify client
# certificates signed by the test CA. The server reads its key only when the postgres
# user owns it and no one else may read it.
install -o postgres -g postgres -m 0600 "$dir/server.key" "$dir/postgres-server.key"
psql_admin() { psql -X -q -A -t -h 127.0.0.1 -U postgres -d postgres -c "$1"; }
if [ "$(psql_admin 'SHOW ssl_cert_file')" != "$dir/server.pem" ] ||
  [ "$(psql_admin 'SHOW ssl_ca_file')" != "$dir/ca.pem" ]; then
  say "PostgreSQL: ssl_cert_file, ssl_key_file and ssl_ca_file from $dir (ALTER SYSTEM), then a reload"
  psql_admin "ALTER SYSTEM SET ssl_cert_file = '$dir/server.pem'"
  psql_admin "ALTER SYSTEM SET ssl_key_file = '$dir/postgres-server.key'"
  psql_admin "ALTER SYSTEM SET ssl_ca_file = '$dir/ca.pem'"
  psql_admin "ALTER SYSTEM SET ssl = on"
  psql_admin 'SELECT pg_reload_conf()' >/dev/null
  sleep 1
fi
served=$(openssl s_client -starttls postgres -connect 127.0.0.1:5432 -CAfile "$dir/ca.pem" \
  -verify_hostname localhost </dev/null 2>/dev/null | grep -c 'Verify return code: 0 (ok)' || true)
if [ "$served" != 1 ]; then
  say "PostgreSQL does not serve the test certificate over TLS; its log says why" >&2
  exit 1
fi
say "PostgreSQL: TLS with the test certificate, client certificates checked against $dir/ca.pem"
