# `make run` trains the default agent (CartPole-v1, PPO) locally; `make test` runs the whole suite.
# Both create .venv on first use and install what they need into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: run test protos lint-imports clean k8s-testenv

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

# tests/k8s/provision.sh fetches and caches a real kube-apiserver, etcd and Helm (a cold build takes
# about 12 minutes once per machine); where they cannot be had, the tests that need them skip and say why.
test: $(STAMP_DEV)
	bash tests/k8s/provision.sh
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerate the committed gRPC stubs (tests/unit/test_protos.py checks they are current).
protos: $(STAMP_DEV)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/kuberl/v1/*.proto

clean:
	rm -rf $(VENV) runs .pytest_cache

k8s-testenv:
	bash tests/k8s/provision.sh
