"""Entry point of the cache manager: ``python -m services.cachemgr [flags]``.

Configuration is :class:`~services.cachemgr.service.CacheMgrSettings`: environment variables
``VTM_*`` (``__`` for nesting), then these flags, which win over the environment:

  --nats-url URL          VTM_NATS_URL           NATS server(s), comma-separated
  --prefix P              VTM_SUBJECT_PREFIX     subject / stream / bucket prefix
  --degrees 2,4           VTM_DEGREES            supported CP degrees (JSON list in env)
  --profile PATH          VTM_PROFILE_PATH       fitted cost-model profile (JSON)
  --scan-interval-s H     VTM_SCAN_INTERVAL_S    seconds between scans (default 20)
  --block-size B          VTM_BLOCK_SIZE         tokens per cache block

Every other setting (theta_inter, theta_intra, theta_reclaim, decay, max_actions_per_list,
gc_threshold, command_timeout_s, ...) is documented on the settings class and set through its
``VTM_`` variable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.cachemgr.service import CacheMgrService, CacheMgrSettings
from shared.servicemain import degree_list, parse_flags, run_service

_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("--nats-url", "nats_url", str),
    ("--prefix", "subject_prefix", str),
    ("--degrees", "degrees", degree_list),
    ("--profile", "profile_path", str),
    ("--scan-interval-s", "scan_interval_s", float),
    ("--block-size", "block_size", int),
)


def parse_settings(argv: Sequence[str] | None = None) -> CacheMgrSettings:
    """Settings from the environment, overridden by the flags given in ``argv`` (None:
    ``sys.argv[1:]``), checked before anything connects: ``--help`` exits 0, an unknown
    argument or a bad setting (e.g. a NATS URL without scheme) exits 2 naming it."""
    return parse_flags(
        CacheMgrSettings,
        _FLAGS,
        argv,
        prog="python -m services.cachemgr",
        description="vertumnus cache manager: global prefix trie, replication, reclamation.",
    )


async def serve(settings: CacheMgrSettings) -> None:
    """Run the cache manager until SIGINT/SIGTERM."""
    await CacheMgrService(settings).run()


def main(argv: Sequence[str] | None = None) -> None:
    run_service(parse_settings(argv), serve)


if __name__ == "__main__":
    main()
