# shellcheck shell=bash
# Sourced by scripts that run processes as on another host: a network
# namespace joined to this one by a veth pair (tests/bench/shaped_link.sh,
# tests/integration/partition_test.sh). Needs root or CAP_NET_ADMIN.

# netns_link NS HOST_IF NS_IF HOST_IP NS_IP: makes namespace NS and the
# pair HOST_IF (here, HOST_IP/30) - NS_IF (in NS, NS_IP/30), both up, and
# NS's loopback. Calls the caller's `skip MESSAGE` when it cannot.
netns_link() {
  local ns=$1 host_if=$2 ns_if=$3 host_ip=$4 ns_ip=$5
  command -v ip >/dev/null || skip "needs ip (Debian package iproute2)"
  ip netns add "$ns" 2>/dev/null || skip "cannot create a network namespace (needs root or CAP_NET_ADMIN)"
  ip link add "$host_if" type veth peer name "$ns_if" 2>/dev/null || skip "cannot create a veth pair"
  ip link set "$ns_if" netns "$ns"
  ip addr add "$host_ip/30" dev "$host_if"
  ip link set "$host_if" up
  ip netns exec "$ns" ip addr add "$ns_ip/30" dev "$ns_if"
  ip netns exec "$ns" ip link set "$ns_if" up
  ip netns exec "$ns" ip link set lo up
}

# netns_unlink NS HOST_IF: removes the pair (its peer goes with it) and NS.
netns_unlink() {
  ip link del "$2" 2>/dev/null || true
  ip netns del "$1" 2>/dev/null || true
}
