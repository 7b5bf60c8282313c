#!/usr/bin/env bash
# Build the four role images without network access inside the build (`make images` runs this).
#
#   bash docker/build-images.sh [ROLE ...]          (default: actor buffer learner planner)
#
# 1. A wheelhouse is made on the host, once per pyproject.toml: `pip download` of every role's
#    dependencies (torch from $TORCH_INDEX_URL, below) plus the build backend. It is cached in $WHEELHOUSE (default .wheelhouse/<hash of pyproject.toml>).
# 2. It is served on 127.0.0.1 for the length of the build; each image installs from it with
#    PIP_NO_INDEX=1 and PIP_FIND_LINKS, built with `--network host` so the build can reach it. Nothing
#    is pulled but the base image named by $PYTHON_IMAGE (a build-arg of every Dockerfile), and the
#    legacy builder is used (DOCKER_BUILDKIT=0): BuildKit pulls its frontend from a registry.
# Prints each image's build time and size, and writes them as JSON to $IMAGES_REPORT when set.
#
# $DOCKER (default docker), $IMAGE_PREFIX (kuberl/), $IMAGE_TAG (pyproject's version),
# $PYTHON_IMAGE (python:3.11-slim-bookworm), $PYTHON (python3: makes the wheelhouse).
# IMAGES_PRINT_ONLY=1 prints the build commands and does nothing else (tests/deploy checks them).
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
PYTHON=${PYTHON:-python3}
IMAGE_PREFIX=${IMAGE_PREFIX:-kuberl/}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
ROLES=("$@"); [ ${#ROLES[@]} -gt 0 ] || ROLES=(actor buffer learner planner)
# Where torch comes from for the wheelhouse: PyTorch's CPU wheel index by default (PyPI's Linux torch is
# a CUDA build, gigabytes more); empty means whatever the host's pip is configured with.
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
# The wheels are for the images' interpreter and platform, not the host's: CPython $IMAGE_PYTHON
# (the base's python3, 3.11 for python:3.11-slim-bookworm and Debian bookworm) on glibc Linux of the
# host's architecture.
IMAGE_PYTHON=${IMAGE_PYTHON:-3.11}
arch=$(uname -m)
platform=(--python-version "$IMAGE_PYTHON" --implementation cp --abi "cp${IMAGE_PYTHON/./}" --abi abi3 --abi none
          --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch"
          --platform any)
key=$( (cat pyproject.toml; echo "$TORCH_INDEX_URL ${platform[*]}") | sha256sum | cut -c1-16)
WHEELHOUSE=${WHEELHOUSE:-.wheelhouse/$key}

build() {   # ROLE TAG PORT: the one build command ($DOCKER unquoted: it may be "sudo docker")
  DOCKER_BUILDKIT=0 $DOCKER build --quiet --network host -f "docker/$1.Dockerfile" -t "$2" \
    --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --build-arg TORCH_INDEX_URL= \
    --build-arg PIP_NO_INDEX=1 --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$3/" .
}
if [ "${IMAGES_PRINT_ONLY:-0}" = 1 ]; then
  DOCKER="echo $DOCKER"
  for role in "${ROLES[@]}"; do build "$role" "$IMAGE_PREFIX$role:$IMAGE_TAG" PORT; done
  exit 0
fi

if [ ! -e "$WHEELHOUSE/.complete" ]; then
  echo "[images] making the wheelhouse $WHEELHOUSE (pip download; once per pyproject.toml)"
  rm -rf "$WHEELHOUSE"; mkdir -p "$WHEELHOUSE"
  reqs="$WHEELHOUSE/requirements.txt"
  "$PYTHON" - >"$reqs" <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(p["dependencies"])
for role in ("actor", "learner", "buffer", "planner"):
    deps += [d for d in p["optional-dependencies"][role] if not d.startswith("kuberl[")]
deps += ["setuptools>=68", "wheel", "pip"]   # the build backend kuberl itself is installed with
print("\n".join(sorted(set(deps))))
PY
  torch_index=(); [ -z "$TORCH_INDEX_URL" ] || torch_index=(--extra-index-url "$TORCH_INDEX_URL")
  # --only-binary: what goes in must install without compilers in the image.
  "$PYTHON" -m pip download --quiet --only-binary=:all: "${platform[@]}" --dest "$WHEELHOUSE" \
    "${torch_index[@]}" -r "$reqs" 2> >(grep -v "is ignored: it is neither" >&2)
  touch "$WHEELHOUSE/.complete"
fi

# The wheelhouse URL is a build-arg, and build-args are part of the layer cache key: a port that changed
# on every run would rebuild every image every time. So the port follows from the wheelhouse (same
# wheelhouse, same URL, cached layers), and only if that port is taken does a free one stand in.
port=$("$PYTHON" - "$key" <<'PY'
import socket, sys
for port in (20000 + int(sys.argv[1][:4], 16) % 10000, 0):
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            print(s.getsockname()[1])
            break
    except OSError:
        continue
PY
)
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$port" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "[images] the wheelhouse server on 127.0.0.1:$port exited" >&2; exit 1; }
  sleep 0.1
done

report=()
for role in "${ROLES[@]}"; do
  tag="$IMAGE_PREFIX$role:$IMAGE_TAG"
  previous=$($DOCKER image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
  start=$(date +%s.%N)
  # (the legacy builder's deprecation notice is dropped; errors still show)
  build "$role" "$tag" "$port" >/dev/null 2> >(grep -v -e "^DEPRECATED: The legacy builder" -e "BuildKit is currently disabled" \
    -e "environment-variable\.$" -e '^$' >&2)
  secs=$("$PYTHON" -c "print(round($(date +%s.%N) - $start, 1))")
  bytes=$($DOCKER image inspect --format '{{.Size}}' "$tag")
  echo "[images] $tag built in ${secs} s, $("$PYTHON" -c "print(f'{$bytes / 1e9:.2f}')") GB"
  # The image this tag named before is now untagged, and with the legacy builder every one of its
  # layers stays on disk: a rebuild after each source change kept them all (an e2e cache reached 51 GB).
  # It is removed by ID, with the intermediate images only it used; layers the new image shares stay.
  # One docker will not remove (a container still uses it, another tag names it) is kept, and why said.
  if [ -n "$previous" ] && [ "$previous" != "$($DOCKER image inspect --format '{{.Id}}' "$tag")" ]; then
    if why=$($DOCKER image rm "$previous" 2>&1 >/dev/null); then
      echo "[images] removed the image $tag named before (${previous:7:12})"
    else
      echo "[images] could not remove the image $tag named before (${previous:7:12}): $why" >&2
    fi
  fi
  report+=("{\"role\": \"$role\", \"tag\": \"$tag\", \"build_s\": $secs, \"bytes\": $bytes}")
done
if [ -n "${IMAGES_REPORT:-}" ]; then
  (IFS=,; echo "[${report[*]}]") >"$IMAGES_REPORT"
fi
