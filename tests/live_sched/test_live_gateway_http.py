"""Gateway HTTP behaviour beyond limits: keep-alive connections, text prompts through a
configured tokenizer (first token detokenized), idempotent retries (the same request again is
answered as the first; a request id reused with another request is a 409), a client that
disconnects leaves no waiter behind."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from live_sched_support import WAIT_S, Services, fake_token, http, wait_until


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split(" ")[1]), headers, body


async def test_keep_alive_serves_several_requests_on_one_connection(live: Services) -> None:
    gw = await live.gateway()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
    bad = b'{"prompt": "x", "stream": true}'
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                 + str(len(bad)).encode() + b"\r\n\r\n" + bad
                 + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    first = await read_response(reader)
    second = await read_response(reader)
    third = await read_response(reader)
    assert (first[0], first[1]["connection"]) == (200, "keep-alive")
    assert second[0] == 400 and b"stream=true" in second[2]
    assert (third[0], third[1]["connection"]) == (200, "close")
    assert await reader.read() == b""  # closed after Connection: close
    writer.close()


@pytest.mark.parametrize(
    ("head", "status"),
    [
        # Found by fuzzing the HTTP port: the connection closed without an answer.
        (b"GET http://[::1/x HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nContent-Length: 1_0\r\n\r\n0123456789", 400),
        (b"GET /health HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}", 400),
        (b"GET /health HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    ],
)
async def test_a_malformed_request_head_gets_400(live: Services, head: bytes, status: int) -> None:
    gw = await live.gateway()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
    writer.write(head)
    await writer.drain()
    code, _, body = await read_response(reader)
    assert code == status, body
    writer.close()
    assert (await http(gw.http_port, "GET", "/health")).status == 200


@pytest.mark.parametrize(
    ("body", "ctype", "status", "needle"),
    [
        # JSON's own types only (a review found true taken as token 1 and "3" as 3).
        (b'{"prompt": [true, false]}', "application/json", 400, b"'prompt.0'"),
        (b'{"prompt": [1.0, 2.0]}', "application/json", 400, b"'prompt.0'"),
        (b'{"prompt": [1], "max_tokens": "3"}', "application/json", 400, b"'max_tokens'"),
        (b'{"prompt": [1], "max_tokens": true}', "application/json", 400, b"'max_tokens'"),
        (b'{"prompt": [1], "stream": "yes"}', "application/json", 400, b"'stream'"),
        # Another media type is a 415; the type's case does not matter (RFC 9110 8.3.1).
        (b'{"prompt": [1]}', "text/plain", 415, b"Content-Type must be application/json"),
    ],
)
async def test_a_body_of_the_wrong_types_is_refused(live: Services, body: bytes, ctype: str,
                                                    status: int, needle: bytes) -> None:
    gw = await live.gateway()
    reply = await http(gw.http_port, "POST", "/v1/completions", raw=body,
                       headers={"Content-Type": ctype})
    assert reply.status == status and needle in reply.body, reply.body
    # A media type in capitals is the same type: it gets past the check (to the next one).
    odd = await http(gw.http_port, "POST", "/v1/completions", raw=b'{"prompt": [true]}',
                     headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert odd.status == 400 and b"'prompt.0'" in odd.body, odd.body


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("the quick brown fox jumps".split())}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


async def test_text_prompt_with_a_tokenizer(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                            tokenizer_file: Path) -> None:
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2, tokenizer_path=str(tokenizer_file))
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": "the quick brown fox jumps", "request_id": "txt-1"})
    assert reply.status == 200, reply.body
    out = reply.json()
    assert out["usage"]["prompt_tokens"] == 5
    assert w.assignments[0].request.tokens == [1, 2, 3, 4, 5]
    assert len(w.assignments[0].request.block_hashes) == 2  # full blocks of 2 only
    assert out["choices"][0]["token_ids"] == [fake_token("txt-1")]
    assert isinstance(out["choices"][0]["text"], str)
    assert json.loads(reply.body)["vtm"]["request_id"] == "txt-1"


async def test_a_retry_of_an_answered_request_gets_the_original_answer(
    live: Services, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """A client cut off by a gateway crash sends the same request id again, to a new gateway:
    the intake drops it as a duplicate (nothing is computed twice) and the answer is the
    original's, kept by the results stream although it went by before the retry -- not a
    wait for a result that will never come again (504)."""
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    first_gw = await live.gateway(block_size=2)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    body = {"prompt_tokens": list(range(9)), "request_id": "again-1"}
    first = await http(first_gw.http_port, "POST", "/v1/completions", body)
    assert first.status == 200, first.body
    assert first.json()["vtm"]["duplicate"] is False
    await live.stop(first_gw)

    # result_timeout_s is short: a retry waiting for the live result would fail with 504.
    second_gw = await live.gateway(block_size=2, result_timeout_s=3.0)
    again = await http(second_gw.http_port, "POST", "/v1/completions", body)
    assert again.status == 200, again.body
    out = again.json()
    assert out["vtm"]["duplicate"] is True
    assert out["choices"][0]["token_ids"] == [fake_token("again-1")]
    assert out["vtm"]["worker_id"] == first.json()["vtm"]["worker_id"] == "w-cp2-g0"
    assert [a.request.request_id for a in w.assignments] == ["again-1"]  # computed once


async def test_a_retry_after_a_503_is_a_new_attempt(
    live: Services, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """No worker: the scheduler gives up and the client gets 503 ("try again later"). The
    client tries again with the same request id once a worker is up: that is scheduled and
    answered (not the kept 503, and not a wait on a result that never comes). A second retry
    then gets that answer, without another computation."""
    sched = await live.scheduler(block_size=2, max_deliver=2, retry_delay_s=0.05)
    gw = await live.gateway(block_size=2, result_timeout_s=5.0)
    body = {"prompt_tokens": list(range(9)), "request_id": "later-1"}
    first = await http(gw.http_port, "POST", "/v1/completions", body)
    assert first.status == 503, first.body
    w = await fake_worker("w-cp2-g0", 2, 0)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    again = await http(gw.http_port, "POST", "/v1/completions", body)
    assert again.status == 200, again.body
    assert again.json()["choices"][0]["token_ids"] == [fake_token("later-1")]
    third = await http(gw.http_port, "POST", "/v1/completions", body)
    assert third.status == 200 and third.json()["vtm"]["duplicate"] is True
    assert [a.request.request_id for a in w.assignments] == ["later-1"]


async def test_a_lost_results_stream_is_made_again(
    live: Services, fake_worker, nc, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """The results stream is lost with a server's store (deleted here). A retry then finds no
    stream; the gateway creates it again, so later answered requests are kept for their
    retries once more."""
    from shared.subjects import Subjects

    await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2, result_timeout_s=3.0)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    js = nc.jetstream()
    stream = Subjects(uniq).results_stream()
    await js.delete_stream(stream)
    body = {"prompt_tokens": list(range(9)), "request_id": "lost-1"}
    assert (await http(gw.http_port, "POST", "/v1/completions", body)).status == 200
    # Its result went by with no stream to keep it: the retry cannot be answered (504), and
    # the gateway makes the stream again meanwhile.
    assert (await http(gw.http_port, "POST", "/v1/completions", body)).status == 504
    assert (await js.stream_info(stream)).config.subjects == [Subjects(uniq).result_all()]
    body = {"prompt_tokens": list(range(9)), "request_id": "lost-2"}
    assert (await http(gw.http_port, "POST", "/v1/completions", body)).status == 200
    again = await http(gw.http_port, "POST", "/v1/completions", body)
    assert again.status == 200 and again.json()["vtm"]["duplicate"] is True


async def test_a_malformed_result_does_not_answer_a_waiting_request(
    live: Services, fake_worker, nc, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """Bad bytes on a waiting request's result subject, and another request's valid result
    there, are ignored and counted; the client gets the request's own result when it comes
    (before: 502 "malformed first-token result", and the real answer went unheard)."""
    from shared.schemas import FirstToken, TtftStages, encode
    from shared.subjects import Subjects

    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    body = {"prompt_tokens": list(range(9)), "request_id": "bad-res-1"}
    client = asyncio.create_task(http(gw.http_port, "POST", "/v1/completions", body))
    await wait_until(lambda: len(w.assignments) == 1, "the assignment at the worker")
    subject = Subjects(uniq).result("bad-res-1")
    await nc.publish(subject, b"\x00 not a result")
    other = FirstToken(request_id="someone-else", token=7, stages=TtftStages(
        intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0, kv_transfer_s=0,
        first_decode_s=0, total_s=0), finished_at_s=1.0)
    data, headers = encode(other)
    await nc.publish(subject, data, headers=headers)
    await wait_until(lambda: gw.counters.get("results_malformed") == 2 or client.done(),
                     "both messages counted (or the client answered)")
    assert not client.done(), client.result().body  # still waiting for its own result
    await w.answer(w.assignments[0])
    reply = await asyncio.wait_for(client, WAIT_S)
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["token_ids"] == [fake_token("bad-res-1")]


async def test_a_retry_gets_the_answer_kept_before_a_malformed_result(
    live: Services, fake_worker, nc, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """After a request was answered, bad bytes on its result subject are the latest message
    the results stream keeps for it. A retry (a duplicate at the intake) still gets the
    answer: the stream keeps a few messages per request and the gateway passes over what is
    no result of that request (before: one kept per request, displaced; the retry timed out,
    504)."""
    from shared.subjects import Subjects

    await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2, result_timeout_s=3.0)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    body = {"prompt_tokens": list(range(9)), "request_id": "kept-1"}
    first = await http(gw.http_port, "POST", "/v1/completions", body)
    assert first.status == 200, first.body
    await nc.publish(Subjects(uniq).result("kept-1"), b"\x00 not a result")
    await nc.flush()
    again = await http(gw.http_port, "POST", "/v1/completions", body)
    assert again.status == 200, again.body
    assert again.json()["vtm"]["duplicate"] is True
    assert again.json()["choices"][0]["token_ids"] == [fake_token("kept-1")]


async def test_a_request_id_reused_with_another_request_is_a_409(
    live: Services, fake_worker, nc  # type: ignore[no-untyped-def]
) -> None:
    """A client's request_id is an idempotency key: the same request again is answered with
    the first one's result (computed once); another prompt or max_tokens under that id is a
    409 naming the id, never the first request's answer (before: the intake dropped it as a
    duplicate and the client got the other request's token, 200)."""
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    body = {"prompt_tokens": list(range(9)), "request_id": "key-1"}
    first = await http(gw.http_port, "POST", "/v1/completions", body)
    assert first.status == 200 and first.json()["vtm"]["duplicate"] is False, first.body
    for other in ({**body, "prompt_tokens": list(range(1, 10))}, {**body, "max_tokens": 2}):
        reply = await http(gw.http_port, "POST", "/v1/completions", other)
        assert reply.status == 409, reply.body
        err = reply.json()["error"]
        assert err["code"] == 409 and err["type"] == "conflict" and "'key-1'" in err["message"]
    # Fields that do not change the answer (model, sampling) are the same request.
    again = await http(gw.http_port, "POST", "/v1/completions",
                       {**body, "model": "m", "temperature": 0.5})
    assert again.status == 200 and again.json()["vtm"]["duplicate"] is True, again.body
    assert again.json()["choices"] == first.json()["choices"]
    assert [a.request.request_id for a in w.assignments] == ["key-1"]  # computed once
    assert gw.counters["conflicts"] == 2
    # An id of its own is the client's to choose again only for another request.
    fresh = await http(gw.http_port, "POST", "/v1/completions",
                       {**body, "prompt_tokens": list(range(1, 10)), "request_id": "key-2"})
    assert fresh.status == 200, fresh.body


async def test_a_client_that_disconnects_leaves_no_waiter(
    live: Services, nc, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """The client closes its connection while its request waits for the first token: the
    gateway drops its waiter at once (before: held until the result or result_timeout_s),
    and the request stays in the intake to run. The gateway keeps serving."""
    from shared.subjects import Subjects

    # No scheduler: the request waits for ever (result_timeout_s far above WAIT_S).
    gw = await live.gateway(result_timeout_s=3600.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
    body = json.dumps({"prompt_tokens": [1, 2, 3], "request_id": "gone-1"}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await wait_until(lambda: gw.waiting_for("gone-1") == 1, "the request waiting")
    writer.close()
    await writer.wait_closed()
    await wait_until(lambda: gw.waiting_for("gone-1") == 0, "its waiter dropped")
    assert gw.stats_data()["waiting"] == 0 and gw.counters["clients_gone"] == 1
    info = await nc.jetstream().stream_info(Subjects(uniq).intake_stream())
    assert info.state.messages == 1  # still to run
    assert (await http(gw.http_port, "GET", "/health")).status == 200
