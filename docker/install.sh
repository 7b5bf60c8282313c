#!/bin/sh
# Install one kuberl role into a fresh virtual environment with only that role's dependencies.
# This is the only install step of every image (docker/<role>.Dockerfile runs it in its build stage)
# and tests/deploy/test_role_install.py runs the same script, so what the test checks is what ships.
#
#   sh docker/install.sh ROLE SRC VENV
#
# ROLE   actor | buffer | learner | planner: the pyproject extra to install (kuberl[ROLE])
# SRC    the source tree (pyproject.toml, README.md, protos/, services/, kuberl_client/, kuberl_envs/, docker/)
# VENV   where the virtual environment goes (/opt/kuberl in the images)
# $PYTHON           the interpreter that creates the venv (default python3)
# $TORCH_INDEX_URL  optional extra package index for torch (actor, learner): the Dockerfiles default to
#                   PyTorch's CPU wheels; empty means the default index (PyPI's Linux torch is a CUDA build,
#                   which is how the learner's CUDA variant is made: --build-arg TORCH_INDEX_URL=).
set -eu
role=$1 src=$2 venv=$3
case "$role" in
  actor|buffer|learner|planner) ;;
  *) echo "install.sh: unknown role '$role' (actor, buffer, learner or planner)" >&2; exit 2 ;;
esac
"${PYTHON:-python3}" -m venv "$venv"
set --
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  set -- --extra-index-url "$TORCH_INDEX_URL"
fi
"$venv/bin/python" -m pip install "$@" "$src[$role]"
# What no role uses at run time (docs/deploy.md, "Images"): torch's C++ test binaries (test/, bin/ but
# torch_shm_manager) and headers (include/), about 195 MB, and the venv's own installers.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d "$site/torch" ]; then
  rm -rf "$site/torch/test" "$site/torch/include"
  find "$site/torch/bin" -type f ! -name torch_shm_manager -delete
fi
"$venv/bin/python" -m pip uninstall --quiet --yes pip setuptools wheel 2>/dev/null || true
# The images' HEALTHCHECK: asks the service's grpc.health.v1 endpoint (grpcio-health-checking is a base dependency).
cp "$src/docker/healthcheck.py" "$venv/bin/kuberl-healthcheck"
chmod 0755 "$venv/bin/kuberl-healthcheck"
