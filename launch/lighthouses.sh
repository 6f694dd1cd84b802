#!/usr/bin/env bash
# Start lighthouses: the global one (cluster leaders) and/or one per cluster.
#
#   launch/lighthouses.sh all     [overrides...]   # single host: global + every cluster
#   launch/lighthouses.sh global  [overrides...]   # on the global coordinator host
#   launch/lighthouses.sh cluster C [overrides...] # on cluster C's coordinator host
#
# Addresses come from the config (lighthouse.global_addr, lighthouse.cluster_addrs);
# each lighthouse binds its address's port (loopback addresses bind loopback only).
# Example, two clusters on two hosts plus a coordinator:
#   launch/lighthouses.sh global  lighthouse.global_addr=http://coord:29510 \
#       "lighthouse.cluster_addrs=[http://hostA:29511,http://hostB:29511]"
# Runs in the foreground until SIGTERM/SIGINT.
set -euo pipefail
role="${1:-all}"; shift || true
args=("lighthouse.serve=$role")
if [[ "$role" == "cluster" ]]; then
  cluster="${1:?usage: launch/lighthouses.sh cluster C [overrides...]}"; shift
  args+=("lighthouse.cluster=$cluster")
fi
exec "${PYTHON:-python3}" -m hier_localsgd lighthouse "${args[@]}" "$@"
