#!/usr/bin/env bash
# Installs wireguard-go with TUN offloads (Debian 13's 0.0.20231211 or newer), as root, on
# Debian. Debian 12's wireguard-go (0.0.20220316) reads, encrypts and writes one packet per
# system call: at 1 Gbit/s it made the outer all-reduce 4.2x its plain time on the 2-core
# test machine, Debian 13's 1.05x (docs/benchmarks.md, "wireguard-go with TUN offloads").
# Where the system's apt sources hold such a version, it comes from there. On Debian 12
# (bookworm) this adds Debian 13 (trixie) as a source pinned at priority 50, so that apt
# takes nothing from it unless asked by name, and installs wireguard-go alone from it (its
# only dependency, libc6 >= 2.34, Debian 12 has). Remove the two files it writes
# (/etc/apt/sources.list.d/hier-localsgd-trixie.sources, /etc/apt/preferences.d/hier-localsgd-trixie)
# before upgrading the system to Debian 13: the pin would hold the whole release at 50.
set -euo pipefail
want=0.0.20231211
export LC_ALL=C DEBIAN_FRONTEND=noninteractive
installed() { dpkg-query -W -f='${db:Status-Abbrev} ${Version}' wireguard-go 2>/dev/null | awk '$1 == "ii" {print $2}'; }
have() { local v; v=$(installed) && [[ -n $v ]] && dpkg --compare-versions "$v" ge "$want"; }
if have; then exit 0; fi
apt-get update -qq
cand=$(apt-cache policy wireguard-go | awk '/Candidate:/ {print $2}')
if [[ -n $cand && $cand != "(none)" ]] && dpkg --compare-versions "$cand" ge "$want"; then
  apt-get install -y -qq --no-install-recommends wireguard-go >/dev/null
else
  codename=$( ( . /etc/os-release 2>/dev/null && echo "${ID:-}/${VERSION_CODENAME:-}" ) || echo unknown)
  if [[ $codename != debian/bookworm ]]; then
    echo "install_wireguard_go.sh: no wireguard-go >= $want in this system's apt sources (candidate: ${cand:-none}; system: $codename); install it from your distribution" >&2
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
  apt-get install -y -qq --no-install-recommends -t trixie wireguard-go >/dev/null
fi
have || { echo "install_wireguard_go.sh: wireguard-go is $(installed || true), not >= $want" >&2; exit 1; }
echo "wireguard-go $(installed) installed"
