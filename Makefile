# Developer entry points. CI runs `make test` through .ci/run.
#
#   make setup   .venv with the package (editable) and the dev tools; re-installs only when pyproject.toml
#                changed since the last install
#   make lint    ruff check, ruff format --check, mypy, lint-imports (the layers in pyproject.toml), and
#                the CRD and chart schema against the model they are generated from
#   make test    setup, Docker for the broker container (scripts/ensure-docker.sh), the Kubernetes test
#                tools (scripts/ensure-k8s-tools.sh), lint, all tests
#   make demo    the local demo: embedded Kafka, generator, instances, live view, report
#                (extra flags: make demo ARGS="--duration 60")
#   make image   the fluxjoin container image (one image for every role)
#   make k8s-check  helm lint, and `helm template` validated by a real kube-apiserver (server-side dry run)
#   make cluster-up / cluster-down   a single-node Kubernetes cluster on this machine (scripts/cluster.sh;
#                root), idempotent; `export KUBECONFIG=$$(scripts/cluster.sh kubeconfig)` to use it
#   make e2e     the chart on that cluster as a user runs it: helm install, scale, roll, faults, oracle
#   make clean   generated files in the work tree (not .venv, not the download cache)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp
ARGS ?=

# Spark starts Python workers with PYSPARK_PYTHON; without it they use the system Python and cannot
# import the venv's packages (pyarrow, the pipeline itself).
SPARK_ENV := PYSPARK_PYTHON=$(CURDIR)/$(BIN)/python PYSPARK_DRIVER_PYTHON=$(CURDIR)/$(BIN)/python

.PHONY: setup lint test demo image k8s-check cluster-up cluster-down e2e clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The stamp is newer than pyproject.toml after a successful install, so a second `make setup` is instant.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo --no-cache
	$(BIN)/python -m controller.k8s.crd --check

test: setup
	scripts/ensure-docker.sh
	scripts/ensure-k8s-tools.sh
	$(MAKE) --no-print-directory lint
	$(SPARK_ENV) $(BIN)/pytest -q tests

demo: setup
	$(SPARK_ENV) $(BIN)/fluxjoin demo $(ARGS)

image:
	scripts/ensure-docker.sh
	scripts/build-image.sh fluxjoin:dev

k8s-check: setup
	scripts/ensure-k8s-tools.sh
	$(BIN)/pytest -q tests/k8s -k "lint or template or kustomize"

cluster-up:
	scripts/ensure-k8s-tools.sh >/dev/null
	scripts/cluster.sh up

cluster-down:
	scripts/cluster.sh down

e2e: setup cluster-up
	$(SPARK_ENV) $(BIN)/pytest -q -s tests/e2e

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis \
		spark-warehouse metastore_db derby.log .fluxjoin reports
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
