"""Service configuration (pydantic-settings): environment ``VTM_*``, ``__`` for nesting.

Every service's settings subclass :class:`ServiceSettings` and add their own documented
fields. Examples::

    VTM_NATS_URL=nats://127.0.0.1:4222
    VTM_SUBJECT_PREFIX=vtm
    VTM_TELEMETRY__EXPORTER=otlp VTM_TELEMETRY__ENDPOINT=http://jaeger:4317
    VTM_LOG__FORMAT=json

Settings are read once in a service's ``main`` and passed down; cores never read them.
"""

from __future__ import annotations

import re
import socket
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.subjects import Subjects, validate_subject

HOSTNAME_INSTANCE: Final[str] = "@hostname"
"""``instance_id`` value that stands for this host's name (:func:`hostname_token`)."""


def hostname_token(hostname: str) -> str:
    """A host name as an instance id (a subject token): its first label, lowercase, every
    character other than a letter, digit, '-' or '_' replaced by '-', prefixed with 'h' when
    it would not start with a letter or digit (or is empty). Pure."""
    label = hostname.split(".", 1)[0].lower()
    token = re.sub(r"[^a-z0-9_-]", "-", label)
    return token if token[:1].isalnum() else f"h{token}"


class TelemetrySettings(BaseModel):
    """OpenTelemetry tracing (see shared/telemetry.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exporter: Literal["otlp", "console", "none"] = Field(
        default="none",
        description="Where spans go: 'otlp' (Jaeger v2 / any collector), 'console' (stdout), "
        "'none' (spans are created and propagated but not exported).",
    )
    protocol: Literal["grpc", "http"] = Field(
        default="grpc",
        description="OTLP transport: 'grpc' (port 4317) or 'http' (protobuf over HTTP, 4318).",
    )
    endpoint: str | None = Field(
        default=None,
        description="OTLP endpoint, e.g. 'http://localhost:4317' (grpc) or "
        "'http://localhost:4318/v1/traces' (http). None: the exporter's default / "
        "OTEL_EXPORTER_OTLP_ENDPOINT.",
    )
    sampling_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of new root traces sampled (parent-based: a request's stages "
        "follow the gateway's decision).",
    )


class LogSettings(BaseModel):
    """structlog output (see shared/logging.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["auto", "json", "console"] = Field(
        default="auto",
        description="'json' (one object per line, for services), 'console' (human readable), "
        "'auto' (console on a terminal, JSON otherwise).",
    )
    level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Minimum level emitted."
    )


class ServiceSettings(BaseSettings):
    """Settings every service shares."""

    model_config = SettingsConfigDict(
        env_prefix="VTM_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    nats_url: str = Field(
        default="nats://127.0.0.1:4222",
        description="NATS server URL(s), comma-separated for a cluster.",
    )
    subject_prefix: str = Field(
        default="vtm",
        description="Prefix of every subject, stream and bucket name; two deployments on one "
        "server differ by prefix.",
    )
    service_name: str = Field(
        default="vertumnus",
        description="Service name in logs and traces (OTel resource service.name).",
    )
    instance_id: str | None = Field(
        default=None,
        description="This replica's id (defaults to a random NATS-assigned id); "
        "appears in micro metadata and logs. '@hostname': the host's name made a subject "
        "token (first label, lowercase, other characters '-'), which a container keeps "
        "across restarts: a scheduler restarted under the same id takes back at once what "
        "its dead process held.",
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Timeout of one NATS connection attempt."
    )
    drain_timeout_s: float = Field(
        default=10.0, gt=0, description="Upper bound on graceful shutdown (drain) time."
    )
    reconnect_wait_s: float = Field(
        default=0.5, gt=0, description="Pause between attempts to reconnect to a lost NATS "
        "server; attempts never stop (a service outlives a broker restart of any length).",
    )
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @field_validator("subject_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        validate_subject(v)
        return v

    @field_validator("instance_id")
    @classmethod
    def _instance(cls, v: str | None) -> str | None:
        return hostname_token(socket.gethostname()) if v == HOSTNAME_INSTANCE else v

    @property
    def subjects(self) -> Subjects:
        """Subject builders under this deployment's prefix."""
        return Subjects(self.subject_prefix)

    @property
    def nats_servers(self) -> list[str]:
        return [u.strip() for u in self.nats_url.split(",") if u.strip()]
