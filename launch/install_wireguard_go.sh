#!/usr/bin/env bash
# Installs wireguard-go with TUN offloads (Debian 13's 0.0.20231211 or newer), as root, on
# Debian. Debian 12's wireguard-go (0.0.20220316) reads, encrypts and writes one packet per
# system call: at 1 Gbit/s it made the outer all-reduce 4.2x its plain time on the 2-core
# test machine, Debian 13's 1.05x (docs/benchmarks.md, "wireguard-go with TUN offloads").
# Where this system's apt sources have no such version (Debian 12), it adds Debian 13 as a
# source pinned at priority 50 (apt takes nothing from it unless asked by name) and installs
# wireguard-go alone from it; its only dependency, libc6 >= 2.34, Debian 12 has.
set -euo pipefail
want=0.0.20231211
have() { local v; v=$(dpkg-query -W -f='${Version}' wireguard-go 2>/dev/null) && dpkg --compare-versions "$v" ge "$want"; }
if have; then exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
cand=$(apt-cache policy wireguard-go | awk '/Candidate:/ {print $2}')
if [[ -n $cand && $cand != "(none)" ]] && dpkg --compare-versions "$cand" ge "$want"; then
  apt-get install -y -qq wireguard-go >/dev/null
else
  . /etc/os-release
  if [[ ${ID:-} != debian ]]; then
    echo "install_wireguard_go.sh: no wireguard-go >= $want in this system's apt sources (candidate: ${cand:-none}); install it from your distribution" >&2
    exit 1
  fi
  cat > /etc/apt/sources.list.d/hier-localsgd-trixie.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 50\n' > /etc/apt/preferences.d/hier-localsgd-trixie
  apt-get update -qq
  apt-get install -y -qq -t trixie wireguard-go >/dev/null
fi
have || { echo "install_wireguard_go.sh: wireguard-go is $(dpkg-query -W -f='${Version}' wireguard-go 2>/dev/null || echo missing), not >= $want" >&2; exit 1; }
echo "wireguard-go $(dpkg-query -W -f='${Version}' wireguard-go) installed"
