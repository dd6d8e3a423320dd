# One image for every vertumnus service (gateway, scheduler, controller, cachemgr, rankd).
# The control plane and the sim backend need no torch: the image installs the base project.
# Build:  docker build -t vertumnus .        Run all: docker compose up
# Each container picks its service with its command (see docker-compose.yml), e.g.
#   docker run --rm vertumnus python -m services.gateway --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies first (cached layer), then the code.
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY sim ./sim
COPY vertumnus ./vertumnus
RUN pip install . && useradd --create-home --uid 10001 vtm
USER vtm

# Services log JSON and export spans over OTLP when configured (VTM_TELEMETRY__*).
ENV VTM_LOG__FORMAT=json
EXPOSE 8080
CMD ["vertumnus", "--help"]
