"""Entry point of the scheduler process: ``python -m services.scheduler [flags]``.

Configuration is :class:`~services.scheduler.service.SchedulerSettings`: environment variables
``VTM_*`` (``__`` for nesting, e.g. ``VTM_TELEMETRY__EXPORTER=otlp``), then these flags, which
win over the environment:

  --nats-url URL          VTM_NATS_URL          NATS server(s), comma-separated
  --prefix P              VTM_SUBJECT_PREFIX    subject / stream / bucket prefix
  --policy NAME           VTM_POLICY            registered policy (vertumnus, vllm, sglang, ...)
  --policy-params JSON    VTM_POLICY_PARAMS     policy keyword parameters, a JSON object
  --profile PATH          VTM_PROFILE_PATH      fitted cost-model profile (JSON)
  --instance-id ID        VTM_INSTANCE_ID       this replica's id (reporter id on the wire)
  --seed N                VTM_SEED              policy random seed

Every other setting (ack_wait_s, max_deliver, window_s, lease_s, ...) is documented on the
settings class and set through its ``VTM_`` variable. NOTE: pydantic-settings merges a
``--policy-params`` object *over* ``VTM_POLICY_PARAMS`` (keys of both apply; the flag wins
per key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from typing import Any

from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.logging import configure_logging
from shared.telemetry import setup_tracing, shutdown_tracing

_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--nats-url", "nats_url", str),
    ("--prefix", "subject_prefix", str),
    ("--policy", "policy", str),
    ("--policy-params", "policy_params", json.loads),  # type: ignore[arg-type]
    ("--profile", "profile_path", str),
    ("--instance-id", "instance_id", str),
    ("--seed", "seed", int),
)


def parse_settings(argv: Sequence[str] | None = None) -> SchedulerSettings:
    """Settings from the environment, overridden by the flags given."""
    parser = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="vertumnus scheduler: places intake requests on prefill workers.",
    )
    for flag, dest, typ in _FLAGS:
        parser.add_argument(flag, dest=dest, type=typ, default=None)
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    return SchedulerSettings(**overrides)


async def serve(settings: SchedulerSettings) -> None:
    """Run one scheduler replica until SIGINT/SIGTERM."""
    await SchedulerService(settings).run()


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(settings.log.format, settings.log.level, service=settings.service_name)
    setup_tracing(settings.service_name, settings.telemetry)
    try:
        asyncio.run(serve(settings))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
