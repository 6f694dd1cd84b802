#!/usr/bin/env bash
# This host's end of the WireGuard mesh that carries the WAN (docs/security.md). Start it
# first on every host of a deployment (coordinator and every cluster's hosts), as root:
#
#   launch/tunnel.sh tunnel.site=A "tunnel.sites=[coord@203.0.113.1,A@203.0.113.2,B@203.0.113.3]" \
#       security.secret_file=/etc/hier_localsgd/job.secret
#
# Every host gets the same secret file (hier-localsgd keygen PATH, copied out of band) and
# the same site list; site k gets overlay address k+1 (198.19.0.1, .2, ...). Then give the
# lighthouses and replica groups overlay addresses: lighthouse.global_addr=http://198.19.0.1:29510,
# each cluster's lighthouse and run.hostname its host's overlay address. Only WireGuard's
# UDP port (51820) must be open between the hosts. security.tunnel_mtu=N (default 1420, the same
# on every host) sets the interface's MTU; it must fit the WAN path (docs/security.md). Install
# wireguard-go with launch/install_wireguard_go.sh (Debian 12's own costs 4x at 1 Gbit/s).
# Runs in the foreground until SIGTERM/SIGINT, then takes the interface down. If
# wireguard-go dies, the tunnel is rebuilt after RESTART_DELAY seconds (default 2);
# --no-restart turns that off.
set -uo pipefail
restart=1
if [[ "${1:-}" == "--no-restart" ]]; then restart=0; shift; fi
cmd=("${PYTHON:-python3}" -m hier_localsgd tunnel "$@")
if [[ $restart -eq 0 ]]; then exec "${cmd[@]}"; fi
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/supervise.sh" || exit 1
supervise "tunnel.sh: the tunnel" "${cmd[@]}"
