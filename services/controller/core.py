"""The controller's sans-IO core: windows → decisions → plans → epoch protocol.

One object the adapter (live) and the simulator drive the same way:

* ``assigned(now, predicted_s, input_len, degree)`` for every placement the scheduler reports;
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

Rules: at most one plan is outstanding — from the moment a plan is returned until it is
started or discarded, and while any reconfiguration is in flight, windows are still closed
and reported but produce no new plan (the planner's streak stays reset). The composition the
planner judges is always the protocol's current one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from services.controller.lattice import Composition
from services.controller.lifecycle import EpochProtocol, IllegalTransition, StartResult
from services.controller.planner import ControllerConfig, Decision, Plan, Planner, TrafficEstimate
from services.controller.windows import DemandWindows, WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, WorkerId


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
        self.planner = Planner(profile, self.config)
        self.windows = DemandWindows(
            self.config.window_s, self.config.long_threshold_tokens, start_s
        )
        self.protocol = EpochProtocol(composition, epoch=epoch, acknowledged=acknowledged)
        self._closed: list[WindowSummary] = []
        self._pending: Plan | None = None
        self.decisions: list[Decision] = []  # every decision so far (reports, plots)

    @property
    def pending_plan(self) -> Plan | None:
        """A plan returned by :meth:`tick` and not yet started or discarded."""
        return self._pending

    def assigned(
        self, now: float, predicted_s: float, input_len: int, degree: int | None = None
    ) -> None:
        """The scheduler placed a request with predicted service ``predicted_s`` seconds."""
        self._closed.extend(self.windows.record(now, predicted_s, input_len, degree))

    def tick(
        self,
        now: float,
        *,
        drain_s: Mapping[WorkerId, float] | None = None,
        traffic: TrafficEstimate | None = None,
    ) -> list[Decision]:
        """Close the windows that ended by ``now`` and decide each, oldest first."""
        closed = self._closed + self.windows.advance(now)
        self._closed = []
        out: list[Decision] = []
        for win in closed:
            busy = self._pending is not None or bool(self.protocol.in_progress())
            dec = self.planner.observe(
                win,
                self.protocol.composition,
                drain_s=drain_s,
                traffic=traffic,
                unavailable=self.protocol.unavailable(),
                reconfiguring=busy,
            )
            if dec.plan is not None:
                self._pending = dec.plan
            out.append(dec)
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
        """Start the pending ``plan`` (see :meth:`EpochProtocol.start`)."""
        if plan != self._pending:
            raise IllegalTransition("only the pending plan returned by tick() can be started")
        res = self.protocol.start(plan, now, queued=queued, in_flight=in_flight)
        self._pending = None
        return res

    def discard_plan(self) -> None:
        """Drop the pending plan (e.g. the adapter lost the epoch compare-and-set)."""
        if self._pending is None:
            raise InvalidInput("no pending plan to discard")
        self._pending = None
