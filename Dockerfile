# syntax=docker/dockerfile:1
# One image for the services; the command names the service:
#   docker build -t llmgw .
#   docker run llmgw extauthz | ratelimit | router | ledger | admin
# Settings come from LLMGW_<SERVICE>__... environment variables (see compose/docker-compose.yaml).
# Envoy, Redis and PostgreSQL run from their own official images.

ARG PYTHON=python:3.11-slim

FROM ${PYTHON} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/llmgw
ENV PATH=/opt/llmgw/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/image_requirements.py deploy/
# Runtime dependencies first (a layer cached until pyproject.toml changes), wheels only.
RUN python deploy/image_requirements.py pyproject.toml > /tmp/requirements.txt \
 && pip install --only-binary=:all: -r /tmp/requirements.txt \
 # xds-protos ships an old copy of opentelemetry/proto: put opentelemetry-proto's own back.
 && pip install --force-reinstall --no-deps \
      "opentelemetry-proto==$(python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
COPY llmgw llmgw
COPY extauthz extauthz
COPY ratelimit ratelimit
COPY router router
COPY ledger ledger
COPY admin admin
# The `llmgw` command (tenants, keys, usage, certs, render-envoy): the wheel's console script.
COPY tools tools
RUN pip install --no-deps . \
 && python -c "import extauthz.__main__, ratelimit.__main__, router.__main__, ledger.__main__, admin.__main__" \
 && pip uninstall -y pip setuptools

FROM ${PYTHON}
# No compilers or pip in the venv: only the interpreter, the venv and the services.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin llmgw \
 # State a service keeps (extauthz's tenants snapshot): a new volume mounted here is its user's.
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/llmgw
COPY --from=build /opt/llmgw /opt/llmgw
ENV PATH=/opt/llmgw/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
ENTRYPOINT ["python", "-m"]
CMD ["extauthz"]
# gRPC health on the port of the service this container runs (LLMGW_<SERVICE>__SERVE__PORT);
# the admin API's HTTP /health on LLMGW_ADMIN__PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-m", "llmgw.health"]
