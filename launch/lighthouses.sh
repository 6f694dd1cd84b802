#!/usr/bin/env bash
# Start lighthouses: the global one (cluster leaders) and/or one per cluster.
#
#   launch/lighthouses.sh [--no-restart] all     [overrides...]   # single host: global + every cluster
#   launch/lighthouses.sh [--no-restart] global  [overrides...]   # on the global coordinator host
#   launch/lighthouses.sh [--no-restart] cluster C [overrides...] # on cluster C's coordinator host
#
# Addresses come from the config (lighthouse.global_addr, lighthouse.cluster_addrs);
# each lighthouse binds its address's port (loopback addresses bind loopback only).
# Example, two clusters on two hosts plus a coordinator:
#   launch/lighthouses.sh global  lighthouse.global_addr=http://coord:29510 \
#       "lighthouse.cluster_addrs=[http://hostA:29511,http://hostB:29511]"
# Runs in the foreground until SIGTERM/SIGINT (or, with lighthouse.until_done=true, until
# every replica group it serves has finished). A lighthouse that dies is restarted at the
# same address after RESTART_DELAY seconds (default 2), as replica.sh does for replica
# groups; the replica processes ride out the outage (sync.outage_limit_s) and rejoin.
# --no-restart turns that off.
set -uo pipefail
restart=1
if [[ "${1:-}" == "--no-restart" ]]; then restart=0; shift; fi
role="${1:-all}"; shift || true
args=("lighthouse.serve=$role")
if [[ "$role" == "cluster" ]]; then
  cluster="${1:?usage: launch/lighthouses.sh [--no-restart] cluster C [overrides...]}"; shift
  args+=("lighthouse.cluster=$cluster")
fi
cmd=("${PYTHON:-python3}" -m hier_localsgd lighthouse "${args[@]}" "$@")
if [[ $restart -eq 0 ]]; then exec "${cmd[@]}"; fi
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/supervise.sh" || exit 1
supervise "lighthouses.sh: $role lighthouse" "${cmd[@]}"
