# `make run` trains the default agent (CartPole-v1, PPO) locally; `make test` runs the whole suite.
# Both create .venv on first use and install what they need into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: run test test-learning checks protos config-docs lint-imports clean k8s-testenv images images-cuda e2e e2e-clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP_RUN): pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[all]"
	touch $@

$(STAMP_DEV): pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[dev]"
	touch $@ $(STAMP_RUN)

run: $(STAMP_RUN)
	$(VENV)/bin/kuberl up $(CONFIG)

# The suite has two tiers (README "Testing"). `make test` runs every unit, integration and deploy test
# (-m "not learning") spread over XDIST_WORKERS processes; `make test-learning` runs every test that trains an
# agent to a return (-m learning), one at a time: each uses the whole machine. CI (.ci/run) runs both.
# tests/k8s/provision.sh fetches and caches a real kube-apiserver, etcd and Helm (a cold build takes
# about 12 minutes once per machine); where they cannot be had, the tests that need them skip and say why.
# Each tier's deadline bounds it: a run that hangs (a gRPC object left alive can deadlock pytest's final
# garbage collection) fails instead of eating CI's time.
TEST_DEADLINE_S ?= 1500
LEARNING_DEADLINE_S ?= 3000
XDIST_WORKERS ?= 3
test: checks
	timeout --kill-after=30 $(TEST_DEADLINE_S) $(PY) -m pytest -m "not learning" -n $(XDIST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-learning: $(STAMP_DEV)
	timeout --kill-after=30 $(LEARNING_DEADLINE_S) $(PY) -m pytest -m learning $(PYTEST_ARGS)

checks: $(STAMP_DEV)
	bash tests/k8s/provision.sh
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check services tests bench kuberl_client kuberl_envs examples docker
	$(VENV)/bin/mypy

# Regenerate the committed gRPC stubs (tests/unit/test_protos.py checks they are current).
protos: $(STAMP_DEV)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/kuberl/v1/*.proto

# Regenerate docs/config.md, the experiment config's reference, from the settings dataclasses (each key's
# meaning is the comment on its field's line; tests/unit/common/test_config_reference.py checks it is current).
config-docs: $(STAMP_DEV)
	$(PY) -m services.cli.config_ref --reference > docs/config.md.tmp && mv docs/config.md.tmp docs/config.md

clean:
	rm -rf $(VENV) runs .pytest_cache .wheelhouse

k8s-testenv:
	bash tests/k8s/provision.sh

# One image per role (docker/<role>.Dockerfile), built by docker/build-images.sh without network inside the
# build: a wheelhouse is made on the host once (pip download) and served to the builds on 127.0.0.1.
# Tags match k8s/ and the Helm chart: $(IMAGE_PREFIX)<role>:<version>. PYTHON_IMAGE is the base (a
# build-arg of every Dockerfile). The learner's CUDA variant needs PyPI's CUDA torch: `make images-cuda`.
DOCKER ?= docker
IMAGE_PREFIX ?= kuberl/
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
PYTHON_IMAGE ?= python:3.11-slim-bookworm

images: $(PY)
	DOCKER="$(DOCKER)" IMAGE_PREFIX="$(IMAGE_PREFIX)" IMAGE_TAG="$(IMAGE_TAG)" PYTHON_IMAGE="$(PYTHON_IMAGE)" \
	  PYTHON=$(PY) IMAGES_PRINT_ONLY="$(IMAGES_PRINT_ONLY)" $(if $(filter undefined,$(origin TORCH_INDEX_URL)),,TORCH_INDEX_URL="$(TORCH_INDEX_URL)") \
	  bash docker/build-images.sh

images-cuda:
	$(if $(filter 1,$(IMAGES_PRINT_ONLY)),echo )$(DOCKER) build -f docker/learner.Dockerfile --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE) \
	  --build-arg TORCH_INDEX_URL= -t $(IMAGE_PREFIX)learner:$(IMAGE_TAG)-cuda .

# End-to-end tests on a real single-node cluster (tests/e2e; needs root): provisions and caches the
# node (kubelet, scheduler and proxy built from source, dockerd, CNI, DNS), builds the images into it,
# deploys the overlay and the chart, and tears everything down. Not part of `make test`. See docs/deploy.md.
e2e: $(STAMP_DEV)
	bash tests/e2e/provision.sh
	KUBERL_E2E=1 KUBERL_E2E_REQUIRE=$${KUBERL_E2E_REQUIRE:-1} timeout -s INT --kill-after=120 5400 $(PY) -m pytest tests/e2e -v -o timeout=1800 $(PYTEST_ARGS)

# Undo a node whose `make e2e` was killed before it could tear down (a live one is never touched).
e2e-clean: $(STAMP_DEV)
	$(PY) -m tests.e2e.node sweep
