"""Replay a workload through a running gateway over HTTP and measure what clients see.

Prompts: a workload (trace or synthetic) gives each request its length and its block
identities (``block_hashes``), not its tokens. The gateway hashes token ids itself, so the
replay turns each block identity into 512 (B) deterministic token ids (a generator seeded by
the identity): equal block ids ⇒ equal tokens ⇒ equal chained hashes at the gateway, so the
workload's prefix sharing survives the trip. Tokens past the given identities are unique to the
request. (The gateway's hashes differ from the workload's numbers; only the structure matters.)

Time: arrivals are replayed at ``arrival_s × time_scale / rate_scale`` seconds after the start
(``time_scale`` is the rank daemons' sim time factor, so modelled and wall time advance
together). Measured TTFTs are divided by ``time_scale`` to give *modelled* seconds, which is
what the SLO deadlines (paper Table 2) are about; the overhead figures stay in wall time.

TTFT is the gateway's own measurement (request received → first token there, design.md
"Metrics"), plus, for a request the client had to send again (a gateway restarting refused the
connection, or died with it open: ``ReplayConfig.retry_s``), the time from its first try to
the try that was answered; the client-side round trip is recorded too. Overhead per request =
TTFT − retry wait − intake wait − worker queue wait − prefill − KV transfer − first decode
(what the system adds around the work: scheduling, dispatch, result delivery).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np

from shared.ids import DEFAULT_BLOCK_SIZE
from shared.tasks import cancel_and_wait
from sim.workloads.workload import Request, Workload
from vertumnus.live.http import (
    ConnectionDropped,
    ConnectionRefused,
    HttpError,
    Response,
    request,
)

VOCAB: Final[int] = 151_936  # Qwen3's vocabulary, so ids stay in a real model's range
_MASK64: Final[int] = (1 << 64) - 1


class BlockTokens:
    """Deterministic token ids per block identity (memoised: shared prefixes repeat)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, vocab: int = VOCAB,
                 cache_blocks: int = 65_536) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self._cache: dict[int, np.ndarray] = {}
        self._cache_blocks = cache_blocks

    def block(self, key: int) -> np.ndarray:
        got = self._cache.get(key)
        if got is None:
            rng = np.random.default_rng(key & _MASK64)
            got = rng.integers(0, self.vocab, self.block_size, dtype=np.int64)
            if len(self._cache) >= self._cache_blocks:
                self._cache.clear()
            self._cache[key] = got
        return got

    def prompt(self, req: Request) -> list[int]:
        """``input_len`` token ids whose full blocks follow ``req.block_hashes``."""
        bsz = self.block_size
        parts = [self.block(int(h)) for h in req.block_hashes[: -(-req.input_len // bsz)]]
        have = len(parts) * bsz
        if have < req.input_len:
            # Beyond the given identities: tokens unique to this request.
            seed = int.from_bytes(req.request_id.encode()[-16:].rjust(16, b"\0"), "big")
            rng = np.random.default_rng([seed & _MASK64, seed >> 64, len(parts)])
            parts.append(rng.integers(0, self.vocab, req.input_len - have, dtype=np.int64))
        return np.concatenate(parts)[: req.input_len].tolist() if parts else []


def wire_id(req: Request, id_prefix: str = "") -> str:
    """The request id sent to the gateway: a legal subject token (lowercase, [a-z0-9_-])."""
    rid = f"{id_prefix}{req.request_id}".lower()
    rid = "".join(c if (c.isascii() and (c.isalnum() or c in "-_")) else "-" for c in rid)
    if not rid[:1].isalnum():
        rid = "r" + rid
    return rid[:128]


def completion_body(req: Request, tokens: list[int], *, id_prefix: str = "") -> bytes:
    """The ``POST /v1/completions`` body of one replayed request."""
    return json.dumps({"prompt": tokens, "max_tokens": max(1, req.output_len),
                       "request_id": wire_id(req, id_prefix)}, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    """What one replayed request gave (wall seconds unless named ``model``)."""

    request_id: str
    arrival_s: float  # in the workload (modelled)
    input_len: int
    status: int  # HTTP status; 0 = no response (connection error)
    error: str | None = None
    ttft_s: float = math.nan  # wall: measured by the gateway, plus retry_wait_s
    client_s: float = math.nan  # client round trip, wall
    intake_wait_s: float = 0.0
    schedule_s: float = 0.0
    queue_wait_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    first_decode_s: float = 0.0
    prefix_tokens: int = 0
    worker_id: str | None = None
    epoch: int | None = None
    predicted_prefill_s: float | None = None  # modelled (the scheduler's Ê_C)
    retry_wait_s: float = 0.0
    """Wall seconds from the first try to the try that was answered (0: the first was); part
    of ``ttft_s``, which runs from the first try."""
    retries: int = 0
    """Tries after the first (``ReplayConfig.retry_s``)."""
    worker_time_scale: float | None = None
    """The answering worker's wall seconds per modelled second (its answer's ``time_scale``;
    None: an older gateway that does not say). The report divides by the replay's own time
    scale and says so when the workers run at another."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def overhead_s(self) -> float:
        """TTFT − connect wait − intake wait − queue wait − prefill − KV transfer − first
        decode (wall): the time the system's own steps add."""
        return self.ttft_s - (self.retry_wait_s + self.intake_wait_s + self.queue_wait_s
                              + self.prefill_s + self.kv_transfer_s + self.first_decode_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_from_response(req: Request, status: int, payload: Any, client_s: float,
                         request_id: str | None = None) -> ReplayRecord:
    base = {"request_id": request_id or req.request_id, "arrival_s": req.arrival_s,
            "input_len": req.input_len, "status": status, "client_s": client_s}
    if status != 200 or not isinstance(payload, dict) or "vtm" not in payload:
        msg = None
        if isinstance(payload, dict):
            msg = (payload.get("error") or {}).get("message")
        return ReplayRecord(**base, error=msg or f"HTTP {status}")
    vtm = payload["vtm"]
    st = vtm.get("stages") or {}
    return ReplayRecord(
        **base,
        ttft_s=float(vtm.get("ttft_s", st.get("total_s", math.nan))),
        intake_wait_s=float(st.get("intake_wait_s", 0.0)),
        schedule_s=float(st.get("schedule_s", 0.0)),
        queue_wait_s=float(st.get("queue_wait_s", 0.0)),
        prefill_s=float(st.get("prefill_s", 0.0)),
        kv_transfer_s=float(st.get("kv_transfer_s", 0.0)),
        first_decode_s=float(st.get("first_decode_s", 0.0)),
        prefix_tokens=int(vtm.get("prefix_tokens") or 0),
        worker_id=vtm.get("worker_id"),
        epoch=vtm.get("epoch"),
        predicted_prefill_s=vtm.get("predicted_prefill_s"),
        worker_time_scale=_finite_or_none(vtm.get("time_scale")),
    )


def _finite_or_none(x: Any) -> float | None:
    """``x`` as a finite float, or None for anything else (a missing or malformed field)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


ProgressFn = Callable[[ReplayRecord], None]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    time_scale: float = 1.0
    rate_scale: float = 1.0
    request_timeout_s: float = 600.0
    id_prefix: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    retry_s: float = 10.0
    """A request whose connection was refused (no gateway listening: one restarting) or
    dropped before a response (the gateway died with it open) is sent again, with the same
    request id and a backoff up to 1 s, until this many wall seconds after its first failure,
    as an HTTP client behind a load balancer would. Safe: a refused one never reached a
    gateway, and the intake de-duplicates a request id it already has and the gateway answers
    the copy with the original's result. 0: no retry."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as ``Authorization: Bearer`` (a gateway with ``VTM_API_KEYS``); None: none."""
    on_failed_try: Callable[[HttpError], None] | None = field(default=None, repr=False,
                                                              compare=False)
    """Called with the error each time a try is refused or dropped (whether another try
    follows or not); it observes only (for tests and progress). None: nothing is called."""

    def __post_init__(self) -> None:
        for name in ("time_scale", "rate_scale", "request_timeout_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        if not (self.retry_s >= 0 and math.isfinite(self.retry_s)):
            raise ValueError(f"retry_s must be finite and >= 0, got {self.retry_s}")


def prepare_bodies(requests: Sequence[Request], config: ReplayConfig) -> list[bytes]:
    """Every request's HTTP body, built before the clock starts (encoding is not load)."""
    gen = BlockTokens(config.block_size)
    return [completion_body(r, gen.prompt(r), id_prefix=config.id_prefix) for r in requests]


async def replay(
    gateway_url: str,
    requests: Sequence[Request],
    config: ReplayConfig,
    *,
    bodies: Sequence[bytes] | None = None,
    on_result: ProgressFn | None = None,
) -> list[ReplayRecord]:
    """Send every request at its scaled arrival time; return records in workload order.

    Cancelling this coroutine cancels the requests in flight; their records are absent.
    """
    url = gateway_url.rstrip("/") + "/v1/completions"
    bodies = list(bodies) if bodies is not None else prepare_bodies(requests, config)
    if len(bodies) != len(requests):
        raise ValueError("one body per request")
    factor = config.time_scale / config.rate_scale
    t0 = min((r.arrival_s for r in requests), default=0.0)
    results: list[ReplayRecord | None] = [None] * len(requests)
    start = time.monotonic()

    async def one(i: int, req: Request, body: bytes) -> None:
        delay = start + (req.arrival_s - t0) * factor - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.monotonic()
        rid = wire_id(req, config.id_prefix)
        try:
            resp, waited, retries = await _send(url, body, config)
            try:
                payload = resp.json()
            except ValueError:
                payload = None
            rec = record_from_response(req, resp.status, payload, time.monotonic() - sent, rid)
            if retries:
                rec = dataclasses.replace(rec, retry_wait_s=waited, retries=retries,
                                          ttft_s=rec.ttft_s + waited)
        except (HttpError, TimeoutError) as exc:
            rec = ReplayRecord(rid, req.arrival_s, req.input_len, 0,
                               error=str(exc), client_s=time.monotonic() - sent)
        results[i] = rec
        if on_result is not None:
            on_result(rec)

    tasks = [asyncio.create_task(one(i, r, b)) for i, (r, b) in
             enumerate(zip(requests, bodies, strict=True))]
    try:
        await asyncio.gather(*tasks)
    finally:
        # Not cancel-then-gather: a cancel landing as a reply arrives can be swallowed on
        # 3.11 (shared/tasks.py), and the gather would wait for that request to time out.
        await cancel_and_wait(tasks)
    return [r for r in results if r is not None]


async def _send(url: str, body: bytes, config: ReplayConfig) -> tuple[Response, float, int]:
    """POST ``body``; a refused or dropped connection is tried again until
    ``config.retry_s`` after the first failure. Returns the response, the wall seconds from the
    first try to the one answered, and the number of retries. Raises the last
    :class:`HttpError` (or TimeoutError)."""
    first = time.monotonic()
    retries = 0
    pause = 0.05
    deadline = 0.0
    while True:
        tried = time.monotonic()
        try:
            resp = await request(url, "POST", body, timeout_s=config.request_timeout_s,
                                 api_key=config.api_key)
            return resp, tried - first, retries
        except (ConnectionRefused, ConnectionDropped) as exc:
            now = time.monotonic()
            if config.on_failed_try is not None:
                config.on_failed_try(exc)
            if not retries:
                deadline = now + config.retry_s  # from the first failure, never extended
            if now + pause > deadline:
                raise exc
        await asyncio.sleep(pause)
        pause = min(1.0, pause * 2)
        retries += 1


def workload_requests(workload: Workload, max_requests: int | None = None) -> list[Request]:
    """The first ``max_requests`` requests of ``workload`` (None or 0: all); a negative count
    raises ValueError (as a slice it would drop requests from the end)."""
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0 (0: all), got {max_requests}")
    reqs = list(workload)
    return reqs[:max_requests] if max_requests else reqs


__all__ = [
    "BlockTokens",
    "ReplayConfig",
    "ReplayRecord",
    "completion_body",
    "prepare_bodies",
    "record_from_response",
    "replay",
    "wire_id",
    "workload_requests",
]
