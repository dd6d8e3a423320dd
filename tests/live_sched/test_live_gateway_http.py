"""Gateway HTTP behaviour beyond limits: keep-alive connections, text prompts through a
configured tokenizer (first token detokenized)."""

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
