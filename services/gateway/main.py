"""Entry point of the gateway process: ``python -m services.gateway [flags]``.

Configuration is :class:`~services.gateway.settings.GatewaySettings`: environment variables
``VTM_*`` (``__`` for nesting, e.g. ``VTM_TELEMETRY__EXPORTER=otlp``), then these flags, which
win over the environment:

  --nats-url URL          VTM_NATS_URL            NATS server(s), comma-separated
  --prefix P              VTM_SUBJECT_PREFIX      subject / stream / bucket prefix
  --host H                VTM_HTTP_HOST           HTTP listen address (default 127.0.0.1)
  --port N                VTM_HTTP_PORT           HTTP port (default 8080; 0 = any free port;
                                                  off = no HTTP server, the NATS subject only)
  --block-size B          VTM_BLOCK_SIZE          cache block size in tokens (default 512)
  --max-prompt-tokens N   VTM_MAX_PROMPT_TOKENS   longest prompt accepted (413 above)
  --max-seq-len N         VTM_MAX_SEQ_LEN         longest prompt + max_tokens (422 above)
  --tokenizer PATH        VTM_TOKENIZER_PATH      tokenizer.json for text prompts
  --instance-id ID        VTM_INSTANCE_ID         this replica's id

Every other setting (max_body_bytes, result_timeout_s, forward_tokens, ...) is documented on
the settings class and set through its ``VTM_`` variable.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from services.gateway.adapter import GatewayService, InvalidConfig
from services.gateway.settings import GatewaySettings
from shared.files import path_kind
from shared.ids import InvalidInput
from shared.servicemain import SettingProblem, parse_flags, run_service

_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--nats-url", "nats_url", str),
    ("--prefix", "subject_prefix", str),
    ("--host", "http_host", str),
    ("--port", "http_port", str),  # a number, or 'off' (the settings parse it)
    ("--block-size", "block_size", int),
    ("--max-prompt-tokens", "max_prompt_tokens", int),
    ("--max-seq-len", "max_seq_len", int),
    ("--tokenizer", "tokenizer_path", str),
    ("--instance-id", "instance_id", str),
)


def check_tokenizer_path(settings: GatewaySettings) -> None:
    """``tokenizer_path``, when set, is a readable regular file; raises
    :class:`SettingProblem` naming the path. (Its content is checked when the gateway loads
    it, still before it connects: :func:`serve`.)"""
    path = settings.tokenizer_path
    if path is None:
        return
    try:
        kind = path_kind(path, "tokenizer")
    except InvalidInput as exc:  # a parent directory it may not search
        raise SettingProblem("tokenizer_path", str(exc)) from None
    if kind == "missing":
        raise SettingProblem("tokenizer_path", f"{str(path)!r}: no such file")
    if kind != "file":
        raise SettingProblem("tokenizer_path", f"{str(path)!r}: not a regular file (a "
                             "tokenizer.json)")
    if not os.access(path, os.R_OK):
        raise SettingProblem("tokenizer_path", f"{str(path)!r}: file is not readable")


def parse_settings(argv: Sequence[str] | None = None) -> GatewaySettings:
    """Settings from the environment, overridden by the flags given in ``argv`` (None:
    ``sys.argv[1:]``), checked before anything connects: ``--help`` exits 0, an unknown
    argument or a bad setting (a NATS URL without scheme, a tokenizer file that is not
    there) exits 2 naming it."""
    return parse_flags(
        GatewaySettings,
        _FLAGS,
        argv,
        prog="python -m services.gateway",
        description="vertumnus gateway: HTTP and NATS completions onto the durable intake.",
        checks=(check_tokenizer_path,),
    )


async def serve(settings: GatewaySettings) -> None:
    """Run one gateway until SIGINT/SIGTERM. Settings the gateway cannot start with (a
    tokenizer file it cannot load, the tokenizers package missing) raise InvalidInput before
    it connects, which :func:`run_service` reports in one line (exit 2)."""
    try:
        gateway = GatewayService(settings)
    except InvalidConfig as exc:
        raise InvalidInput(str(exc)) from None
    await gateway.run()


def main(argv: Sequence[str] | None = None) -> None:
    run_service(parse_settings(argv), serve)


if __name__ == "__main__":
    main()
