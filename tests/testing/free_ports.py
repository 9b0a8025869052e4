#!/usr/bin/env python3
"""Free TCP ports for tests that start servers on fixed ports.

free_block(n) returns a base port such that base .. base+n-1 are all free
now, taken below the kernel's ephemeral range
(net.ipv4.ip_local_port_range). Ports in that range are the source ports of
outgoing connections: one picked there may be taken by another test's
connection before the server binds it ("cannot listen on 0.0.0.0:PORT").

As a script: free_ports.py N prints such a base.
"""
import random
import socket
import sys


def ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_block(n):
    low = ephemeral_low()
    for _ in range(500):
        base = random.randrange(10000, low - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of %d free ports below %d" % (n, low))


if __name__ == "__main__":
    print(free_block(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
