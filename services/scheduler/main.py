"""Entry point of the scheduler process: ``python -m services.scheduler [flags]``.

Configuration is :class:`~services.scheduler.service.SchedulerSettings`: environment variables
``VTM_*`` (``__`` for nesting, e.g. ``VTM_TELEMETRY__EXPORTER=otlp``), then these flags, which
win over the environment:

  --nats-url URL          VTM_NATS_URL          NATS server(s), comma-separated
  --prefix P              VTM_SUBJECT_PREFIX    subject / stream / bucket prefix
  --policy NAME           VTM_POLICY            registered policy (vertumnus, vllm, sglang, ...)
  --policy-params JSON    VTM_POLICY_PARAMS     policy keyword parameters, a JSON object
  --profile PATH          VTM_PROFILE_PATH      fitted cost-model profile (JSON)
  --instance-id ID        VTM_INSTANCE_ID       this replica's id (reporter id on the wire;
                                                @hostname: the host's name, kept by a container)
  --seed N                VTM_SEED              policy random seed
  --degrees 2,4           VTM_DEGREES           the pool's CP degrees (JSON list in env)

Every other setting (ack_wait_s, max_deliver, window_s, lease_s, ...) is documented on the
settings class and set through its ``VTM_`` variable. NOTE: pydantic-settings merges a
``--policy-params`` object *over* ``VTM_POLICY_PARAMS`` (keys of both apply; the flag wins
per key).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.servicemain import degree_list, parse_flags, run_service, seed_check

_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("--nats-url", "nats_url", str),
    ("--prefix", "subject_prefix", str),
    ("--policy", "policy", str),
    ("--policy-params", "policy_params", json.loads),  # type: ignore[arg-type]
    ("--profile", "profile_path", str),
    ("--instance-id", "instance_id", str),
    ("--seed", "seed", int),
    ("--degrees", "degrees", degree_list),
)


def parse_settings(argv: Sequence[str] | None = None) -> SchedulerSettings:
    """Settings from the environment, overridden by the flags given in ``argv`` (None:
    ``sys.argv[1:]``), checked before anything connects: ``--help`` exits 0, an unknown
    argument or a bad setting (a NATS URL without scheme, a seed < 0) exits 2 naming it."""
    return parse_flags(
        SchedulerSettings,
        _FLAGS,
        argv,
        prog="python -m services.scheduler",
        description="vertumnus scheduler: places intake requests on prefill workers.",
        checks=(seed_check("seed"),),
    )


async def serve(settings: SchedulerSettings) -> None:
    """Run one scheduler replica until SIGINT/SIGTERM."""
    await SchedulerService(settings).run()


def main(argv: Sequence[str] | None = None) -> None:
    run_service(parse_settings(argv), serve)


if __name__ == "__main__":
    main()
