#!/bin/sh
# Gives this node a host-scoped address for tether-agent's node -> control-plane listener.
#
# Usage: setup-host-address.sh [ADDRESS] [INTERFACE]
#   ADDRESS    default 100.64.0.1 (CGNAT range, never routed on the internet)
#   INTERFACE  default tether0 (a dummy interface); if the kernel has no dummy driver, the
#              address goes on lo instead.
#
# The address gets "scope host": it is local to this node, never announced, never used as a source
# address for outgoing traffic. Point the tenant's kube-apiserver --advertise-address at it, so the
# `kubernetes` Service endpoints (and kube-proxy's DNAT) send every pod's API traffic to the local
# agent. Needs CAP_NET_ADMIN (run as an init container with NET_ADMIN, or as root at boot).
# Idempotent: running it again changes nothing.
set -eu

address="${1:-100.64.0.1}"
interface="${2:-tether0}"

if ! ip link show "$interface" >/dev/null 2>&1; then
  if ! ip link add "$interface" type dummy 2>/dev/null; then
    echo "setup-host-address: no dummy interface support; using lo" >&2
    interface=lo
  fi
fi
ip addr replace "$address/32" dev "$interface" scope host
ip link set "$interface" up
echo "setup-host-address: $address/32 scope host on $interface"
