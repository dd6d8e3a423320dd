# One image for every vertumnus service (gateway, scheduler, controller, cachemgr, rankd).
# The control plane and the sim backend need no torch: the image installs the base project
# (the torch backend, VTM_BACKEND=torch, needs the `engine` extra: `pip install '.[engine]'`).
# Build:  docker build -t vertumnus .        Run all: docker compose up
# Each container picks its service with its command (see docker-compose.yml), e.g.
#   docker run --rm vertumnus python -m services.gateway --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# The project and its dependencies in one layer: a change to the code installs both again.
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY sim ./sim
COPY vertumnus ./vertumnus
# /var/lib/vertumnus/profile: where compose's one-shot `profile` service writes the fitted
# profile. It exists here owned by vtm so that a named volume mounted on it starts with that
# owner (Docker copies the image directory's ownership into a new volume); otherwise the volume
# root would be root's and the non-root service could not write it.
RUN pip install . && useradd --create-home --uid 10001 vtm \
    && install -d -o vtm -g vtm /var/lib/vertumnus/profile
USER vtm

# Services log JSON and export spans over OTLP when configured (VTM_TELEMETRY__*).
ENV VTM_LOG__FORMAT=json
EXPOSE 8080
CMD ["vertumnus", "--help"]
