"""Gateway settings (environment ``VTM_*``, ``__`` for nesting; flags of ``python -m
services.gateway`` override). See shared/settings.py for the settings every service shares."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, FilePath, SecretStr, field_validator, model_validator

from services.gateway.grace import STOP_GRACE_S
from services.gateway.httpserver import server_tls
from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from shared.schemas import MAX_TOKENS
from shared.settings import ServiceSettings
from shared.slo import SloTable, parse_slo


class GatewaySettings(ServiceSettings):
    """One gateway process: HTTP API + the NATS request subject, publishing to intake."""

    service_name: str = Field(default="vtm-gateway", description="Service name in logs/traces.")
    http_host: str = Field(default="127.0.0.1", description="HTTP listen address.")
    http_port: int | None = Field(
        default=8080,
        ge=0,
        le=65535,
        description="HTTP listen port (0: the kernel picks one, see GatewayService.http_port); "
        "'off' (or 'none'): no HTTP server, the NATS subject only.",
    )
    http_tls_cert: FilePath | None = Field(
        default=None, description="Certificate chain (PEM) to serve HTTPS with; needs "
        "http_tls_key. None: plain HTTP (TLS ends at a proxy, or a private network).",
    )
    http_tls_key: FilePath | None = Field(
        default=None, description="Private key (PEM) of http_tls_cert."
    )
    api_keys: SecretStr | None = Field(
        default=None,
        description="Comma-separated API keys. Set, every /v1 route needs the header "
        "'Authorization: Bearer <one of them>' (401 otherwise; OpenAI's and vLLM's "
        "--api-key convention); /health stays open for probes. Several keys let a key be "
        "rotated without a gap. None: no authentication (a private network, a proxy that "
        "authenticates). The gateway's NATS request subject is the bus's to protect "
        "(VTM_NATS_* credentials and the server's permissions).",
    )
    model_name: str = Field(
        default="vertumnus",
        description="Model name echoed in responses when the client gives none.",
    )
    block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE,
        ge=1,
        description="Cache block size B in tokens; must equal the workers' (block identities "
        "are chained hashes of B-token blocks).",
    )
    max_body_bytes: int = Field(
        default=4 << 20, ge=1024, description="Largest HTTP request body accepted (413 above)."
    )
    max_header_bytes: int = Field(
        default=16 << 10, ge=1024, description="Largest HTTP request head accepted (431 above)."
    )
    max_prompt_tokens: int = Field(
        default=131_072, ge=1, le=MAX_TOKENS,
        description="Longest prompt accepted, in tokens (413 above); at most 2^24, the intake "
        "message's bound.",
    )
    max_seq_len: int = Field(
        default=131_072 + 8_192,
        ge=2,
        description="Longest prompt + max_tokens a request may ask for (422 above).",
    )
    vocab_size: int | None = Field(
        default=None, ge=1, description="Token ids must be below this (422 otherwise); None: "
        "only the int32 range is checked."
    )
    forward_tokens: bool = Field(
        default=True,
        description="Put the prompt's token ids in the intake message (a real engine needs "
        "them; the sim backend needs only the length and block hashes). A message larger than "
        "the server's max_payload is refused with 413.",
    )
    tokenizer_path: Path | None = Field(
        default=None,
        description="A HuggingFace tokenizer.json; with it a text prompt is accepted and the "
        "first token is detokenized (needs the `tokenizers` package, the engine extra).",
    )
    # Bounded (a day): the claim bucket's TTL and the timers take these as finite seconds.
    result_timeout_s: float = Field(
        default=120.0, gt=0, le=86_400, allow_inf_nan=False,
        description="Wait for the first token before answering 504."
    )
    publish_timeout_s: float = Field(
        default=5.0, gt=0, le=86_400, allow_inf_nan=False,
        description="Wait for the intake stream's publish ack (503 after)."
    )
    nats_wait_s: float = Field(
        default=10.0, ge=0, le=86_400, allow_inf_nan=False,
        description="How long a request waits for a lost NATS connection "
        "(or an intake that does not answer yet, or answers that JetStream is briefly "
        "unavailable: a leader election) to come back, publishing again, before 503: a broker "
        "restart delays requests instead of failing them. 0: 503 at once.",
    )
    stop_grace_s: float = Field(
        default=STOP_GRACE_S, ge=0, le=86_400, allow_inf_nan=False,
        description="On a stop, once no new request is taken: how long the requests in flight "
        "(HTTP and NATS completions alike, in one period) may still finish with their own "
        "answer; those unfinished then are answered 503 'stopping'. 0: 503 at once. Keep it "
        "well below stop_timeout_s, which bounds the whole stop (with the drains, "
        "drain_timeout_s each): a stop gives at most half the time left to its deadline, so "
        "that the 503s are still sent.",
    )
    max_idempotency_keys: int = Field(
        default=65_536, ge=1,
        description="Client request ids whose content digest this gateway remembers (for the "
        "intake's de-duplication window, 120 s unless its stream was made otherwise, plus the "
        "intake publish's bound, nats_wait_s + publish_timeout_s, from the last publish under "
        "the id), to answer 409 to an id reused with another request; past it the oldest is "
        "forgotten early (services/gateway/idempotency.py), and only the KV bucket all "
        "gateways share still knows it. About 300 bytes each.",
    )
    slo: str = Field(
        default="qwen3-30b-a3b",
        description="TTFT deadlines the vtm.request.slo_tokens metric counts: a table name "
        "(qwen3-30b-a3b, deepseek-v4-flash: paper Table 2) or BOUND:SECONDS pairs, e.g. "
        "8192:1,32768:5,inf:10.",
    )

    @field_validator("http_port", mode="before")
    @classmethod
    def _port_off(cls, v: object) -> object:
        # The environment and flags give text: 'off' / 'none' is how they say None.
        if isinstance(v, str) and v.strip().lower() in ("off", "none"):
            return None
        return v

    @field_validator("slo")
    @classmethod
    def _slo(cls, v: str) -> str:
        try:
            parse_slo(v)
        except InvalidInput as exc:
            raise ValueError(str(exc)) from None
        return v

    @property
    def publish_bound_s(self) -> float:
        """The longest a request's intake publish goes on (``GatewayService._publish_intake``):
        tries again for up to ``nats_wait_s``, and every try ends by ``publish_timeout_s``
        after that. A request's intake message is stored, if at all, within this of the
        publish's start, so its id's claim outlives the intake's de-duplication window by
        this much, counted from the last publish under the id (services/gateway/
        idempotency.py, "Window")."""
        return self.nats_wait_s + self.publish_timeout_s

    @property
    def slo_table(self) -> SloTable:
        return parse_slo(self.slo)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            keys = [k.strip() for k in v.get_secret_value().split(",")]
            # Visible ASCII only: an HTTP header is read as latin-1, so a key of other
            # characters could never match what a client sends.
            if not all(keys) or not all("!" <= c <= "~" for k in keys for c in k):
                # The message must not echo the keys (settings errors print their input).
                raise ValueError("must be comma-separated non-empty keys of visible ASCII "
                                 "characters (no spaces)")
        return v

    @property
    def api_key_list(self) -> tuple[bytes, ...]:
        """The API keys (empty: no authentication), as bytes for a constant-time compare."""
        if self.api_keys is None:
            return ()
        return tuple(k.strip().encode() for k in self.api_keys.get_secret_value().split(","))

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.http_tls_cert is None) != (self.http_tls_key is None):
            raise ValueError("VTM_HTTP_TLS_CERT and VTM_HTTP_TLS_KEY go together (set both)")
        try:  # read here, so a bad pair stops the gateway before it connects anywhere
            server_tls(self.http_tls_cert, self.http_tls_key)
        except InvalidInput as exc:
            raise ValueError(str(exc)) from None
        return self
