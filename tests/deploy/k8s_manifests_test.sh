#!/usr/bin/env bash
# Validates deploy/k8s against the Kubernetes (and Prometheus Operator)
# schemas with npm kubernetes-models, then checks that ports, labels,
# names and flags agree across the manifests, the Prometheus configs and the
# Dockerfile (k8s_manifests_test.js). The npm packages are installed once,
# at pinned versions, into ~/.cache/fulcrum/npm-k8s.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${FULCRUM_NPM_CACHE:-$HOME/.cache/fulcrum/npm-k8s}
pkgs=(kubernetes-models@4.5.1 @kubernetes-models/prometheus-operator@4.4.4 js-yaml@4.1.0)
if [[ ! -f "$cache/.installed-v1" ]]; then
  mkdir -p "$cache"
  (cd "$cache" && npm install --silent --no-audit --no-fund --prefix "$cache" "${pkgs[@]}")
  touch "$cache/.installed-v1"
fi
# The dashboards ConfigMap must be what the generator makes of the JSON now.
tmp=$(mktemp)
pki=$(mktemp -d)
trap 'rm -rf "$tmp" "$pki" "$tmp.secrets.yaml"' EXIT
"$root/deploy/k8s/gen-dashboards-configmap.sh" "$tmp"
if ! cmp -s "$tmp" "$root/deploy/k8s/grafana-dashboards.yaml"; then
  echo "FAIL: deploy/k8s/grafana-dashboards.yaml is stale: run deploy/k8s/gen-dashboards-configmap.sh"
  exit 1
fi
# The Secrets the manifests mount, as a user makes them.
"$root/deploy/k8s/gen-secrets.sh" "$pki/pki" "$tmp.secrets.yaml" 2>/dev/null
NODE_PATH="$cache/node_modules" node "$root/tests/deploy/k8s_manifests_test.js" "$root" "$tmp.secrets.yaml"
