#!/usr/bin/env bash
# promtool checks of deploy/prometheus: both scrape configs, the rule files,
# and the alert unit tests in alerts_test.yml (run against a copy, so the
# rule paths resolve as they do next to the shipped configs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
command -v promtool >/dev/null || { echo "FAIL: promtool is missing (tests/run.sh installs Debian's prometheus)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/deploy/prometheus/." "$work/"
cp "$root/tests/observability/alerts_test.yml" "$work/"
promtool check rules "$work"/rules/*.yml
promtool check config "$work/prometheus-k8s.yml"
promtool check config "$work/prometheus-local.yml"
(cd "$work" && promtool test rules alerts_test.yml)
