#!/usr/bin/env bash
# Provision what `make e2e` needs (tests/e2e/node.py), idempotent and cached; a warm run takes seconds.
#   - the control plane and the node's binaries: tests/k8s/provision.sh with KUBERL_K8S_NODE=1 (kubelet,
#     kube-scheduler, kube-proxy and pause built from Debian's kubernetes 1.20.2 source tree, once);
#   - Debian packages: docker.io (dockerd; kubelet 1.20's dockershim runs pods on it), runc,
#     containernetworking-plugins (CNI bridge, host-local, portmap), dnsmasq-base, iptables, conntrack,
#     iproute2, mmdebstrap;
#   - the images' base: a Debian bookworm rootfs with python3.11 made by mmdebstrap into
#     $KUBERL_E2E_CACHE/base-bookworm-python3.tar (a stand-in for python:3.11-slim-bookworm, which cannot
#     be pulled here); the harness imports it into dockerd as kuberl-e2e/python:3.11-bookworm.
# Where something cannot be had it says why in $KUBERL_E2E_CACHE/unavailable and the tests skip with it.
set -uo pipefail
CACHE="${KUBERL_E2E_CACHE:-$HOME/.cache/kuberl/e2e}"
mkdir -p "$CACHE"
rm -f "$CACHE/unavailable"
say() { echo "[e2e] $*"; }
unavailable() { say "UNAVAILABLE: $*"; echo "$*" >>"$CACHE/unavailable"; }

KUBERL_K8S_NODE=1 bash "$(dirname "$0")/../k8s/provision.sh"

if [ "$(id -u)" != 0 ]; then
  unavailable "the e2e node needs root (dockerd, kubelet, a bridge, iptables)"
  exit 0
fi
pkgs=(docker.io runc containernetworking-plugins dnsmasq-base iptables conntrack iproute2 mmdebstrap)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "apt-get install ${missing[*]}"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"$CACHE/apt.log" 2>&1 || unavailable "apt-get install ${missing[*]} failed (see $CACHE/apt.log)"
fi

base="$CACHE/base-bookworm-python3.tar"
if [ ! -s "$base" ] && command -v mmdebstrap >/dev/null; then
  say "making the images' base rootfs with mmdebstrap (about a minute, once)"
  # Docs, man pages and locales are left out: nothing in the images reads them.
  if mmdebstrap --quiet --format=tar --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      bookworm "$base.part" >"$CACHE/mmdebstrap.log" 2>&1; then
    mv "$base.part" "$base"
  else
    rm -f "$base.part"
    unavailable "mmdebstrap failed (see $CACHE/mmdebstrap.log)"
  fi
fi
say "ready"
exit 0
