#!/usr/bin/env bash
# Shaped test networks for the benchmarks (sourced by scripts/bench_collectives_netns and
# scripts/bench_sync_netns; run as a program by the hook of bench_sync_netns):
# RANKS network namespaces <prefix>r0 .. r<RANKS-1> (one per rank, or one per node of several
# ranks), each with eth0 = <subnet>.<i+1>/24, joined by the bridge br0 in the namespace
# <prefix>br; tbf on both ends of every veth.
#
#   source scripts/lib/netns.sh
#   netns_create PREFIX SUBNET RANKS     # e.g. plc123 10.77.0 4; netns_delete undoes it
#   netns_shape PREFIX RANKS RATE        # RATE: 100mbit, 1gbit, ... or "off"
#   scripts/lib/netns.sh shape PREFIX RANKS RATE    # the same, as a program

netns_create() {
  local prefix="$1" subnet="$2" ranks="$3" i ns
  ip netns add "${prefix}br"
  ip -n "${prefix}br" link add br0 type bridge
  ip -n "${prefix}br" link set br0 up
  for ((i = 0; i < ranks; i++)); do
    ns="${prefix}r$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "port$i" netns "${prefix}br"
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "${prefix}br" link set "port$i" master br0
    ip -n "${prefix}br" link set "port$i" up
  done
}

# Removes every namespace netns_create made (those that exist); never fails.
netns_delete() {
  local prefix="$1" ranks="$2" i
  for ((i = 0; i < ranks; i++)); do ip netns del "${prefix}r$i" 2>/dev/null || true; done
  ip netns del "${prefix}br" 2>/dev/null || true
}

# tbf on both ends of every veth: a rank's uplink (eth0 egress) and downlink (its bridge port's
# egress). The bucket holds at least 1 ms at the rate and 256 KiB (GSO packets must fit).
# Prints the rate in Mbit/s (nothing for "off").
netns_shape() {
  local prefix="$1" ranks="$2" rate="$3" i bits burst
  if [[ $rate == off ]]; then
    for ((i = 0; i < ranks; i++)); do
      tc -n "${prefix}r$i" qdisc del dev eth0 root 2>/dev/null || true
      tc -n "${prefix}br" qdisc del dev "port$i" root 2>/dev/null || true
    done
    return 0
  fi
  bits=$(numfmt --from=si "$(tr "[:lower:]" "[:upper:]" <<<"${rate%bit}")")
  burst=$((bits / 8 / 1000))
  ((burst < 262144)) && burst=262144
  for ((i = 0; i < ranks; i++)); do
    tc -n "${prefix}r$i" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
    tc -n "${prefix}br" qdisc replace dev "port$i" root tbf rate "$rate" burst "$burst" latency 100ms
  done
  echo "$((bits / 1000000))"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -euo pipefail
  [[ $# -eq 4 && $1 == shape ]] || { echo "usage: $0 shape PREFIX RANKS RATE|off" >&2; exit 2; }
  netns_shape "$2" "$3" "$4" >/dev/null
  echo "netns: links of $2 $4" >&2
fi
