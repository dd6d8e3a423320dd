"""The controller's sans-IO core: windows → decisions → plans → epoch protocol.

One object the adapter (live) and the simulator drive the same way:

* ``assigned(now, predicted_s, input_len, degree, cached_tokens)`` for every placement the
  scheduler reports (with ``ControllerConfig.merge_speedup`` set, the core works out each
  request's preferred degree from the profile, §6.1 rule 1 — :func:`request_preferred_degree`
  — for the planner's merge gate; a caller that already knows it, e.g. from a scheduler's
  window report, passes ``preferred=`` instead);
* ``tick(now, drain_s=..., traffic=...)`` on a timer (any period ≤ H): closes the windows that
  ended, decides each (§6.2) and returns the :class:`Decision` list; a decision may carry a
  :class:`Plan`;
* ``start(plan, now, queued=..., in_flight=...)`` to carry a plan out (the adapter gathers the
  sources' queues first); then the protocol events ``finished``, ``switch_started``, ``ack``,
  ``exposed``, ``fail``, ``recover`` on :attr:`protocol`.

Order with the outside world: call ``protocol.switch_started`` first and then publish the
control record it returns (compare-and-set on the epoch key); a controller whose
compare-and-set fails has lost leadership and must rebuild from the stored record rather
than continue. Ranks can only acknowledge an epoch they have read, so their acks always
arrive after the commit.

Rules: at most one plan is outstanding — from the moment a plan is returned until every one
of its operations is started or the plan is discarded, and while any reconfiguration is in
flight, windows are still closed and reported but produce no new plan (the planner's streak
stays reset). A plan may hold several disjoint operations (``ControllerConfig.max_ops``); the
adapter starts each (:attr:`pending_plans`), in any order — they are disjoint, so each is
adjacent to the composition whatever the others did. The composition the planner judges is
always the protocol's current one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import Enum
from typing import Final, Literal

from services.controller.composition import capacity
from services.controller.lattice import Composition
from services.controller.lifecycle import EpochProtocol, IllegalTransition, StartResult
from services.controller.planner import ControllerConfig, Decision, Plan, Planner, TrafficEstimate
from services.controller.windows import DemandWindows, WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, WorkerId


class FromProfile(Enum):
    """Type of :data:`FROM_PROFILE` (a one-member enum, so type checkers see a literal)."""

    TOKEN = "from-profile"


HELD_REASON: Final[str] = "composition held: a fixed deployment"
"""The reason of every decision of ``ControllerCore.tick(hold=True)``."""

FROM_PROFILE: Final = FromProfile.TOKEN
"""``ControllerCore.assigned(preferred=FROM_PROFILE)``: judge the preferred degree from the
request's lengths (the default)."""


def request_preferred_degree(
    profile: Profile,
    degrees: Sequence[int],
    speedup: float,
    input_len: int,
    cached_tokens: int,
) -> int:
    """§6.1 rule 1 for one request: from the smallest of ``degrees`` (sorted ascending), climb
    to 2C while Ê_C(R, P) ≥ ``speedup`` · Ê_2C(R, P) and 2C is one of ``degrees``.

    P = min(``cached_tokens``, L − 1), R = L − P (a request recomputes at least one token).
    The one definition the simulator (through :meth:`ControllerCore.assigned`), the live
    controller and the scheduler's window reports share. Pure; inputs are trusted (callers
    validate): ``input_len`` ≥ 1, ``cached_tokens`` ≥ 0, ``degrees`` sorted and non-empty.
    """
    p = min(cached_tokens, input_len - 1)
    r = input_len - p
    c = degrees[0]
    while 2 * c in degrees and profile.predict_fast(r, p, c) >= speedup * profile.predict_fast(
        r, p, 2 * c
    ):
        c *= 2
    return c


class ControllerCore:
    """Windows, planner and epoch protocol wired together; see the module doc."""

    def __init__(
        self,
        composition: Composition,
        profile: Profile,
        config: ControllerConfig | None = None,
        *,
        start_s: float = 0.0,
        epoch: int = 0,
        acknowledged: bool = True,
    ) -> None:
        self.config = config if config is not None else ControllerConfig()
        # NOTE: κ must be per window of config.window_s as the adapter's clock measures it
        # (Profile.for_window): the simulator's windows are modelled seconds; a live
        # controller's are wall seconds of rank daemons that may run at a time scale.
        self.planner = Planner(profile, self.config)
        self.windows = DemandWindows(
            self.config.window_s, self.config.long_threshold_tokens, start_s
        )
        self.protocol = EpochProtocol(composition, epoch=epoch, acknowledged=acknowledged)
        self._degrees = composition.lattice.sorted_degrees
        self._closed: list[WindowSummary] = []
        self._pending: list[Plan] = []
        self._pending_started = False  # an operation of the outstanding plan has started
        self.decisions: list[Decision] = []  # every decision so far (reports, plots)

    @property
    def pending_plan(self) -> Plan | None:
        """The first operation of the plan returned by :meth:`tick` not yet started or
        discarded, or None."""
        return self._pending[0] if self._pending else None

    @property
    def pending_plans(self) -> tuple[Plan, ...]:
        """Every operation of the outstanding plan not yet started (empty: none)."""
        return tuple(self._pending)

    def assigned(
        self,
        now: float,
        predicted_s: float,
        input_len: int,
        degree: int | None = None,
        cached_tokens: int = 0,
        *,
        preferred: int | None | Literal[FromProfile.TOKEN] = FROM_PROFILE,
    ) -> None:
        """The scheduler placed a request with predicted service ``predicted_s`` seconds;
        ``cached_tokens`` of its ``input_len`` are reused on the chosen worker.

        ``preferred``: the request's preferred degree for the merge gate. ``FROM_PROFILE``
        (default): worked out here (:func:`request_preferred_degree`) when ``merge_speedup``
        is set; an int: as given (checked by the windows); None: unknown, the request adds
        nothing to the demand-by-preferred-degree breakdown."""
        if cached_tokens.__class__ is not int or cached_tokens < 0:  # exact int first: speed
            if isinstance(cached_tokens, bool) or not isinstance(cached_tokens, int):
                raise InvalidInput(
                    f"cached_tokens must be an integer >= 0, got {cached_tokens!r}")
            if cached_tokens < 0:
                raise InvalidInput(
                    f"cached_tokens must be an integer >= 0, got {cached_tokens!r}")
        if preferred is FROM_PROFILE:
            preferred = None
            threshold = self.config.merge_speedup
            if threshold is not None and isinstance(input_len, int) and input_len >= 1:
                preferred = request_preferred_degree(
                    self.planner.profile, self._degrees, threshold, input_len, cached_tokens
                )
        self._closed.extend(self.windows.record(now, predicted_s, input_len, degree, preferred))

    def tick(
        self,
        now: float,
        *,
        drain_s: Mapping[WorkerId, float] | None = None,
        traffic: TrafficEstimate | None = None,
        hold: bool = False,
    ) -> list[Decision]:
        """Close the windows that ended by ``now`` and decide each, oldest first.

        ``hold``: the composition is fixed (a baseline's deployment, the simulator's
        non-adaptive runs): each window is still closed and reported with its D(k) and the
        pool's capacity, but the planner is not consulted and nothing is planned.

        A window the planner refuses (a bad ``drain_s`` or ``traffic`` estimate raises
        :class:`InvalidInput`, the planner unchanged) is not lost: it and the windows after it
        wait for the next tick. Windows decided before it are in :attr:`decisions` (and a plan
        of theirs in :attr:`pending_plans`)."""
        closed = self._closed + self.windows.advance(now)
        self._closed = []
        out: list[Decision] = []
        try:
            for win in closed:
                if hold:
                    comp = self.protocol.composition
                    unavailable = frozenset(self.protocol.unavailable())
                    cap = capacity(comp, self.planner.profile, unavailable)
                    out.append(Decision(win, cap, None, None, None, 0, None, HELD_REASON,
                                        comp.describe()))
                    continue
                busy = bool(self._pending) or bool(self.protocol.in_progress())
                dec = self.planner.observe(
                    win,
                    self.protocol.composition,
                    drain_s=drain_s,
                    traffic=traffic,
                    unavailable=self.protocol.unavailable(),
                    reconfiguring=busy,
                )
                if dec.plans:
                    self._pending, self._pending_started = list(dec.plans), False
                out.append(dec)
        finally:
            self._closed = closed[len(out) :]
            self.decisions.extend(out)
        return out

    def start(
        self,
        plan: Plan,
        now: float,
        *,
        queued: Mapping[WorkerId, Sequence[RequestId]] | None = None,
        in_flight: Mapping[WorkerId, Collection[RequestId]] | None = None,
    ) -> StartResult:
        """Start one pending operation ``plan`` (see :meth:`EpochProtocol.start`)."""
        if plan not in self._pending:
            raise IllegalTransition("only a pending plan returned by tick() can be started")
        res = self.protocol.start(plan, now, queued=queued, in_flight=in_flight)
        self._pending.remove(plan)
        self._pending_started = True
        return res

    def discard_plan(self) -> None:
        """Drop every pending operation (e.g. the adapter lost the epoch compare-and-set). If
        none of the plan's operations started, the planner takes back the momentum the plan
        set (:meth:`Planner.plan_not_carried_out`)."""
        if not self._pending:
            raise InvalidInput("no pending plan to discard")
        self._pending = []
        if not self._pending_started:
            self.planner.plan_not_carried_out()
