"""Split-and-merge decisions per observation window (§6.2).

Rules, evaluated at the close of every window k with demand D = D(k) and the current
composition's capacity K = Σ κ_{C_w} over its available workers (a failed worker serves
nothing, so it counts nothing):

1. **Capacity signal.** D > u·K → SPLIT (more concurrency); D < l·K → MERGE (more
   parallelism per request).
2. **Long-fraction signal**, only when the demand is *stable*: no capacity signal and
   |D − D_ref| ≤ ``demand_stability``·max(D_ref, ε). Then f − f_ref ≥ δ → MERGE and
   f − f_ref ≤ −δ → SPLIT, where f is the window's long-request fraction and (D_ref, f_ref)
   the *reference*: a non-empty window with no capacity signal, taken with the current
   composition and re-based whenever demand moves outside the stability band (so the mix is
   judged at the current demand level); it and the streak are dropped on every composition
   change. Windows
   without requests carry no fraction signal.
3. **Precedence.** When both signals exist and disagree, capacity wins (the fraction signal
   is recorded as overridden).
4. **Persistence.** An operation starts only after the same direction has been signalled
   for ``persistence`` consecutive windows; any other outcome resets the streak.
   **Momentum** (our addition): once an operation in a direction has been carried out, the
   next window that still signals that direction continues at once — the signal already
   persisted and the composition is still on its way (a {2,4} pool over 40 GPUs is ten steps
   from all-CP2 to all-CP4; re-proving persistence after every step would take minutes). A
   window without that signal ends the momentum.
5. **Admission.** A merge is admitted only if the adjacent composition keeps sufficient
   capacity: D̂ ≤ ``merge_headroom``·K', where D̂ is the largest demand of the streak's last
   ``persistence`` windows (our addition: window demand varies by ±25% on these traces, and
   a merge sized to the one quiet window that completed a streak is undone by the next busy
   one) (``merge_headroom`` < u gives hysteresis, so the
   merged composition does not split again at once). Our addition, symmetric to it: a split
   driven by the long-fraction signal alone is admitted only if D ≥ l·K' (it would not
   leave the pool under-loaded, which would trigger a merge right back).
6. **Choice.** Among admitted adjacent operations in the chosen direction on workers that are
   all active: (with ``newest_first``, our addition) first the operation whose youngest
   source joined the composition last; then minimise the predicted drain interval (max over
   the sources of their outstanding in-flight predicted work — sources drain in parallel),
   then the expected reconciliation traffic (Σ over sources of their cached blocks: the
   prefix trie's count in the simulator, each worker's reported ``kv_cached_blocks`` live;
   unweighted, where §6.2 weights by recent access; or a callable over the whole
   operation), then the lowest first GPU (determinism). Newest first makes a split undo the
   latest merge (and a merge the latest split) rather than break up a worker whose cache has
   served its degree longer: on the reconfiguration preset the long phase's merged worker is
   the one split when the short phase returns, and the workers that have held the long
   documents since the start keep them. It comes before the drain because the drain is
   bounded by one running request (queued ones are redirected) while a worker's cache is
   worth minutes: with the drain first, seed 3's S4 split took an original CP4 worker whose
   drain estimate was 0 and S5 lost 23% to 12CP2/4CP4 (newest first: +1.6%).
7. **One plan at a time.** While a reconfiguration is in flight no plan is made and the
   streak stays reset: signals measured against a composition that is changing are stale.
8. **Multi-operation plans** (our addition; ``max_ops`` > 1). A plan may hold several
   disjoint operations, chosen greedily on a *virtual* composition (each operation applied
   before the next is chosen; a worker that is a source or a target of an earlier operation
   of the plan takes no further part — it is draining or does not exist yet). The target is
   what the window's demand calls for under headroom rules: a capacity split continues
   while D > ``split_target``·K of the virtual composition (the pool lands inside the hold
   band with room to grow), a capacity merge continues while the next merge is still
   admitted (D̂ ≤ ``merge_headroom``·K'). A long-fraction move is one operation (the mix
   is re-judged against the new composition).
   Under constant demand this converges: no split follows a capacity merge (an admitted
   merge keeps D ≤ ``merge_headroom``·K' ≤ u·K'; a rule-12 long-share merge judged per
   degree, ``long_shift_by_degree``, may land at D ≈ 1.01-1.03·K' and be split back by
   capacity, its documented cost), each plan changes the worker count in one direction,
   and no merge follows a split as long as a split plan raises K by less than u/l (D > u·K
   before it and D < l·K after it cannot both hold) — true for every profile here (all
   smallest over all largest degree is ×1.3 for the calibrated κ, u/l = 2).
9. **Merge gate** (our addition; ``merge_speedup`` set). κ is profiled on one length mix; for
   short requests a CP-2C worker is barely faster than a CP-C one yet serves half as many
   at once, so κ over-rates it. When the window reports demand by preferred degree (§6.1
   rule 1 per request, with ``merge_speedup`` as its threshold), a merge into degree 2C is
   admitted only if the GPUs at degrees ≥ 2C afterwards do not exceed the share of demand
   preferring ≥ 2C, times G, rounded up to whole degree-2C workers. The share is taken over
   the last ``persistence`` windows that had requests (an idle gap says nothing about the
   mix, and merging a short-request pool up during one left it slow when load returned);
   before any such window, nothing is gated (e.g. an adapter that reports no breakdown).
10. **Preference shift** (our addition; ``preference_shift`` set). It reads the same
   demand-by-preferred-degree breakdown as rule 9 (the core computes it only with
   ``merge_speedup`` set; a window without it signals nothing). The
   §6.2 mix signal as a multi-operation move: a window with no capacity signal whose share of
   demand preferring degree ≥ 2C exceeds the share of the pool's GPUs at ≥ 2C by at least
   ``preference_shift`` signals MERGE (it takes the fraction signal's place when rule 2 gives
   none). Rule 2 waits for demand to be stable, but the shift to long requests comes with a
   drop in rate (the reconfiguration preset's S2→S3: the long share goes 1% → 30% while the
   rate falls to a fifth), so the reference keeps being re-based and the mix is never
   judged; rule 1 then waits for D < l·K, eight to ten windows later. The move persists like
   any other signal and, like rule 2's, is one merge (then re-judged against the new
   composition), within rule 9's gate, admitted while D̂ ≤ ``preference_headroom``·K'
   (default ``upper``: the merged pool still holds the recent peak; ``merge_headroom``'s
   margin is for merges driven by spare capacity, which these are not). A margin below
   ``upper`` keeps the rule from merging a pool that runs near capacity, where the next busy
   window splits it again with long drains (calibration, CONTROLLER). A plan merging as far
   as the gate allows was measured and dropped: every merge costs the merged workers' cached
   prefixes at the moment the long requests arrive (calibration, CONTROLLER). No preference
   split is made: one was tried (a "mix split" back to the bound) and cost the conversation
   trace.

11. **Peak memory for preference-shift merges** (our addition; ``merge_memory`` set). A rule-10
   merge is admitted against the largest demand of the last ``merge_memory`` windows (not only
   the streak's): demand near capacity varies by ±20% from window to window, and a merge
   admitted in two quieter windows was split again by the next busy one (conversation ×4:
   five operations alternating 20CP2 ↔ 18CP2/1CP4). Capacity merges keep rule 5 (their
   headroom already leaves a margin), and so do rule-12 merges.
12. **Long-share shift** (our addition; ``long_shift`` set). A window with no capacity signal
   (and no rule-2/10 signal) whose long-request fraction exceeds the request-weighted long
   fraction of the earlier busy windows *on the same composition* by at least ``long_shift``
   signals MERGE; at least ``persistence`` such earlier windows are needed. It is rule 2
   without the stable-demand condition and against a memory that a composition change
   resets: the shift to long requests comes with a drop in demand (the reconfiguration
   preset's S2→S3: long share 0.5% → 7-10% while D falls to 60%), so rule 2's reference is
   re-based and never judged, and rule 10's per-request preference sees the long requests as
   CP2-preferring once their documents are cached. Like rule 10 it is one merge, admitted
   while D̂ ≤ ``upper``·K', and not gated by rule 9 (the long share is the signal). Resetting
   the memory on every composition change bounds it to one merge per shift. The signal is
   acted on after ``long_shift_persistence`` windows when that is set (else ``persistence``):
   it is already judged against at least ``persistence`` earlier windows, and each window it
   waits, the long requests queue on the larger-degree workers there are.
   With ``long_shift_by_degree`` a rule-12 merge that the aggregate bound refuses is
   admitted when it lowers the pool's worst per-degree load: max over degrees C of
   D_C / K_C, with D_C the window's demand placed at degree C (``demand_by_degree``) and K_C
   the κ of the available degree-C workers (a degree with demand and no workers counts as
   infinitely loaded). Why: aggregate D against aggregate K says nothing about where the
   demand lies. At the preset's S2→S3 the first long-phase windows still carry the short
   phase's follow-up turns, so D stays just above K' (1.01-1.03·K' on seeds 60 and 119)
   while the demand placed on the larger workers is 1.44-1.75× their κ and the smaller ones
   carry 0.78-0.87 of theirs; the long requests then queue 7-12 s on the larger workers and
   the phase is lost in its first minute. The merge moves capacity to the degree whose demand
   exceeds it. It is judged with the window's own split of demand, as if every request
   stayed at the degree it was placed at (an estimate: a request the new worker draws from
   the smaller degree frees more time there than it adds at the larger one).
13. **Floor of larger-degree workers** (our addition; ``large_floor`` set). A split never takes
   the number of workers at degree ≥ 2C from at least ``large_floor`` to fewer, unless the
   pool is backlogged (rule 14). Below the floor it does not act (a lone CP4 worker is worse
   than none: the long requests' cached documents concentrate on it and the scheduler queues
   them there). Why: κ judges a short-request burst over capacity that the pool serves well
   (the reconfiguration preset's S2 at D/K 1.4 with 0.2-0.4 s queues); splitting the last
   large workers for it costs the next long phase its cached documents (fixed pools over all
   five phases, seed 0, S3/S5 mean TTFT: 20CP2 0.52/0.52 s, 18CP2/1CP4 0.63/0.58,
   16CP2/2CP4 0.46/0.46, 14CP2/3CP4 0.44/0.44, 12CP2/4CP4 0.45/0.43).
14. **Backlog** (our addition; ``backlog_s`` set). The pool is backlogged when the median
   available worker's outstanding work (``drain_s``) is at least ``backlog_s``. Then no merge
   is made (D counts arrivals, so once arrivals stop D falls to 0 while the queues are still
   long: conversation ×6 merged 20CP2 → 4CP2/8CP4 over minutes of queued work), and rule 13
   yields (a pool that really cannot keep up splits as far as the demand calls for). The
   median, because one long request queued on one worker says nothing about the pool.
   ``backlog_s`` must be well above the transient queues of a burst: at 1 s the floor gave
   way to a 1.1-1.2 s median in the middle of the preset's S2/S4 (seeds 3, 4), and the three
   splits at once, into the start of the long phase, cost S3 +100% / S4 +76%.

15. **Long-share drop** (our addition; ``long_drop`` set). Rule 12 the other way, as §6.2
   has it ("a decrease favors splitting"). A window signals SPLIT when its long-request
   fraction f is below the request-weighted fraction f_mem of the earlier busy windows on
   the same composition by at least ``long_drop``, and
   (a) the fall is at least ``long_drop_z`` binomial standard errors, √(f_mem·(1 − f_mem)/n)
       at the window's n requests (if set): a window of a hundred-odd requests falls 0.04
       below a steady 7% by chance every few dozen windows (the conversation trace at
       ×2-×2.5: 1.7-3.0 standard errors, a split and the rule-12 merge back in every run),
       while the preset's S3→S4 falls by 8.5-11;
   (b) D ≥ ``long_drop_demand``·K (if set): far below the split threshold short requests
       hardly queue on the larger workers, and the split costs the prefixes its worker held
       (the built-in workload at ×1.5: a real fall, 19% → 0.3%, at D = 0.56·K; mean +4.5%,
       P90 +8.7%);
   (c) no capacity, rule-2 or rule-10 signal is raised.
   It waits ``long_shift_persistence`` windows like rule 12 and is one split (then
   re-judged), admitted like any split without a capacity signal (rule 5: D ≥ l·K'
   afterwards) and within rule 13's floor. Why: the shift from long to short requests comes
   with a rise in rate that builds up over a few windows as the short sessions' follow-up
   turns arrive. In the reconfiguration preset's S3→S4 (long share 11-17% → 0.1-1.9%) D
   stayed at 0.94-0.98·u·K in S4's first windows on 11 of 135 seeds, so rule 1 split only in
   the fourth; rule 2's reference is re-based as demand rises and never judges the mix.

The planner is a pure core: values in (window summary, composition, per-worker estimates),
a :class:`Decision` out; it keeps the streak, the reference and the short histories of rules
6, 9-13 and 15 (when each worker appeared, demand by preferred degree, demand, long counts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from services.controller.composition import capacity
from services.controller.lattice import Composition, LatticeOp, OpKind
from services.controller.windows import (
    DEFAULT_LONG_THRESHOLD_TOKENS,
    DEFAULT_WINDOW_S,
    WindowSummary,
)
from shared.costmodel import Profile
from shared.ids import InvalidInput, WorkerId
from shared.worker import GpuGroup

_EPS: Final[float] = 1e-9

MIN_WINDOW_S: Final[float] = 0.01
"""The shortest observation window H (s) a ControllerConfig takes (the live tests run 0.2 s;
`vertumnus up` at its smallest time scale 0.4 s)."""


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Thresholds of the reconfiguration controller.

    The defaults are provisional (chosen by reasoning, not yet calibrated on the traces):

    * ``upper`` 0.9 — split once a window's demand exceeds 90% of the profiled capacity;
      κ is already an SLO-preserving load, so a small margin below it.
    * ``lower`` 0.5 — merge once demand is below half the capacity: a merge of two degree-C
      workers loses ~(2κ_C − κ_2C) of capacity, and half-load leaves room for that.
    * ``merge_headroom`` 0.8 — a merge must leave D ≤ 0.8·K'; below ``upper`` for hysteresis.
    * ``long_fraction_delta`` 0.15 — absolute change of the long-request share vs the
      reference that counts as a mix shift.
    * ``demand_stability`` 0.3 — demand within ±30% of the reference counts as stable.
    * ``persistence`` 2 windows (40 s at H = 20 s) before an operation starts.
    * ``max_ops`` 1 — operations per plan (rule 8); 1 is the paper's one split or merge at a
      time, larger values let one window's plan reach the composition the demand calls for.
    * ``split_target`` 0.8 — a multi-operation split continues while D > 0.8·K (rule 8).
    * ``merge_speedup`` None — the merge gate (rule 9) is off unless set.
    * ``preference_shift`` None — rule 10 (the preference-shift merge) is off unless set.
    * ``preference_headroom`` None — a rule-10 merge is admitted up to ``upper``·K'.
    * ``momentum`` True — rule 4's momentum; a multi-operation plan already goes as far as the
      demand calls for, so with ``max_ops`` > 1 it can be turned off to re-prove persistence.
    * ``merge_memory`` None — rule 11 off (windows of demand a rule-10 merge must fit).
    * ``long_shift`` None — rule 12 off (rise of the long fraction that signals a merge).
    * ``long_shift_persistence`` None — a rule-12 or rule-15 signal waits ``persistence``
      windows.
    * ``long_drop`` None — rule 15 off (fall of the long fraction that signals a split).
    * ``long_drop_z`` None — rule 15 asks no significance of the fall (standard errors).
    * ``long_drop_demand`` None — rule 15 acts at any demand (else only while D ≥ this·K).
    * ``long_shift_by_degree`` False — a rule-12 merge is admitted by the aggregate bound only
      (else also when it lowers the worst per-degree load; rule 12).
    * ``large_floor`` None — rule 13 off (larger-degree workers a split keeps).
    * ``backlog_s`` None — rule 14 off (median outstanding work, s, that counts as backlog).
    * ``newest_first`` False — rule 6's newest-first key off.
    """

    window_s: float = DEFAULT_WINDOW_S
    long_threshold_tokens: int = DEFAULT_LONG_THRESHOLD_TOKENS
    upper: float = 0.9
    lower: float = 0.5
    merge_headroom: float = 0.8
    long_fraction_delta: float = 0.15
    demand_stability: float = 0.3
    persistence: int = 2
    max_ops: int = 1
    split_target: float = 0.8
    momentum: bool = True
    merge_speedup: float | None = None
    preference_shift: float | None = None
    preference_headroom: float | None = None
    merge_memory: int | None = None
    long_shift: float | None = None
    long_shift_persistence: int | None = None
    long_drop: float | None = None
    long_drop_z: float | None = None
    long_drop_demand: float | None = None
    long_shift_by_degree: bool = False
    large_floor: int | None = None
    backlog_s: float | None = None
    newest_first: bool = False

    def __post_init__(self) -> None:
        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidInput(f"ControllerConfig.{name} must be a finite number, got {v!r}")
            return float(v)

        # The checks below that many fields share; each raises naming the field, and
        # ``or_none`` admits None (the rule off) and says so in the message.
        def whole(name: str, *, or_none: bool = False) -> None:
            """An integer >= 1 (a bool is none)."""
            v = getattr(self, name)
            if or_none and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                what = "None or an integer" if or_none else "an integer"
                raise InvalidInput(f"ControllerConfig.{name} must be {what} >= 1, got {v!r}")

        def share(name: str, *, of_upper: bool = False, or_none: bool = False) -> None:
            """A finite number in (0, 1], or in (0, upper] with ``of_upper``."""
            v = getattr(self, name)
            if or_none and v is None:
                return
            top, top_text = (self.upper, f"upper={self.upper}") if of_upper else (1.0, "1")
            if not (0.0 < num(name) <= top):
                what = "None or in" if or_none else "in"
                raise InvalidInput(
                    f"ControllerConfig.{name} must be {what} (0, {top_text}], got {v}")

        # A floor, not only > 0: a window of 1e-6 s made a simulation build a window per
        # microsecond of the trace (memory without bound) and 1e-300 s overflowed.
        if num("window_s") < MIN_WINDOW_S:
            raise InvalidInput(f"ControllerConfig.window_s must be >= {MIN_WINDOW_S} s, got "
                               f"{self.window_s}")
        lt = self.long_threshold_tokens
        if isinstance(lt, bool) or not isinstance(lt, int) or lt < 1:
            raise InvalidInput(f"ControllerConfig.long_threshold_tokens must be >= 1, got {lt!r}")
        if not (0.0 < num("lower") < num("upper")):
            raise InvalidInput(
                f"ControllerConfig needs 0 < lower < upper, got lower={self.lower}, "
                f"upper={self.upper}"
            )
        share("merge_headroom", of_upper=True)
        share("long_fraction_delta")
        if num("demand_stability") < 0:
            raise InvalidInput(
                f"ControllerConfig.demand_stability must be >= 0, got {self.demand_stability}"
            )
        whole("persistence")
        whole("max_ops")
        if not isinstance(self.momentum, bool):
            raise InvalidInput(f"ControllerConfig.momentum must be a bool, got {self.momentum!r}")
        if self.merge_speedup is not None and not num("merge_speedup") >= 1.0:
            raise InvalidInput(
                f"ControllerConfig.merge_speedup must be None or >= 1, got {self.merge_speedup}"
            )
        share("preference_shift", or_none=True)
        share("preference_headroom", of_upper=True, or_none=True)
        whole("merge_memory", or_none=True)
        share("long_shift", or_none=True)
        whole("long_shift_persistence", or_none=True)
        share("long_drop", or_none=True)
        if self.long_drop_z is not None and not (0.0 < num("long_drop_z") < math.inf):
            raise InvalidInput(
                "ControllerConfig.long_drop_z must be None or a finite number > 0, "
                f"got {self.long_drop_z}")
        share("long_drop_demand", of_upper=True, or_none=True)
        whole("large_floor", or_none=True)
        if self.backlog_s is not None and not num("backlog_s") > 0:
            raise InvalidInput(
                f"ControllerConfig.backlog_s must be None or > 0, got {self.backlog_s}")
        if not isinstance(self.long_shift_by_degree, bool):
            raise InvalidInput("ControllerConfig.long_shift_by_degree must be a bool, "
                               f"got {self.long_shift_by_degree!r}")
        if not isinstance(self.newest_first, bool):
            raise InvalidInput(
                f"ControllerConfig.newest_first must be a bool, got {self.newest_first!r}")
        share("split_target", of_upper=True)


@dataclass(frozen=True, slots=True)
class Plan:
    """One split or merge to carry out: ``sources`` are replaced by ``targets``."""

    kind: OpKind
    sources: tuple[GpuGroup, ...]
    targets: tuple[GpuGroup, ...]
    reason: str
    predicted_drain_s: float
    reconcile_traffic: float

    @property
    def op(self) -> LatticeOp:
        return LatticeOp(self.kind, self.sources, self.targets)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (groups as ``[first_gpu, degree]``) for logs and messages."""
        return {
            "kind": self.kind.value,
            "sources": [[g.first_gpu, g.degree] for g in self.sources],
            "targets": [[g.first_gpu, g.degree] for g in self.targets],
            "reason": self.reason,
            "predicted_drain_s": self.predicted_drain_s,
            "reconcile_traffic": self.reconcile_traffic,
        }

    # The worker ids are the operation's (one definition: lattice.LatticeOp).
    @property
    def source_ids(self) -> tuple[WorkerId, ...]:
        return self.op.source_ids

    @property
    def target_ids(self) -> tuple[WorkerId, ...]:
        return self.op.target_ids


Trigger = Literal["capacity", "long_fraction", "preference_shift", "long_shift", "long_drop"]
"""The rule behind a decision's direction (:attr:`Decision.trigger`)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one window: the signals seen and the plan, if any.

    ``trigger`` names the rule behind ``direction`` (machine-readable; ``reason`` says it in
    words): ``"capacity"`` (rule 1: D against K), ``"long_fraction"`` (rule 2: the long
    fraction against the reference window), ``"preference_shift"`` (rule 10),
    ``"long_shift"`` (rule 12), or None when no rule signals (a hold within bounds, a window
    held while an operation is in flight)."""

    window: WindowSummary
    capacity_s: float
    capacity_signal: OpKind | None
    fraction_signal: OpKind | None
    direction: OpKind | None
    streak: int
    plan: Plan | None  # the first operation of the plan (``plans[0]``), or None
    reason: str
    composition: str = ""  # the composition judged, e.g. "8CP4/1CP8"
    plans: tuple[Plan, ...] = ()  # every operation of the plan, disjoint, in choice order
    trigger: Trigger | None = None

    def __post_init__(self) -> None:
        # Keep the two views consistent: a single-plan construction fills ``plans``.
        if self.plan is not None and not self.plans:
            object.__setattr__(self, "plans", (self.plan,))
        if (self.plans[0] if self.plans else None) != self.plan:
            raise InvalidInput("Decision.plan must be the first of Decision.plans")


TrafficEstimate = Mapping[WorkerId, float] | Callable[[LatticeOp], float]


@dataclass(frozen=True, slots=True)
class _Histories:
    """What one window changes in the planner's memory besides the streak and the reference
    (rule 4's momentum, rules 6, 11, 12), kept until the window's decision is committed."""

    born: dict[WorkerId, int]
    demand: tuple[float, ...]
    mix: tuple[tuple[int, int], ...]
    mix_composition: Composition
    momentum: OpKind | None


@dataclass
class Planner:
    """Window-by-window decision state: the persistence streak and the reference window."""

    profile: Profile
    config: ControllerConfig = field(default_factory=ControllerConfig)
    _streak_dir: OpKind | None = field(default=None, init=False)
    _streak: int = field(default=0, init=False)
    _recent: tuple[float, ...] = field(default=(), init=False)  # D of the streak's last windows
    _demand_hist: tuple[float, ...] = field(default=(), init=False)  # D of the last windows (11)
    # (requests, long requests) of the busy windows since the composition last changed (12).
    _mix_hist: tuple[tuple[int, int], ...] = field(default=(), init=False)
    _mix_composition: Composition | None = field(default=None, init=False)
    _born: dict[WorkerId, int] = field(default_factory=dict, init=False)  # worker -> window seen
    # Demand by preferred degree of the last non-empty windows (rule 9).
    _pref_hist: tuple[tuple[tuple[int, float], ...], ...] = field(default=(), init=False)
    _ref: tuple[float, float] | None = field(default=None, init=False)  # (D_ref, f_ref)
    _ref_composition: Composition | None = field(default=None, init=False)
    _momentum: OpKind | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.profile, Profile):
            raise InvalidInput(f"expected a Profile, got {self.profile!r}")
        if not isinstance(self.config, ControllerConfig):
            raise InvalidInput(f"expected a ControllerConfig, got {self.config!r}")

    @property
    def reference(self) -> tuple[float, float] | None:
        """(D_ref, f_ref) of the current composition, or None before its first busy window."""
        return self._ref

    @property
    def streak(self) -> tuple[OpKind | None, int]:
        return self._streak_dir, self._streak

    @property
    def momentum(self) -> OpKind | None:
        """Rule 4's momentum: the direction of the last operation carried out, while each
        window since has shown that direction's signal; None otherwise."""
        return self._momentum

    def plan_not_carried_out(self) -> None:
        """The last plan :meth:`observe` returned was dropped with none of its operations
        started (e.g. the epoch compare-and-set was lost): the momentum it set is taken back,
        since only an operation carried out earns it (the next window in that direction waits
        for persistence again)."""
        self._momentum = None

    def reset(self) -> None:
        """Forget the streak and the reference (e.g. after a reconfiguration completed)."""
        self._streak_dir, self._streak = None, 0
        self._recent = ()
        self._pref_hist = ()
        self._ref, self._ref_composition = None, None
        self._mix_hist, self._mix_composition = (), None

    def observe(
        self,
        window: WindowSummary,
        composition: Composition,
        *,
        drain_s: Mapping[WorkerId, float] | None = None,
        traffic: TrafficEstimate | None = None,
        unavailable: Collection[WorkerId] = (),
        reconfiguring: bool = False,
    ) -> Decision:
        """Decide for one closed window (the rules of the module doc).

        ``drain_s``: worker → predicted seconds until its in-flight prefill finishes (queued
        requests are redirected, so they do not delay a drain; passing all outstanding work
        is a conservative proxy). Missing workers count 0. ``traffic``: worker → retained
        prefix blocks weighted by recent access, or a callable scoring a whole operation;
        default 0. ``unavailable``: workers that must not take part (not active); they also
        count no capacity, since they serve nothing.
        """
        if not isinstance(window, WindowSummary):
            raise InvalidInput(f"expected a WindowSummary, got {window!r}")
        if not isinstance(composition, Composition):
            raise InvalidInput(f"expected a Composition, got {composition!r}")
        drains = _check_estimates("drain_s", drain_s or {})
        if traffic is not None and not callable(traffic):
            traffic = _check_estimates("traffic", traffic)
        cfg = self.config
        excluded = frozenset(unavailable)
        cap = capacity(composition, self.profile, excluded)
        d = window.demand_s
        f = window.long_fraction
        desc = composition.describe()

        # Everything below is computed into locals and committed at the end, so a bad
        # estimate surfacing in _choose leaves the planner unchanged.
        same = composition == self._ref_composition
        ref = self._ref if same else None
        prev_dir, prev_streak = (self._streak_dir, self._streak) if same else (None, 0)
        born = {w: self._born.get(w, window.index) for w in composition.worker_ids}
        demand_hist = self._demand_hist
        if cfg.merge_memory is not None:
            demand_hist = (*demand_hist, d)[-cfg.merge_memory :]
        mix_hist = self._mix_hist if composition == self._mix_composition else ()
        mix_before = mix_hist
        if window.requests:
            mix_hist = (*mix_hist, (window.requests, window.long_requests))
        # The histories of this window, committed with the decision (a traffic estimate that
        # _choose refuses must not leave this window counted in them).
        hist = _Histories(born, demand_hist, mix_hist, composition, self._momentum)
        pref_hist = self._pref_hist
        if window.demand_by_preferred:
            pref_hist = (*pref_hist, window.demand_by_preferred)[-cfg.persistence :]
        if reconfiguring:
            # NOTE: momentum survives an in-flight operation (it is what the operation did).
            self._commit(None, 0, ref, composition, pref_hist=pref_hist, hist=hist)
            return Decision(
                window, cap, None, None, None, 0, None, "reconfiguration in flight", desc
            )

        cap_sig = (
            OpKind.SPLIT if d > cfg.upper * cap else OpKind.MERGE if d < cfg.lower * cap else None
        )
        frac_sig: OpKind | None = None
        stable = (
            ref is not None and abs(d - ref[0]) <= cfg.demand_stability * max(ref[0], _EPS) + _EPS
        )
        if f is not None and ref is not None and stable:
            if f - ref[1] >= cfg.long_fraction_delta - _EPS:
                frac_sig = OpKind.MERGE
            elif ref[1] - f >= cfg.long_fraction_delta - _EPS:
                frac_sig = OpKind.SPLIT
        pref_sig = False
        if (
            cfg.preference_shift is not None
            and cap_sig is None
            and frac_sig is None
            and window.demand_by_preferred
            and _preference_exceeds(
                composition, dict(window.demand_by_preferred), cfg.preference_shift, excluded
            )
        ):
            frac_sig, pref_sig = OpKind.MERGE, True
        long_sig = drop_sig = False
        if (
            (cfg.long_shift is not None or cfg.long_drop is not None)
            and cap_sig is None
            and frac_sig is None
            and f is not None
            and len(mix_before) >= cfg.persistence
        ):
            n_req = sum(r for r, _ in mix_before)
            f_mem = sum(lg for _, lg in mix_before) / n_req if n_req else 0.0
            if cfg.long_shift is not None and f - f_mem >= cfg.long_shift - _EPS:
                frac_sig, long_sig = OpKind.MERGE, True
            elif (
                cfg.long_drop is not None
                and f_mem - f >= cfg.long_drop - _EPS
                and (cfg.long_drop_z is None
                     or f_mem - f >= cfg.long_drop_z * math.sqrt(
                         f_mem * (1.0 - f_mem) / window.requests) - _EPS)
                and (cfg.long_drop_demand is None or d >= cfg.long_drop_demand * cap - _EPS)
            ):
                frac_sig, drop_sig = OpKind.SPLIT, True
        new_ref = ref
        # (Re)base the reference on a busy window with no capacity signal whose demand is not
        # comparable with the old reference: the mix is judged against the current level.
        if f is not None and cap_sig is None and not stable:
            new_ref = (d, f)

        direction = cap_sig or frac_sig
        trigger: Trigger | None = (
            "capacity" if cap_sig is not None
            else "preference_shift" if pref_sig
            else "long_shift" if long_sig
            else "long_drop" if drop_sig
            else "long_fraction" if frac_sig is not None
            else None
        )
        if cap_sig is not None:
            why = (
                f"D={d:.1f}s > u·K={cfg.upper * cap:.1f}s"
                if cap_sig is OpKind.SPLIT
                else f"D={d:.1f}s < l·K={cfg.lower * cap:.1f}s"
            )
            if frac_sig is not None and frac_sig is not cap_sig:
                why += f" (capacity overrides long-fraction {frac_sig.value})"
        elif pref_sig:
            why = "demand preferring a larger degree exceeds its share of GPUs"
        elif long_sig:
            why = f"long fraction {f:.2f} above this composition's earlier windows"
        elif drop_sig:
            why = f"long fraction {f:.2f} below this composition's earlier windows"
        elif frac_sig is not None:
            assert ref is not None and f is not None
            why = f"long fraction {f:.2f} vs reference {ref[1]:.2f} at stable demand"
        else:
            why = f"D={d:.1f}s within [{cfg.lower:.2f}, {cfg.upper:.2f}]·K={cap:.1f}s"

        if direction is not hist.momentum:
            hist = replace(hist, momentum=None)  # a window without the signal ends it
        if direction is None:
            self._commit(None, 0, new_ref, composition, pref_hist=pref_hist, hist=hist)
            return Decision(window, cap, cap_sig, frac_sig, None, 0, None, f"hold: {why}", desc)
        streak = prev_streak + 1 if direction is prev_dir else 1
        recent = ((*self._recent, d) if streak > 1 else (d,))[-cfg.persistence :]
        if direction is hist.momentum:
            streak = max(streak, cfg.persistence)
        need = cfg.persistence
        if (long_sig or drop_sig) and cfg.long_shift_persistence is not None:
            need = cfg.long_shift_persistence

        def no_plan(reason: str) -> Decision:
            # A signal without a plan this window (still persisting, or every operation
            # refused): its streak is kept for the next window, unlike a hold's.
            self._commit(
                direction, streak, new_ref, composition, recent, pref_hist=pref_hist, hist=hist
            )
            return Decision(window, cap, cap_sig, frac_sig, direction, streak, None, reason,
                            desc, trigger=trigger)

        if streak < need:
            return no_plan(f"{direction.value} pending ({streak}/{need}): {why}")
        peak = max(recent)
        if pref_sig and cap_sig is None and demand_hist:
            peak = max(peak, *demand_hist)  # rule 11
        backlog = 0.0
        if cfg.backlog_s is not None:
            avail = [w for w in composition.worker_ids if w not in excluded]  # GPU order
            if avail:
                qs = sorted(drains.get(w, 0.0) for w in avail)
                backlog = qs[len(qs) // 2]
        backlogged = cfg.backlog_s is not None and backlog >= cfg.backlog_s
        plans: tuple[Plan, ...] = ()
        refusal = (
            f"merge refused: the pool is backlogged (median queued work {backlog:.1f}s)"
        )
        if direction is OpKind.SPLIT or not backlogged:
            plans, refusal = self._choose(
                direction,
                composition,
                peak if direction is OpKind.MERGE else d,
                drains,
                traffic,
                excluded,
                capacity_driven=cap_sig is not None,
                preference_driven=(pref_sig or long_sig) and cap_sig is None,
                mix_rule=10 if pref_sig else 12 if long_sig else None,
                why=why,
                preferred=(
                    _sum_by_degree(pref_hist)
                    if cfg.merge_speedup is not None and not long_sig
                    else {}
                ),
                floor=(cfg.large_floor if cfg.large_floor is not None and not backlogged else 0),
                born=born,
                by_degree=(
                    dict(window.demand_by_degree)
                    if long_sig and cfg.long_shift_by_degree
                    else None
                ),
            )
        if plans:
            hist = replace(hist, momentum=direction if cfg.momentum else None)
            self._commit(None, 0, new_ref, composition, pref_hist=pref_hist, hist=hist)
            reason = plans[0].reason
            if len(plans) > 1:
                after = composition
                for pl in plans:
                    after = after.apply(pl.op)
                reason = (
                    f"{len(plans)} {direction.value}s ({composition.describe()} -> "
                    f"{after.describe()}): {why}"
                )
            return Decision(
                window,
                cap,
                cap_sig,
                frac_sig,
                direction,
                streak,
                plans[0],
                reason,
                desc,
                plans,
                trigger,
            )
        return no_plan(f"hold: {refusal} ({why})")

    def _commit(
        self,
        direction: OpKind | None,
        streak: int,
        ref: tuple[float, float] | None,
        composition: Composition,
        recent: tuple[float, ...] = (),
        pref_hist: tuple[tuple[tuple[int, float], ...], ...] | None = None,
        hist: _Histories | None = None,
    ) -> None:
        self._streak_dir, self._streak = direction, streak
        if hist is not None:
            self._born, self._demand_hist = hist.born, hist.demand
            self._mix_hist, self._mix_composition = hist.mix, hist.mix_composition
            self._momentum = hist.momentum
        self._recent = recent
        if pref_hist is not None:
            self._pref_hist = pref_hist
        self._ref, self._ref_composition = ref, composition

    def _choose(
        self,
        direction: OpKind,
        composition: Composition,
        demand: float,
        drains: Mapping[WorkerId, float],
        traffic: TrafficEstimate | None,
        unavailable: frozenset[WorkerId],
        *,
        capacity_driven: bool,
        why: str,
        preferred: Mapping[int, float] | None = None,
        preference_driven: bool = False,
        floor: int = 0,
        mix_rule: int | None = None,
        born: Mapping[WorkerId, int] | None = None,
        by_degree: Mapping[int, float] | None = None,
    ) -> tuple[tuple[Plan, ...], str]:
        """Rules 5, 6, 8 and 10: the operations of the plan, or () and why none was admitted.
        ``by_degree``: the window's demand by placed degree, for rule 12's per-degree
        admission (None: the aggregate bound only)."""
        cfg = self.config
        # Only a capacity signal says how far to go; a mix shift (rule 2 or 10) moves one step
        # at a time and is re-judged against the new composition.
        limit = cfg.max_ops if capacity_driven else 1
        virtual = composition
        touched = set(unavailable)
        plans: list[Plan] = []
        refusal = ""
        while len(plans) < limit:
            if plans and direction is OpKind.SPLIT:
                # Rule 8: split until the pool has the target headroom.
                if demand <= cfg.split_target * capacity(virtual, self.profile, unavailable):
                    break
            best, refusal = self._best_op(
                direction,
                virtual,
                demand,
                drains,
                traffic,
                touched,
                unavailable,
                capacity_driven=capacity_driven,
                preferred=preferred or {},
                headroom=self._mix_headroom(mix_rule) if preference_driven else cfg.merge_headroom,
                floor=floor,
                born=born,
                by_degree=by_degree,
            )
            if best is None:
                break
            op, drain, tr = best
            after = virtual.apply(op)
            plans.append(
                Plan(
                    kind=op.kind,
                    sources=op.sources,
                    targets=op.targets,
                    reason=f"{op.describe()} ({virtual.describe()} -> {after.describe()}): {why}",
                    predicted_drain_s=drain,
                    reconcile_traffic=tr,
                )
            )
            touched.update(op.source_ids)
            touched.update(op.target_ids)
            virtual = after
        return tuple(plans), ("" if plans else refusal)

    def _mix_headroom(self, rule: int | None) -> float:
        """Admission bound (× K') of a mix-driven merge: rule 10's ``preference_headroom``
        when set, else ``upper`` (rule 12 always)."""
        cfg = self.config
        if rule == 10 and cfg.preference_headroom is not None:
            return cfg.preference_headroom
        return cfg.upper

    def _best_op(
        self,
        direction: OpKind,
        composition: Composition,
        demand: float,
        drains: Mapping[WorkerId, float],
        traffic: TrafficEstimate | None,
        touched: set[WorkerId],
        unavailable: frozenset[WorkerId],
        *,
        capacity_driven: bool,
        preferred: Mapping[int, float] | None = None,
        headroom: float | None = None,
        floor: int = 0,
        born: Mapping[WorkerId, int] | None = None,
        by_degree: Mapping[int, float] | None = None,
    ) -> tuple[tuple[LatticeOp, float, float] | None, str]:
        """The best admitted adjacent operation on workers not ``touched`` (rules 5, 6, 9);
        ``born``: worker -> the window it was first seen in (rule 6), default the kept one;
        ``by_degree``: demand by placed degree -- a merge over the demand bound is still
        admitted when it lowers the worst per-degree load (rule 12)."""
        cfg = self.config
        born = self._born if born is None else born
        headroom = cfg.merge_headroom if headroom is None else headroom
        pref_total = sum(preferred.values()) if preferred else 0.0
        gated = floored = False
        ops = [
            op
            for op in composition.adjacent()
            if op.kind is direction and not touched.intersection(op.source_ids)
        ]
        if not ops:
            return None, f"no {direction.value} is possible from {composition.describe()}"
        admitted = []
        for op in ops:
            after = composition.apply(op)
            cap_after = capacity(after, self.profile, unavailable)
            if direction is OpKind.MERGE and demand > headroom * cap_after + _EPS and not (
                by_degree
                and degree_load(after, by_degree, self.profile, unavailable)
                < degree_load(composition, by_degree, self.profile, unavailable) - _EPS
            ):
                continue
            if direction is OpKind.MERGE and preferred and pref_total > 0:
                big = op.targets[0].degree
                share = sum(v for c, v in preferred.items() if c >= big) / pref_total
                allowed = math.ceil(share * composition.lattice.num_gpus / big - _EPS) * big
                held = sum(g.degree for g in after.groups if g.degree >= big)
                if held > allowed:
                    gated = True  # rule 9: the window's requests do not gain from degree big
                    continue
            if direction is OpKind.SPLIT and floor:  # rule 13
                big = op.sources[0].degree
                before = sum(1 for g in composition.groups if g.degree >= big)
                if before - 1 < floor <= before:
                    floored = True
                    continue
            if (
                direction is OpKind.SPLIT
                and not capacity_driven
                and demand < cfg.lower * cap_after - _EPS
            ):
                continue
            admitted.append(op)
        if not admitted:
            if gated:
                return None, "merge refused: the window's requests do not prefer the larger degree"
            if floored:
                return None, (
                    f"split refused: it would leave fewer than {floor} larger-degree workers "
                    "and the pool is not backlogged"
                )
            if direction is OpKind.MERGE:
                return None, (
                    f"merge refused: no merged composition keeps D ≤ {headroom:.2f}·capacity"
                )
            return None, "split refused: it would leave demand below the lower threshold"

        def score(op: LatticeOp) -> tuple[int, float, float, int]:
            drain = max(drains.get(w, 0.0) for w in op.source_ids)
            newest = (
                -max(born.get(w, 0) for w in op.source_ids) if cfg.newest_first else 0
            )
            if traffic is None:
                tr = 0.0
            elif callable(traffic):
                tr = float(traffic(op))
                if not (tr >= 0 and math.isfinite(tr)):
                    raise InvalidInput(f"traffic estimate for {op.describe()} is {tr!r}")
            else:
                tr = sum(traffic.get(w, 0.0) for w in op.source_ids)
            return newest, drain, tr, op.sources[0].first_gpu

        best = min(admitted, key=score)
        _, drain, tr, _ = score(best)
        return (best, drain, tr), ""


def _preference_exceeds(
    composition: Composition,
    by_preferred: Mapping[int, float],
    threshold: float,
    excluded: Collection[WorkerId],
) -> bool:
    """Rule 10: for some degree C above the smallest, the share of demand preferring ≥ C
    exceeds the share of the available GPUs at ≥ C by at least ``threshold``."""
    total = sum(by_preferred.values())
    groups = [g for g in composition.groups if g.worker_id not in excluded]
    gpus = sum(g.degree for g in groups)
    if total <= 0 or gpus <= 0:
        return False
    for c in composition.lattice.sorted_degrees[1:]:
        want = sum(v for d, v in by_preferred.items() if d >= c) / total
        held = sum(g.degree for g in groups if g.degree >= c) / gpus
        if want - held >= threshold - _EPS:
            return True
    return False


def degree_load(
    composition: Composition,
    by_degree: Mapping[int, float],
    profile: Profile,
    excluded: Collection[WorkerId] = (),
) -> float:
    """The worst per-degree load of ``composition``: max over degrees C with demand of
    D_C / K_C, where D_C = ``by_degree[C]`` (seconds placed at degree C in a window) and K_C
    the κ of its degree-C workers not in ``excluded``; inf when a degree with demand has no
    such worker, 0 when there is no demand. Pure (rule 12's per-degree admission)."""
    cap: dict[int, float] = {}
    for g in composition.groups:
        if g.worker_id not in excluded:
            cap[g.degree] = cap.get(g.degree, 0.0) + profile.kappa_for(g.degree)
    worst = 0.0
    for c, d in by_degree.items():
        if d > 0:
            k = cap.get(c, 0.0)
            worst = max(worst, d / k if k > 0 else math.inf)
    return worst


def _sum_by_degree(rows: tuple[tuple[tuple[int, float], ...], ...]) -> dict[int, float]:
    out: dict[int, float] = {}
    for row in rows:
        for c, v in row:
            out[c] = out.get(c, 0.0) + v
    return out


def _check_estimates(name: str, m: Mapping[WorkerId, float]) -> Mapping[WorkerId, float]:
    if not isinstance(m, Mapping):
        raise InvalidInput(f"{name} must be a mapping worker -> seconds, got {m!r}")
    for w, v in m.items():
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not (v >= 0 and math.isfinite(v))
        ):
            raise InvalidInput(f"{name}[{w!r}] must be a finite number >= 0, got {v!r}")
    return m
