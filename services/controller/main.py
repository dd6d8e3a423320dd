"""Entry point of the controller process: ``python -m services.controller [flags]``.

Configuration is :class:`~services.controller.service.ControllerSettings`: environment
variables ``VTM_*`` (``__`` for nesting, e.g. ``VTM_TELEMETRY__EXPORTER=otlp``), then these
flags, which win over the environment:

  --nats-url URL            VTM_NATS_URL               NATS server(s), comma-separated
  --prefix P                VTM_SUBJECT_PREFIX         subject / stream / bucket prefix
  --gpus N                  VTM_NUM_GPUS               GPUs in the prefill pool
  --degrees 2,4             VTM_DEGREES                supported CP degrees (JSON list in env)
  --initial COMPOSITION     VTM_INITIAL_COMPOSITION    e.g. 2CP4, used only if no record exists
  --profile PATH            VTM_PROFILE_PATH           fitted profile with κ_C (JSON)
  --window-s H              VTM_WINDOW_S               observation window (= scheduler's)
  --instance-id ID          VTM_INSTANCE_ID            this replica's id

  VTM_CONTROLLER_FILE: a controller file (``vertumnus controller-config`` prints the
  calibrated one; the file ``vertumnus simulate --controller`` evaluates): its thresholds
  replace the calibrated ones, and each threshold's own variable wins over it.

Every other setting (upper, lower, merge_headroom, persistence, max_ops, split_target,
momentum, merge_speedup, preference_shift, kappa_scale, tick_s, report_grace_s,
reconfig_drain_timeout_s, kappa, demand_input, follow_record, ...) is documented on the
settings class and set through its ``VTM_`` variable, e.g. ``VTM_KAPPA='{"2": 8, "4": 14}'``
or ``VTM_MAX_OPS=1`` (the paper's one operation at a time). The planner's thresholds and
``kappa_scale`` default to the calibrated values of ``services/calibration.py`` (the
simulator's), not to literals of their own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from services.controller.lattice import Composition
from services.controller.service import ControllerService, ControllerSettings
from shared.ids import InvalidInput
from shared.servicemain import SettingProblem, degree_list, parse_flags, run_service

_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("--nats-url", "nats_url", str),
    ("--prefix", "subject_prefix", str),
    ("--gpus", "num_gpus", int),
    ("--degrees", "degrees", degree_list),
    ("--initial", "initial_composition", str),
    ("--profile", "profile_path", str),
    ("--window-s", "window_s", float),
    ("--instance-id", "instance_id", str),
)


def check_initial_composition(settings: ControllerSettings) -> None:
    """``initial_composition``, when set, parses into a composition of the configured pool
    (``Composition.parse`` on the settings' lattice): otherwise the controller would find out
    only at its first bootstrap, once connected, and start without a record. Raises
    :class:`SettingProblem`. A lattice the GPUs and degrees cannot make is left to the
    service's start, which reports it ("cannot start")."""
    if not settings.initial_composition:
        return
    try:
        lattice = settings.lattice()
    except InvalidInput:
        return
    try:
        Composition.parse(lattice, settings.initial_composition)
    except InvalidInput as exc:
        raise SettingProblem("initial_composition", str(exc)) from None


def check_controller_config(settings: ControllerSettings) -> None:
    """The planner's thresholds make a valid setting: the ``controller_file`` reads and checks
    (named with its key), and the thresholds fit together (0 < lower < upper, split_target <=
    upper, ...) with the variables set over it; otherwise the controller would refuse them
    only at its start. Raises :class:`SettingProblem` naming the file's variable and the
    threshold at fault."""
    try:
        settings.controller_config()
    except InvalidInput as exc:
        m = re.search(r"ControllerConfig\.(\w+)", str(exc))
        fields = [f for f in ("controller_file",) if settings.controller_file is not None]
        if m and m.group(1) in ControllerSettings.model_fields:
            fields.append(m.group(1))
        raise SettingProblem(fields or ["upper", "lower"], str(exc)) from None


def parse_settings(argv: Sequence[str] | None = None) -> ControllerSettings:
    """Settings from the environment, overridden by the flags given in ``argv`` (None:
    ``sys.argv[1:]``), checked before anything connects: ``--help`` exits 0, an unknown
    argument or a bad setting (a NATS URL without scheme, an initial composition that does
    not parse, a controller file or thresholds the planner refuses) exits 2 naming it."""
    return parse_flags(
        ControllerSettings,
        _FLAGS,
        argv,
        prog="python -m services.controller",
        description="vertumnus controller: splits and merges CP workers from window demand.",
        checks=(check_initial_composition, check_controller_config),
    )


async def serve(settings: ControllerSettings) -> None:
    """Run one controller until SIGINT/SIGTERM."""
    await ControllerService(settings).run()


def main(argv: Sequence[str] | None = None) -> None:
    run_service(parse_settings(argv), serve)


if __name__ == "__main__":
    main()
