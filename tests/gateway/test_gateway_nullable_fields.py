"""The completion body's optional OpenAI fields take JSON ``null`` as "not given" (their
default): OpenAI's clients send ``"max_tokens": null`` (and ``stream``, ``n``) for an unset
one, which the gateway answered with a 400. A wrong type is still refused, and so is a null
prompt (the prompt is required). ``parse_completion_body`` is the HTTP route's parser."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.adapter import BadRequest
from services.gateway.app import parse_completion_body


def _parse(body: dict[str, Any]) -> Any:
    return parse_completion_body(json.dumps(body).encode())


@pytest.mark.parametrize("field", ["max_tokens", "stream", "n", "request_id"])
def test_null_is_the_fields_default(field: str) -> None:
    req, model = _parse({"prompt": [1, 2, 3], "model": "m", field: None})
    assert req == _parse({"prompt": [1, 2, 3]})[0]
    assert (req.max_tokens, req.stream, req.request_id, model) == (1, False, None, "m")


def test_an_openai_client_body_with_every_unset_field_null() -> None:
    body = {"model": "qwen", "prompt": [5, 6], "max_tokens": None, "stream": None, "n": None,
            "temperature": None, "top_p": None, "stop": None, "user": None, "seed": None,
            "logprobs": None, "echo": None, "suffix": None, "stream_options": None}
    req, model = _parse(body)
    assert req.prompt_tokens == [5, 6] and req.max_tokens == 1 and model == "qwen"
    assert _parse({**body, "max_tokens": 7})[0].max_tokens == 7  # a value still counts


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": [1], "max_tokens": "3"}, "'max_tokens'"),
    ({"prompt": [1], "max_tokens": True}, "'max_tokens'"),
    ({"prompt": [1], "max_tokens": 0}, "'max_tokens'"),
    ({"prompt": [1], "stream": "yes"}, "'stream'"),
    ({"prompt": [1], "n": 2}, "only n=1"),
    ({"prompt": None, "max_tokens": None}, "field 'prompt' is required"),
], ids=["str", "bool", "zero", "stream-str", "n-2", "null-prompt"])
def test_wrong_types_and_a_missing_prompt_are_still_refused(body: dict[str, Any],
                                                            needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        _parse(body)
