#!/usr/bin/env bash
# Emulates a cluster of H hosts on this machine and runs K ranks of PROGRAM on each.
#
#   scripts/emulated-cluster.sh [-H hosts] [-K ranks-per-host] [-r rate] [-f flow-rate] [-b burst] [-l queue] [-t secs] -- PROGRAM ARGS
#
# Each "host" is a network namespace with one interface (eth0, 10.77.0.<h+1>/24) joined to the
# others through a bridge that lives in a switch namespace of its own. Every host link is shaped
# with tc tbf in both directions (default 1gbit; -l sets the queue as a latency, default 100ms,
# a deep buffer that keeps TCP at line rate; -b sets tbf's bucket, default 128kb: two 64 KB GSO
# packets, the smallest that keeps TCP at the rate (64kb gave a third of it), and small enough
# that an idle link does not pass a mid-size message faster than the rate, as 256kb did), so
# traffic between hosts is network-bound
# while ranks of one host talk over the host's own loopback. -f caps every TCP connection of the
# ranks at that rate besides (a network that limits each flow, as clouds do): not with tc, whose
# per-flow classes hash flows into buckets that collide (cls_flow), but by each socket's own
# pacing (SO_MAX_PACING_RATE, TCP's internal pacing, no fq needed), which the ranks set from
# TOROID_TEST_FLOW_RATE. Rank r runs on host r / K with
# TOROID_RANK, TOROID_WORLD_SIZE, TOROID_LOCAL_RANK/SIZE, TOROID_HOST_ID=host<h>,
# TOROID_SOCKET_IFNAME=eth0 and TOROID_STORE_ADDR=10.77.0.1:<port> (rank 0 serves the store),
# plus anything already in the environment. Output lines are prefixed with "[r]: ".
#
# Only addresses inside the namespaces it creates are used. Everything is removed on exit,
# also on failure or Ctrl-C; every rank is bounded by -t seconds (default 600). Needs root.
set -euo pipefail

hosts=4 per=2 rate=1gbit flow="" burst=128kb queue=100ms limit=600
while getopts "H:K:r:f:b:l:t:" opt; do
  case $opt in
    H) hosts=$OPTARG ;;
    K) per=$OPTARG ;;
    r) rate=$OPTARG ;;
    f) flow=$OPTARG ;;
    b) burst=$OPTARG ;;
    l) queue=$OPTARG ;;
    t) limit=$OPTARG ;;
    *) sed -n '2,25p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ $# -ge 1 ] || { sed -n '2,25p' "$0"; exit 2; }
[ "$(id -u)" = 0 ] || { echo "emulated-cluster: needs root (network namespaces)" >&2; exit 2; }

tag="tc$$"
ns_sw="${tag}sw"
n=$((hosts * per))
cpus=$(nproc --all)
pids=()

cleanup() {
  local code=$?
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.2
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for ((h = 0; h < hosts; h++)); do ip netns del "${tag}h$h" 2>/dev/null || true; done
  ip netns del "$ns_sw" 2>/dev/null || true
  exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$ns_sw"
ip -n "$ns_sw" link add br0 type bridge
ip -n "$ns_sw" link set br0 up
for ((h = 0; h < hosts; h++)); do
  ns="${tag}h$h"
  ip netns add "$ns"
  # Both ends are created directly inside the namespaces: nothing touches the root namespace.
  ip link add eth0 netns "$ns" type veth peer name "p$h" netns "$ns_sw"
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "10.77.0.$((h + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns_sw" link set "p$h" master br0
  ip -n "$ns_sw" link set "p$h" up
  # The host's link, both ways: its egress, and the switch port's egress towards it.
  ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency "$queue"
  ip netns exec "$ns_sw" tc qdisc add dev "p$h" root tbf rate "$rate" burst "$burst" latency "$queue"
done

port=$((20000 + $$ % 20000))
for ((r = 0; r < n; r++)); do
  h=$((r / per))
  ip netns exec "${tag}h$h" env \
    TOROID_RANK=$r TOROID_WORLD_SIZE=$n TOROID_LOCAL_RANK=$((r % per)) TOROID_LOCAL_SIZE=$per \
    TOROID_HOST_ID="host$h" TOROID_SOCKET_IFNAME=eth0 TOROID_STORE_ADDR="10.77.0.1:$port" \
    ${flow:+TOROID_TEST_FLOW_RATE=$flow} \
    timeout --kill-after=5 "$limit" taskset -c $((r % cpus)) "$@" \
    > >(sed -u "s/^/[$r]: /") 2> >(sed -u "s/^/[$r]: /" >&2) &
  pids+=($!)
done

status=0
for ((r = 0; r < n; r++)); do
  if ! wait "${pids[$r]}"; then
    status=1
    echo "emulated-cluster: rank $r failed; stopping the others" >&2
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  fi
done
exit $status
