#!/usr/bin/env bash
# A secure-by-default cluster end to end: deploy/local/cluster.sh makes a CA,
# member certificates and tokens, starts every process with mutual TLS, and
# fulcrumctl authenticates with bearer tokens. Checks what a user sees:
# no token, a wrong token and plaintext are refused with exit 7 / 4 and a
# message naming the problem; the demo user's job trains to SUCCEEDED; a
# second user (added to the token file while the cluster runs) neither sees
# nor touches it; the admin sees it with its owner.
#   security_e2e_test.sh BUILD_DIR DATA_DIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$1 data=$2
work=$(mktemp -d /tmp/fulcrum-security-e2e-XXXXXX)
port=$(/usr/bin/python3 "$root/tests/testing/free_ports.py" 2)  # the coordinator and its server
cleanup() {
  "$root/deploy/local/cluster.sh" stop --dir "$work/cluster" >/dev/null 2>&1 || true
  if [[ ${FULCRUM_KEEP_WORK:-0} == 1 ]]; then echo "(kept $work)"; else rm -rf "$work"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  tail -n 5 "$work"/cluster/logs/*.log || true
  exit 1
}

FULCRUM_CPU_THREADS=1 "$root/deploy/local/cluster.sh" start --servers 1 --workers 2 --dir "$work/cluster" \
  --port "$port" --metrics-port 0 --bin "$build" --data "$data" >"$work/start.log" 2>&1 || { cat "$work/start.log"; fail "cluster.sh start"; }
cat "$work/start.log"
tls=$work/cluster/tls
grep -q "mutual TLS" "$work/start.log" || fail "cluster.sh does not say it runs mutual TLS"
for p in coordinator server-0 worker-0 worker-1; do
  grep -q "TLS on: identity spiffe://fulcrum/" "$work/cluster/logs/$p.log" || fail "$p does not log its TLS identity"
done

ctl=("$build/server/fulcrumctl" --coordinator="127.0.0.1:$port")
# expect CODE TEXT CMD...: runs CMD, wants exit CODE and TEXT in its output.
expect() {
  local want=$1 text=$2 rc=0
  shift 2
  "$@" >"$work/out" 2>&1 || rc=$?
  echo "\$ ${*: -2} -> exit $rc: $(head -c 300 "$work/out" | tr '\n' ' ')"
  [[ $rc == "$want" ]] || fail "wanted exit $want, got $rc"
  grep -qF -- "$text" "$work/out" || fail "output lacks '$text'"
}

expect 7 "no credentials" env FULCRUM_TLS_CA_FILE="$tls/ca.crt" "${ctl[@]}" list
expect 7 "not known to this coordinator" env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN=0000000000000000000000 \
  "${ctl[@]}" list
expect 4 "plaintext (--insecure)" env FULCRUM_TOKEN_FILE="$tls/token-demo" "${ctl[@]}" --insecure list
expect 4 "signed by the CA in /etc/ssl/certs/ca-certificates.crt" env FULCRUM_TOKEN_FILE="$tls/token-demo" \
  FULCRUM_TLS_CA_FILE=/etc/ssl/certs/ca-certificates.crt "${ctl[@]}" list
grep -qF "certificate verify failed" "$work/out" || fail "the error does not give the TLS failure"
# No CA given: the hint says the system's trust store was used and where a
# local cluster keeps its CA; the failure is reported once, not also in
# gRPC's own log format.
expect 4 "no --tls_ca_file or \$FULCRUM_TLS_CA_FILE given" env FULCRUM_TOKEN_FILE="$tls/token-demo" "${ctl[@]}" list
if grep -q "ssl_transport_security" "$work/out"; then fail "gRPC's log line leaks into fulcrumctl's output"; fi
[[ $(wc -l <"$work/out") == 1 ]] || fail "wanted one line of error, got $(wc -l <"$work/out")"

# Tokens as shells and editors leave them: a trailing newline is trimmed; a
# control character is refused with a message that does not print the token
# (gRPC aborted on it, and printed it at debug verbosity).
token=$(cat "$tls/token-demo")
expect 0 "no jobs" env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN="$token"$'\n' "${ctl[@]}" list
expect 2 "the bearer token from \$FULCRUM_TOKEN has a character not allowed in a token at position 9" \
  env GRPC_VERBOSITY=debug FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN="${token:0:8}"$'\a'"${token:8}" "${ctl[@]}" list
if grep -qF "${token:0:8}" "$work/out"; then fail "fulcrumctl printed the token"; fi
printf '%s\r\n' "$token" >"$work/token-cr"
expect 0 "no jobs" env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN_FILE="$work/token-cr" "${ctl[@]}" list
printf '%s\001%s\n' "${token:0:4}" "${token:4}" >"$work/token-ctrl"
expect 2 "the bearer token from the token file $work/token-ctrl has a character not allowed" \
  env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN_FILE="$work/token-ctrl" "${ctl[@]}" list

# Bad handshakes cost a caller nothing: gRPC's line for each is rate-limited
# (at most 10 a minute per kind), not one line per connection.
log=$work/cluster/logs/coordinator.log
before=$(grep -c "Handshake failed" "$log" || true)
for _ in $(seq 200); do
  { exec 3<>"/dev/tcp/127.0.0.1/$port" && printf 'GET / HTTP/1.0\r\n\r\n' >&3 && exec 3>&-; } 2>/dev/null || true
done
sleep 1
after=$(grep -c "Handshake failed" "$log" || true)
echo "200 bad handshakes: $((after - before)) 'Handshake failed' lines in the coordinator's log"
((after > before)) || fail "no handshake failure was logged (is the line still gRPC's?)"
((after - before <= 11)) || fail "$((after - before)) handshake lines for 200 bad handshakes: not rate-limited"

demo=(env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN_FILE="$tls/token-demo")
sed -e 's/^epochs: .*/epochs: 3/' "$root/deploy/examples/digits-softmax.yaml" >"$work/digits.yaml"
expect 0 "SUCCEEDED" "${demo[@]}" "${ctl[@]}" submit -f "$work/digits.yaml"
job=$(sed -n 's/^submitted job //p' "$work/out")
[[ -n "$job" ]] || fail "no job id"

# A second user, added while the coordinator runs.
echo "$(openssl rand -hex 32),bob,bob" >>"$tls/tokens.csv"
bob=(env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN="$(tail -n 1 "$tls/tokens.csv" | cut -d, -f1)")
sleep 1.5
expect 0 "no jobs" "${bob[@]}" "${ctl[@]}" list
expect 7 "user 'bob' may act only on their own jobs" "${bob[@]}" "${ctl[@]}" status "$job"
expect 7 "user 'bob' may act only on their own jobs" "${bob[@]}" "${ctl[@]}" export "$job" -o "$work/stolen.safetensors"
[[ ! -s "$work/stolen.safetensors" ]] || fail "bob exported demo's model"
expect 0 "owner:     demo" env FULCRUM_TLS_CA_FILE="$tls/ca.crt" FULCRUM_TOKEN_FILE="$tls/token-admin" \
  "${ctl[@]}" status "$job"
expect 0 "$job" "${demo[@]}" "${ctl[@]}" list
echo "PASS"
