"""Service configuration (pydantic-settings): environment ``VTM_*``, ``__`` for nesting.

Every service's settings subclass :class:`ServiceSettings` and add their own documented
fields. Examples::

    VTM_NATS_URL=nats://127.0.0.1:4222
    VTM_NATS_CREDS=/run/secrets/vtm.creds VTM_NATS_TLS_CA=/etc/vtm/ca.pem
    VTM_SUBJECT_PREFIX=vtm
    VTM_TELEMETRY__EXPORTER=otlp VTM_TELEMETRY__ENDPOINT=http://jaeger:4317
    VTM_TELEMETRY__METRICS_EXPORTER=otlp
    VTM_TELEMETRY__METRICS_ENDPOINT=http://prometheus:9090/api/v1/otlp/v1/metrics
    VTM_LOG__FORMAT=json

Settings are read once in a service's ``main`` and passed down; cores never read them.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.subjects import Subjects, validate_subject

MAX_WAIT_S: Final[float] = 86_400.0
"""Upper bound (a day) of every wait a setting gives: connect, drain and stop timeouts, the
pause between reconnects, the ping interval. Those feed asyncio timers, nats-py's loops and
the fault handler's deadline (shared/stopping.py), which take no value of any size (a stop
timeout of 1e300 s overflows the fault handler's clock); a longer wait is a typo."""

NESTED: Final[str] = "__"
"""Delimiter of a nested setting's variable name (``VTM_TELEMETRY__EXPORTER``)."""

INSTANCE_ID_MAX: Final[int] = 128
"""Longest ``instance_id`` (shared.schemas.Id, which the records and reports carrying it use)."""
_INSTANCE_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]*")

HOSTNAME_INSTANCE: Final[str] = "@hostname"
"""``instance_id`` value that stands for this host's name (:func:`hostname_token`)."""


def hostname_token(hostname: str) -> str:
    """A host name as an instance id (a subject token): its first label, lowercase, every
    character other than a letter, digit, '-' or '_' replaced by '-', prefixed with 'h' when
    it would not start with a letter or digit (or is empty). Pure."""
    label = hostname.split(".", 1)[0].lower()
    token = re.sub(r"[^a-z0-9_-]", "-", label)
    return token if token[:1].isalnum() else f"h{token}"


def json_object_text(v: Any) -> Any:
    """What a ``mode="before"`` validator of a dict setting makes of ``v``: a text (an
    environment variable, a flag) is the JSON it holds, and an empty or blank one ``{}``; any
    other value is passed on as it is. The field's own type then checks the result; text that
    is no JSON fails the validation with the parser's error."""
    if isinstance(v, str):
        return json.loads(v) if v.strip() else {}
    return v


class TelemetrySettings(BaseModel):
    """OpenTelemetry tracing (shared/telemetry.py) and metrics (shared/metrics.py)."""

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
        allow_inf_nan=False,
        description="Fraction of new root traces sampled (parent-based: a request's stages "
        "follow the gateway's decision). Reconfiguration traces are always sampled.",
    )
    export_delay_s: float = Field(
        default=1.0,
        gt=0.0,
        le=60.0,
        allow_inf_nan=False,
        description="Seconds the span batch waits before it is exported (at most 60). Shorter "
        "than the SDK's 5 s (OTEL_BSP_SCHEDULE_DELAY, which this replaces): a process that "
        "crashes loses the spans it had not exported, and a crash is when traces are read.",
    )
    metrics_exporter: Literal["otlp", "console", "none"] = Field(
        default="none",
        description="Where metrics go (shared/metrics.py): 'otlp' (Prometheus' OTLP receiver "
        "or any collector), 'console' (stdout), 'none' (recorded, not exported).",
    )
    metrics_protocol: Literal["grpc", "http"] = Field(
        default="http",
        description="OTLP transport of metrics: 'http' (e.g. Prometheus' "
        "http://prometheus:9090/api/v1/otlp/v1/metrics) or 'grpc' (a collector's 4317).",
    )
    metrics_endpoint: str | None = Field(
        default=None,
        description="OTLP metrics endpoint. None: the exporter's default / "
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT.",
    )
    metrics_interval_s: float = Field(
        default=15.0,
        gt=0.0,
        le=3600.0,
        allow_inf_nan=False,
        description="Seconds between two metric exports (at most 3600).",
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
    # Credentials and TLS (shared/natsauth.py turns them into nats.connect options). At most
    # one way of authenticating; secrets are SecretStr so that no log or repr shows them.
    nats_creds: FilePath | None = Field(
        default=None,
        description="NATS credentials file (a user JWT and its nkey seed, e.g. from `nsc`), for "
        "a server in operator (decentralised JWT) mode.",
    )
    nats_nkey_seed: FilePath | None = Field(
        default=None, description="File holding a user nkey seed ('SU…'), for a server whose "
        "users are nkeys."
    )
    nats_token: SecretStr | None = Field(
        default=None, description="Authentication token (a server started with `--auth`)."
    )
    nats_user: str | None = Field(default=None, description="User name (with nats_password).")
    nats_password: SecretStr | None = Field(
        default=None, description="Password of nats_user."
    )
    nats_tls_ca: FilePath | None = Field(
        default=None, description="CA bundle (PEM) the server's certificate must chain to; "
        "setting it turns TLS on (unset: the system's CAs, when TLS is on)."
    )
    nats_tls_cert: FilePath | None = Field(
        default=None, description="Client certificate (PEM) for a server that verifies "
        "clients (mutual TLS); turns TLS on; needs nats_tls_key."
    )
    nats_tls_key: FilePath | None = Field(
        default=None, description="Private key (PEM) of nats_tls_cert."
    )
    nats_tls_hostname: str | None = Field(
        default=None, description="Host name the server's certificate must name, when it is "
        "not the one in VTM_NATS_URL (e.g. a certificate for 'nats' reached at an IP address)."
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
        default=5.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Timeout of one NATS connection attempt. At most 86 400 s (a day).",
    )
    jetstream_timeout_s: float = Field(
        default=5.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Timeout of one JetStream API request that no setting of its own bounds: "
        "the start-up's streams, consumers and buckets, and the KV reads and writes after it "
        "(nats-py's default, 5 s). A start-up whose server is lost ends after it (the process "
        "exits for a restart). At most 86 400 s (a day).",
    )
    drain_timeout_s: float = Field(
        default=10.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Upper bound on graceful shutdown (drain) time. At most 86 400 s (a day).",
    )
    stop_timeout_s: float = Field(
        default=45.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Upper bound on a whole graceful stop after SIGINT/SIGTERM: past it the "
        "process logs the tasks it still waits for and exits with status 70 "
        "(shared/stopping.py). Above the sum of a rank daemon's own bounds (redirect, drain "
        "and the connection's drain: 30 s by default). At most 86 400 s (a day): the fault "
        "handler that ends a stuck process takes no deadline of any size.",
    )
    parent_pid: int | None = Field(
        default=None, gt=0,
        description="Stop (as on SIGTERM) once the process of this pid is no longer this "
        "process's parent; `vertumnus up` sets it for its children.",
    )
    reconnect_wait_s: float = Field(
        default=0.5, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Pause between attempts to reconnect to a lost NATS "
        "server; attempts never stop (a service outlives a broker restart of any length). "
        "At most 86 400 s (a day).",
    )
    ping_interval_s: float = Field(
        default=20.0, gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Seconds between this process's pings of its NATS server. With "
        "max_outstanding_pings they bound how long a connection that went silent without "
        "closing (a crashed host, a dropped NAT or firewall entry: a half-open TCP "
        "connection) goes unnoticed: about ping_interval_s x (max_outstanding_pings + 1), "
        "then the process reconnects. nats-py's own defaults (120 s, 2) took up to 6 min. "
        "At most 86 400 s (a day).",
    )
    max_outstanding_pings: int = Field(
        default=2, ge=1, le=100,
        description="Pings left unanswered before the NATS connection counts as lost.",
    )
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @field_validator("subject_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        validate_subject(v)
        return v

    @field_validator("nats_creds", "nats_nkey_seed", "nats_tls_ca", "nats_tls_cert",
                     "nats_tls_key")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        if v is not None and not os.access(v, os.R_OK):
            raise ValueError(f"file {str(v)!r} is not readable by this process")
        return v

    @model_validator(mode="after")
    def _one_way_in(self) -> Self:
        ways = [name for name, v in (("VTM_NATS_CREDS", self.nats_creds),
                                     ("VTM_NATS_NKEY_SEED", self.nats_nkey_seed),
                                     ("VTM_NATS_TOKEN", self.nats_token),
                                     ("VTM_NATS_USER", self.nats_user)) if v is not None]
        if any(urlsplit(u if "://" in u else f"nats://{u}").username
               for u in self.nats_servers):
            ways.append("credentials in VTM_NATS_URL")
        if len(ways) > 1:
            raise ValueError(f"more than one way to authenticate to NATS: {', '.join(ways)} "
                             "(set one)")
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError("VTM_NATS_USER and VTM_NATS_PASSWORD go together (set both)")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("VTM_NATS_TLS_CERT and VTM_NATS_TLS_KEY go together (set both)")
        return self

    @field_validator("instance_id")
    @classmethod
    def _instance(cls, v: str | None) -> str | None:
        if v == HOSTNAME_INSTANCE:
            return hostname_token(socket.gethostname())[:INSTANCE_ID_MAX]
        if v == "":  # an empty variable: unset, as every user of the id already took it
            return None
        # The id is a subject token and the reporter/holder of the records and reports a
        # replica writes (shared.schemas.Id): one the schemas refuse failed every intake
        # delivery and window report of a running scheduler instead of its start.
        if v is not None and (len(v) > INSTANCE_ID_MAX or not _INSTANCE_RE.fullmatch(v)):
            raise ValueError(f"instance_id must be 1-{INSTANCE_ID_MAX} characters of a-z, 0-9, "
                             f"'-' and '_', starting with a letter or digit, got {v!r}")
        return v

    @property
    def subjects(self) -> Subjects:
        """Subject builders under this deployment's prefix."""
        return Subjects(self.subject_prefix)

    @property
    def nats_servers(self) -> list[str]:
        return [u.strip() for u in self.nats_url.split(",") if u.strip()]


def _model_env_names(model: type[BaseModel], prefix: str) -> Iterator[str]:
    for name, field in model.model_fields.items():
        env = f"{prefix}{name}".upper()
        yield env
        ann: Any = field.annotation
        if inspect.isclass(ann) and issubclass(ann, BaseModel) and not issubclass(
            ann, BaseSettings
        ):
            yield from _model_env_names(ann, f"{prefix}{name}{NESTED}")


def env_names(settings_cls: type[BaseSettings]) -> frozenset[str]:
    """Every environment variable ``settings_cls`` reads (``VTM_X``, ``VTM_TELEMETRY__Y``)."""
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    return frozenset(_model_env_names(settings_cls, prefix))
