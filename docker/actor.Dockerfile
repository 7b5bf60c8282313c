# kuberl actor: Steps environments (gymnasium, ale-py) or serves external simulators, and pushes fragments (torch).
# Build from the repository root (or `make images`):
#   docker build -f docker/actor.Dockerfile -t kuberl/actor:0.1.0 .
# The build stage runs docker/install.sh, the same script tests/deploy/test_role_install.py runs.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# Offline builds (docker/build-images.sh): --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=URL of a
# wheelhouse; unset, pip uses PyPI. pip reads both from the environment, where a build's ARGs are.
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
# torch comes from PyTorch's CPU wheel index by default (small, no CUDA libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY services services
COPY kuberl_client kuberl_client
# The example envs (pettingzoo:kuberl_envs.tron, ...): what the example configs name.
COPY kuberl_envs kuberl_envs
COPY docker docker
RUN sh docker/install.sh actor /src /opt/kuberl

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/kuberl --create-home --shell /usr/sbin/nologin kuberl
COPY --from=build /opt/kuberl /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/kuberl
USER 10001:10001
EXPOSE 50053 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["kuberl-healthcheck", "--service", "kuberl.v1.Actor", "127.0.0.1:50053"]
ENTRYPOINT ["python", "-m", "services.actor"]
# Flags come from the config file (--config, or $KUBERL_CONFIG) and the command line; see `--help`.
CMD ["--listen", "0.0.0.0:50053"]
