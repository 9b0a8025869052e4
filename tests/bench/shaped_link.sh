#!/usr/bin/env bash
# Runs fulcrum-bench's dense push+pull across a rate-limited link instead of
# loopback: the servers run as fulcrum-server processes in their own network
# namespace, joined to this one by a veth pair whose two ends are each shaped
# to RATE (tc tbf), so each direction gets RATE as on a full-duplex NIC.
# iperf3 across the same link is the bound, measured in the same run.
#
# On loopback the "network" is a memory copy on the same cores as everything
# else; across a link slower than those copies, the wire is the limit, as
# between real hosts. That is where the wire dtype matters
# (docs/benchmarks.md, "Transport: across a rate-limited link").
#
#   tests/bench/shaped_link.sh [--rate 1gbit|none] [--bin BUILD_DIR] [-- FULCRUM_BENCH_ARGS...]
#
# Needs root (or CAP_NET_ADMIN) and the veth and tbf kernel modules; exits
# 77 with a message where they are not available. The namespace and the
# link are removed on exit.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rate=1gbit bin="$root/build"
while (($#)); do
  case "$1" in
    --rate) rate=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "shaped_link.sh: unknown option '$1' (bench flags go after --)" >&2; exit 2 ;;
  esac
done

ns=fulcrum-link-$$
host_if=flh$$ ns_if=fln$$
# A /30 out of 10.231.0.0/16 per run, so concurrent runs do not collide.
octet=$(($$ % 250 + 1))
host_ip=10.231.$octet.1 ns_ip=10.231.$octet.2

skip() {
  echo "SKIP: shaped_link.sh: $1" >&2
  exit 77
}
# shellcheck source=tests/testing/netns.sh
source "$root/tests/testing/netns.sh"
cleanup() { netns_unlink "$ns" "$host_if"; }
trap cleanup EXIT

command -v tc >/dev/null || skip "needs ip and tc (Debian package iproute2)"
netns_link "$ns" "$host_if" "$ns_if" "$host_ip" "$ns_ip"
if [[ $rate != none ]]; then
  # The bucket holds 2 ms of traffic (at least one 64 KiB GSO segment): a
  # larger one lets short runs through above the rate.
  [[ $rate =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || { echo "shaped_link.sh: --rate '$rate': want e.g. 500mbit, 1gbit or none" >&2; exit 2; }
  case ${BASH_REMATCH[2]} in kbit) scale=1000 ;; mbit) scale=1000000 ;; gbit) scale=1000000000 ;; esac
  burst=$((BASH_REMATCH[1] * scale / 8 / 500))
  ((burst >= 65536)) || burst=65536
  tbf=(root tbf rate "$rate" burst "$burst" latency 20ms)
  tc qdisc add dev "$host_if" "${tbf[@]}" || skip "tc cannot shape the link to '$rate' (the tbf qdisc)"
  ip netns exec "$ns" tc qdisc add dev "$ns_if" "${tbf[@]}"
fi
echo "# link: veth $host_ip <-> $ns_ip (namespace $ns), each direction shaped to $rate${burst:+, bucket $burst bytes}"
"$bin/tests/bench/fulcrum-bench" --dense_only --server_binary="$bin/server/fulcrum-server" \
  --netns="$ns" --server_host="$ns_ip" "$@"
