#!/usr/bin/env bash
# Writes the Secrets the manifests mount, as one YAML file for
# `kubectl apply -f`: a cluster CA and one certificate per role
# (fulcrum-tls-coordinator, fulcrum-tls-server, fulcrum-tls-worker; type
# kubernetes.io/tls with ca.crt, tls.crt and tls.key), and the coordinator's
# token file (fulcrum-tokens). The CA, keys and tokens stay in PKI_DIR (made
# by deploy/tls/gen-certs.sh, kept across runs): users' tokens are
# PKI_DIR/token-USER.
#
#   deploy/k8s/gen-secrets.sh PKI_DIR OUT.yaml [--user NAME]... [--namespace NS] [--domain cluster.local]
#
# Certificates name the Services' DNS names, so peers' hostname checks pass.
# Rotation: run it again with --renew, then `kubectl apply -f OUT.yaml`; the
# kubelet updates the mounted files and every process re-reads them within
# --tls_refresh_s (docs/security.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
(($# >= 2)) || { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
pki=$1 out=$2
shift 2
ns=fulcrum domain=cluster.local
extra=()
while (($#)); do
  case "$1" in
    --namespace) ns=$2; shift 2 ;;
    --domain) domain=$2; shift 2 ;;
    --user) extra+=(--user "$2"); shift 2 ;;
    --renew) extra+=(--renew); shift ;;
    *) echo "gen-secrets.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
"$root/deploy/tls/gen-certs.sh" "$pki" --servers 1 --workers 1 "${extra[@]}" \
  --san "DNS:fulcrum-coordinator.$ns.svc.$domain" --san "DNS:fulcrum-coordinator.$ns.svc" \
  --san "DNS:fulcrum-coordinator" --san "DNS:*.fulcrum-server.$ns.svc.$domain" >&2

b64() { base64 -w0 <"$1"; }
secret_tls() {  # secret_tls ROLE NAME
  cat <<YAML
---
apiVersion: v1
kind: Secret
metadata:
  name: fulcrum-tls-$1
  namespace: $ns
  labels: {app.kubernetes.io/part-of: fulcrum, app.kubernetes.io/component: $1}
type: kubernetes.io/tls
data:
  ca.crt: $(b64 "$pki/ca.crt")
  tls.crt: $(b64 "$pki/$2.crt")
  tls.key: $(b64 "$pki/$2.key")
YAML
}
umask 077
{
  secret_tls coordinator coordinator
  secret_tls server server-0
  secret_tls worker worker-0
  cat <<YAML
---
apiVersion: v1
kind: Secret
metadata:
  name: fulcrum-tokens
  namespace: $ns
  labels: {app.kubernetes.io/part-of: fulcrum, app.kubernetes.io/component: coordinator}
type: Opaque
data:
  tokens.csv: $(b64 "$pki/tokens.csv")
YAML
} >"$out"
echo "gen-secrets.sh: wrote 4 Secrets to $out; users' tokens are in $pki/token-*" >&2
