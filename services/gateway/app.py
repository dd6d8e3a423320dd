"""The gateway's HTTP API (OpenAI-style), routed onto :class:`GatewayService`.

=========================  ==================================================================
``POST /v1/completions``   body ``{"prompt": [token ids] | "text", "max_tokens": n,
                           "stream": false, "model": ..., "request_id": ...}`` (``prompt_tokens``
                           is accepted as well); answers the *first* token (this is the
                           prefill pool's gateway) with the TTFT measured here and its stage
                           breakdown under ``"vtm"``. Other OpenAI sampling fields are accepted
                           and ignored. ``null`` for ``max_tokens``, ``stream``, ``n`` or
                           ``request_id`` is that field not given (OpenAI clients send it).
``GET /health``            200 ``{"status": "ok"}`` while connected to NATS, else 503
``GET /v1/workers``        every worker's degree, epoch, lifecycle, queue and hit rate from the
                           worker-state KV bucket
=========================  ==================================================================

With API keys configured (``VTM_API_KEYS``), every ``/v1`` route needs ``Authorization: Bearer
<key>``; ``/health`` stays open for probes.

Errors are OpenAI-style ``{"error": {"message", "type", "code"}}`` with: 400 malformed JSON or
fields (and ``stream: true``), 401 no or a wrong API key, 404 unknown path, 405 wrong method,
409 a ``request_id`` reused with another request (another prompt or ``max_tokens``; the same
request again is answered as the first), 411 chunked body, 413 body or prompt too large, 422
semantically impossible (too long with ``max_tokens``, token id out of range, text without a
tokenizer), 431 head too large, 503 no NATS, 504 no first token in time. A client that closes
its connection before its first token gets nothing (recorded as 499); its request still runs.

Every answer names its request and trace (``X-Request-Id``, ``X-Trace-Id``; an error's body as
``error.request_id`` and ``error.trace_id``, a completion's as ``vtm.request_id`` and
``vtm.trace_id``): the completion's id (the client's ``request_id`` once the body is read)
and its root span's trace where the request got that far, else the ids the HTTP server gave
it (services/gateway/httpserver.py, "Correlation"), whose server span of the answer then
records it (services/gateway/httpspan.py).
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any, Final

from pydantic import ValidationError

from services.gateway.adapter import (
    BadRequest,
    Completion,
    GatewayError,
    GatewayService,
    check_client_id,
    new_request_id,
)
from services.gateway.httpserver import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    error_body,
    error_response,
    server_tls,
)
from shared.schemas import CompletionRequest

# OpenAI completion fields we accept and ignore (sampling does not matter for the first token
# of a prefill pool); anything else is a 400 so typos do not pass silently.
IGNORED_FIELDS: Final[frozenset[str]] = frozenset({
    "model", "temperature", "top_p", "n", "stop", "user", "seed", "logprobs", "echo",
    "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "suffix",
    "stream_options",
})
ACCEPTED_FIELDS: Final[frozenset[str]] = frozenset(
    {"prompt", "prompt_tokens", "max_tokens", "stream", "request_id"}
)
# Optional fields whose JSON null means "not given" (their default): OpenAI's API documents
# them as nullable and its clients send null for an unset one (`"max_tokens": null`). A value
# of a wrong type is still refused; the prompt is required, so its null stays an error.
NULL_MEANS_ABSENT: Final[frozenset[str]] = frozenset({"max_tokens", "stream", "n", "request_id"})


def parse_completion_body(raw: bytes) -> tuple[CompletionRequest, str | None]:
    """The CompletionRequest and model name of an HTTP body (raises BadRequest)."""
    try:
        obj = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # (nested too deep)
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(obj) - ACCEPTED_FIELDS - IGNORED_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}")
    obj = {k: v for k, v in obj.items() if not (v is None and k in NULL_MEANS_ABSENT)}
    if obj.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("field 'model' must be a string")
    fields: dict[str, Any] = {k: obj[k] for k in ACCEPTED_FIELDS if k in obj}
    prompt = fields.pop("prompt", None)
    if prompt is not None:
        if "prompt_tokens" in fields:
            raise BadRequest("give either prompt or prompt_tokens, not both")
        if isinstance(prompt, list):
            # OpenAI allows [[ids], ...] for a batch; we serve one prompt per request.
            if prompt and all(isinstance(p, list) for p in prompt):
                if len(prompt) != 1:
                    raise BadRequest("one prompt per request (got a batch of "
                                     f"{len(prompt)})")
                prompt = prompt[0]
            fields["prompt_tokens"] = prompt
        else:
            fields["prompt"] = prompt
    if "prompt" not in fields and "prompt_tokens" not in fields:
        raise BadRequest("field 'prompt' is required (a list of token ids, or text when the "
                         "gateway has a tokenizer)")
    try:
        # Strict: JSON's own types only (true is no token id, "3" no max_tokens, 1.0 neither).
        return CompletionRequest.model_validate(fields, strict=True), model
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err.get("loc", ())) or "body"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if loc == "prompt_tokens" or loc.startswith("prompt_tokens."):
            loc = "prompt" + loc.removeprefix("prompt_tokens")
        raise BadRequest(f"field {loc!r}: {msg}" if loc != "body" else msg) from None


def completion_json(done: Completion, model: str) -> dict[str, Any]:
    """OpenAI-style completion object with the first token and the TTFT breakdown.

    Units in ``vtm``: ``ttft_s`` and ``stages`` are wall seconds (measured);
    ``predicted_prefill_s`` is the scheduler's Ê_C in modelled seconds; ``time_scale`` is the
    serving worker's wall seconds per modelled second (1 in real time; a ``sim`` worker under
    ``vertumnus up --time-scale`` less), so ``predicted_prefill_s × time_scale`` is the
    prediction of ``stages.prefill_s``."""
    r = done.result
    return {
        "id": f"cmpl-{done.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": done.text if done.text is not None else "",
                "token_ids": [r.token],
                "logprobs": None,
                # Only the first token is produced here (the decode pool streams the rest).
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": done.input_len,
            "completion_tokens": 1,
            "total_tokens": done.input_len + 1,
        },
        "vtm": {
            "request_id": done.request_id,
            "ttft_s": done.ttft_s,
            "stages": done.stages().model_dump(exclude={"schema_version"}),
            "worker_id": r.worker_id,
            "epoch": r.epoch,
            "predicted_prefill_s": r.predicted_prefill_s,  # modelled seconds
            "time_scale": r.time_scale,
            "duplicate": done.duplicate,
            "trace_id": done.trace_id,
        },
    }


def needs_key(path: str) -> bool:
    """The routes API keys protect: every ``/v1`` one (not ``/health``, for probes)."""
    return path.startswith("/v1/") or path.rstrip("/") == "/v1"


class GatewayApp:
    """Routes of the HTTP API."""

    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self._keys = service.gsettings.api_key_list

    def authorized(self, req: HttpRequest) -> bool:
        """Whether ``req`` carries one of the API keys (always, when none is configured).
        Every key is compared, in constant time, so the answer's timing tells nothing."""
        if not self._keys:
            return True
        scheme, _, given = req.headers.get("authorization", "").strip().partition(" ")
        token = given.strip().encode("utf-8", "surrogateescape")
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(token, key)
        return ok and scheme.lower() == "bearer"

    async def __call__(self, req: HttpRequest) -> HttpResponse:
        arrival = time.time()
        path = req.path.rstrip("/") or "/"
        route = {
            "/v1/completions": ("POST", self.completions),
            "/health": ("GET", self.health),
            "/v1/workers": ("GET", self.workers),
        }.get(path)
        ids = req.exchange
        if ids is not None and route is not None:
            ids.route = path  # its span's http.route (one of these few: bounded)
        # The key first: a client without one learns nothing of the /v1 routes, not even
        # which exist.
        if needs_key(req.path) and not self.authorized(req):
            return HttpResponse.json(401, error_body(
                401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                type_="invalid_api_key", ids=ids),
                {"WWW-Authenticate": 'Bearer realm="vertumnus"'})
        if route is None:
            return error_response(404, f"no route {req.path}", ids)
        method, handler = route
        if req.method != method:
            return HttpResponse.json(405, error_body(
                405, f"{req.path} accepts {method} only", type_="method_not_allowed",
                ids=ids), {"Allow": method})
        try:
            return await handler(req, arrival)
        except GatewayError as exc:
            # The ids the service noted (the completion's, its span's) are in ``ids`` now.
            return error_response(exc.status, exc.message, ids)

    async def completions(self, req: HttpRequest, arrival: float) -> HttpResponse:
        # Media types are case-insensitive (RFC 9110 §8.3.1); another one is a 415.
        ctype = req.headers.get("content-type", "application/json").split(";")[0].strip()
        if ctype.lower() not in ("application/json", ""):
            raise GatewayError(f"Content-Type must be application/json, got {ctype!r}", 415)
        body, model = parse_completion_body(req.body)
        ids = req.exchange
        if ids is not None and body.request_id:
            try:
                check_client_id(body.request_id)
                ids.note(request_id=body.request_id)
            except BadRequest:
                pass  # of the gateway's own form: refused as the request is, not echoed
        # A client's traceparent makes the request's trace part of the client's (W3C). A
        # client that closes its connection ends the wait for it (not the request). The
        # service notes the completion's ids in ``ids`` as soon as it has them (its root
        # span open: the server records no span of its own then), so an error after that
        # names them too.
        done = await self.service.complete(body, arrival_s=arrival, http=True,
                                           carrier=req.headers, disconnected=req.disconnected,
                                           ids=ids.note_traced if ids is not None else None)
        if ids is not None:
            ids.note(done.request_id, done.trace_id)
            ids.ttft_s = done.ttft_s
        # Its X-Request-Id and X-Trace-Id: the server's, from ``ids``.
        return HttpResponse.json(
            200, completion_json(done, model or self.service.gsettings.model_name))

    async def health(self, req: HttpRequest, arrival: float) -> HttpResponse:
        ok = self.service.nats_connected
        return HttpResponse.json(200 if ok else 503, {
            "status": "ok" if ok else "unavailable",
            "nats": "connected" if ok else "disconnected",
            "service": self.service.name,
            "version": self.service.version,
        })

    async def workers(self, req: HttpRequest, arrival: float) -> HttpResponse:
        now = time.time()
        states = await self.service.worker_states()
        return HttpResponse.json(200, {"workers": [
            {
                "worker_id": s.worker_id,
                "kind": str(s.kind),
                "degree": s.degree,
                "gpus": s.gpus,
                "epoch": s.epoch,
                "lifecycle": str(s.lifecycle),
                "queue_len": s.queue_len,
                "outstanding_s": s.outstanding_s,
                "hit_rate": (s.hit_tokens / s.input_tokens) if s.input_tokens else None,
                "served": s.served,
                "kv_free_blocks": s.kv_free_blocks,
                "kv_total_blocks": s.kv_total_blocks,
                # The engine's own prompt limit (None: not published; the scheduler's applies).
                "max_seq_len": s.max_seq_len,
                "heartbeat_age_s": max(0.0, now - s.heartbeat_s),
            }
            for s in states
        ]})


def make_http_server(service: GatewayService) -> HttpServer:
    st = service.gsettings
    return HttpServer(
        GatewayApp(service),
        host=st.http_host,
        port=st.http_port or 0,
        request_ids=new_request_id,
        max_body_bytes=st.max_body_bytes,
        max_header_bytes=st.max_header_bytes,
        tls=server_tls(st.http_tls_cert, st.http_tls_key),
    )
