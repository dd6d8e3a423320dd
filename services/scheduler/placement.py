"""Vertumnus's CP-aware placement cost (§5.3) and the preferred degree (§7.1).

For every eligible worker w of request i (eligibility: :mod:`services.scheduler.eligibility`):

    P_{i,w} = min(held_blocks[w]·B, L − 1)          R_{i,w} = L − P_{i,w}   (R ≥ 1 always)
    s_{i,w} = Ê_{C_w}(R_{i,w}, P_{i,w})                                     (Eq. 3)
    J_{i,w} = q_w + β·s_{i,w} + λ·(C_w·s_{i,w} − C_min·Ê_{C_min}(R_{i,w}, P_{i,w}))

with q_w the worker's outstanding predicted work (:mod:`services.scheduler.load`) and C_min the
smallest degree among the *eligible* workers.

β is the paper's constant unless one of two load-following forms (our additions) is on. J
then uses β_eff = 1 + (β − 1)·f with a load factor f ∈ [0, 1], the product of

* ``beta_busy_power`` k > 0: f_busy = b^k, b the busy share of the pool — the GPUs of the view's
  active workers that hold unfinished work (this scheduler's reservations, or other replicas'
  reported work not yet run off), over the GPUs of all its active workers
  (:func:`busy_share`). k = 0: f_busy = 1 (β fixed, the paper's form).
* ``beta_queue_scale`` τ > 0 (seconds of the cost model like q, not of the clock: a
  time-scaled live run does not scale it): f_queue = min(1, q̄ / τ), q̄ the mean queueing delay
  of the view's active workers. τ = 0: f_queue = 1.

Why. β > 1 charges a placement that recomputes a cached prefix elsewhere for the GPU time it
takes from later requests; that time is worth something only when later requests will want it.
While most of the pool is idle J is then earliest-finish (β_eff ≈ 1): a cache-affine placement
would only queue a document's follow-ups behind each other (L-Eval); with every GPU busy each
cached token is capacity (the conversation trace near saturation). The busy share is the
calibrated default (services/calibration.py; docs/evaluation.md "L-Eval and β"): it tells the
two regimes apart where the queueing delay does not (short requests at a high rate keep short
queues on a fully busy pool).

**Pull credit** (our addition; off unless ``pull`` is given): the cache manager copies a
request's prefix to the worker it was routed to from the worker holding the most of it
(services/cachemgr/pull.py, the route-time pull). With a :class:`PullCredit`, J counts on that
copy where it will have landed before the request starts: for worker w,

    P_{i,w} = min(H·B, L − 1)   when   m ≤ H − h_w ≤ M  and  q_w ≥ t0 + t1·(H − h_w)

with H the longest prefix any worker *holds* (``holdings``: the trie's, not counting prefixes
of unfinished requests), h_w the worker's own count (``held_blocks``), m the pull's
``min_blocks`` (below it no copy is sent), M ``max_blocks`` and t0 + t1·k the estimated copy
time of k blocks; such a worker's J then also carries the copy's displacement price
δ·(H − h_w) (``displace_block_s``: each copied block takes a block of the destination's
cache, which a later request may have to recompute; 0: none). Otherwise P is as above.
Why: without it J routes a session's next turn away from its busy holder and the turn
recomputes its history unless the copy happens to land in time; with it J knows where the
copy will be, so a queued placement away from the holder is priced at its real cost.

With ``PullCredit.wait`` (our addition, on in the calibrated settings) the credit also goes
to a worker whose queue is *shorter* than the copy, q_w < t0 + t1·(H − h_w), where waiting
for it is worth it: the request would wait there for the copy to land before it starts, so
that worker's J is the lower of J with the copy, t0 + t1·(H − h_w) in place of q_w (J = t0 +
t1·(H − h_w) + β·s + λ·extra + δ·(H − h_w), s with the pulled prefix), and J without it (its
own prefix, no wait). The decision's ``pull_wait_s`` says how much longer than the queue the
chosen worker waits. The worker keeps to it: the simulator starts the request when the copy
has landed; a live rank daemon holds it until its cache has the prefix, for a bounded time
unless the copy is arriving (services/rankd/core.py ``WorkerCore.pull_hold``). Why: without
it a prefix held only by a busy worker leaves J two bad choices -- queue behind the holder,
or recompute on an idle worker -- where a copy of 10-150 ms to the idle worker beats both;
the reconfiguration preset's long documents (100K tokens, whose holder was busy with
another document) queued 10-21 s that way. Why M:
a long copy displaces as much of the destination's cache (documents pushed out, then
recomputed; the reconfiguration preset's long phases) -- the calibration's sweep is in
services/calibration.py ``PULL_CREDIT_BLOCKS``.

**A pending prefix** (our addition to §6.2; off unless ``pending`` is given, and only with
the credit): after a split or merge a worker's retained prefixes are *pending* until a request
reuses them there, which sends the reconcile copies (services/cachemgr/reconcile.py
``on_reuse``). For a worker whose pending copy reaches r_w blocks of the request (``pending``:
``pending_reach``), H above is max(H, r_w) for that worker alone, under the same bounds,
queue test and wait, and without δ where r_w ≥ H (a reconcile copy takes nothing from its
source: the pages are the worker's own, or its sibling's left over from the split). Why:
§6.2 does not count a pending prefix as reusable, so J sent the request that would have
reused it elsewhere, where it recomputed the prefix -- a 113K-token document in the
reconfiguration preset's last phase, 18 s against 1 s on the fixed pool (docs/evaluation.md
"J counts a pending prefix"). The simulator computes ``pending`` on the cache manager's trie;
the live scheduler on its replica, where the cache manager's ReconciledNotice marks what each
new worker has pending (services/scheduler/service.py ``on_reconciled``).

PreferDegree (below) leaves the credit out, as it leaves the load out: the copy counts only
where the queue lets it land, and the controller's merge gate reads the preferred degree.

The request goes to argmin J. Ties are broken
deterministically: lower J, then smaller degree (fewer GPUs for the same cost), then a
rendezvous rank of the worker for this request (:func:`_rendezvous`: spreads ties uniformly).

PreferDegree(i) (§7.1) is the degree of argmin over eligible workers of J − q = β·s + λ·extra,
each worker with its own P (the paper's definition; design.md); ties there go to the smaller
degree, then the worker id (only the degree is used downstream).

Hot path: this runs once per request over every worker (512 in the scale benchmark), so the loop
is written flat and single-pass — C_min found first from a per-view table, Ê memoised per
(degree, P) because most workers share P = 0 (cache miss), the crc32 of worker ids cached for
the rendezvous tie-break, and the per-candidate terms stored column-wise (see
:mod:`services.scheduler.decision`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from services.scheduler.decision import CandidateColumns, ColumnTuples, Decision, Exclusion
from services.scheduler.eligibility import LIFECYCLE_EXCLUSION
from services.scheduler.errors import NoEligibleWorker
from services.scheduler.load import WorkerLoad
from services.scheduler.view import ClusterView, RequestInfo
from shared.costmodel import Profile
from shared.ids import InvalidInput, UnknownWorker, WorkerId
from shared.worker import Lifecycle

_ACTIVE: Final = Lifecycle.ACTIVE
_UNAVAILABLE: Final = Lifecycle.UNAVAILABLE


# Per view (immutable): ids, degrees and each worker's static eligibility terms (max_seq_len and
# the length limit min(max_seq_len, kv_capacity_tokens), plus the crc32 of its id, the
# rendezvous input, degree·n + rank of its id among the view's ids, one int ordered as
# (degree, id) for PreferDegree's tie-break, and the rank of its degree among the view's
# degrees, which keys the per-(degree, P) memo as one int), so a placement does not re-read every
# WorkerView's attributes; and the active workers as (degree, min(max_seq_len,
# kv_capacity_tokens)) sorted by degree, so C_min of a request is found before the single pass
# over the workers. Keyed by id(view); the entry keeps the view alive, so the id cannot be
# reused while cached.
_StaticRow = tuple[int, WorkerId, int, "Exclusion | None", int, int, int, int, int]
_ViewStatic = tuple[tuple[WorkerId, ...], tuple[int, ...], tuple[_StaticRow, ...],
                    tuple[tuple[int, int], ...]]
_VIEW_CACHE: dict[int, tuple[ClusterView, _ViewStatic]] = {}
_VIEW_CACHE_MAX: Final[int] = 64


def _static_rows(view: ClusterView) -> _ViewStatic:
    ent = _VIEW_CACHE.get(id(view))
    if ent is None or ent[0] is not view:
        ws = view.workers
        n = len(ws)
        id_rank = {wid: k for k, wid in enumerate(sorted(w.worker_id for w in ws))}
        deg_rank = {c: k for k, c in enumerate(sorted({w.degree for w in ws}))}
        static = (
            tuple(w.worker_id for w in ws),
            tuple(w.degree for w in ws),
            tuple(
                (i, w.worker_id, w.degree,
                 None if w.lifecycle is _ACTIVE else LIFECYCLE_EXCLUSION[w.lifecycle],
                 w.max_seq_len, min(w.max_seq_len, w.kv_capacity_tokens),
                 zlib.crc32(w.worker_id.encode()), w.degree * n + id_rank[w.worker_id],
                 deg_rank[w.degree])
                for i, w in enumerate(ws)
            ),
            tuple(sorted(
                (w.degree, min(w.max_seq_len, w.kv_capacity_tokens))
                for w in ws if w.lifecycle is _ACTIVE
            )),
        )
        ent = (view, static)
        if len(_VIEW_CACHE) >= _VIEW_CACHE_MAX:
            _VIEW_CACHE.clear()
        _VIEW_CACHE[id(view)] = ent
    return ent[1]


_MASK64: Final[int] = (1 << 64) - 1


def _rendezvous(seed: int, worker: WorkerId) -> int:
    """The rank of ``worker`` for the request whose crc32 is ``seed`` (lower ranks first).

    Ties in J are common, not corner cases: at light load most workers are idle and miss, so
    they share one J. Breaking them by worker id sends every such request to the same few
    workers — on the conversation trace at ×1 the lowest-id CP4 worker got 100× the requests
    of the highest — which concentrates both new prefixes (more LRU eviction on a few caches,
    less total cache in use) and their follow-up turns (which then queue behind each other).
    A rendezvous (lowest-hash-wins) rank spreads ties uniformly, like Dynamo's and
    SGLang's random choice, yet is a pure function of (request, worker): replicas still agree
    and a re-placed request ranks workers the same way. splitmix64's finaliser mixes the two
    crc32 values so the ranks of different requests are independent (crc32 alone is affine).
    """
    return _rendezvous_crc(seed, zlib.crc32(worker.encode()))


def _rendezvous_crc(seed: int, worker_crc: int) -> int:
    """:func:`_rendezvous` given the crc32 of the worker id (cached per view: speed)."""
    x = (seed << 32 ^ worker_crc) & _MASK64
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def tie_rank(request_id: str, worker: WorkerId) -> int:
    """The rendezvous rank J uses among tied workers (lower first), for policies that break
    ties as J does (e.g. ``static``): a pure function of (request, worker)."""
    return _rendezvous_crc(zlib.crc32(request_id.encode()), zlib.crc32(worker.encode()))


def load_beta(beta: float, beta_queue_scale: float, rows: tuple[_StaticRow, ...],
              loads: Mapping[WorkerId, WorkerLoad], now: float
              ) -> tuple[float, list[float | None]]:
    """(1 + (β − 1)·min(1, q̄ / τ), each row's queueing delay) with q̄ the mean queueing delay
    of the active workers in ``rows`` that have a load tracker (None for the others; a worker
    without one is reported by the caller). The delays are handed to the placement's pass so
    that it does not compute them twice."""
    qs: list[float | None] = [None] * len(rows)
    total = 0.0
    count = 0
    for k, row in enumerate(rows):
        ld = loads.get(row[1])
        if ld is None or row[3] is not None:
            continue
        q = qs[k] = ld.queue_delay(now)
        total += q
        count += 1
    if not count:
        return beta, qs
    return 1.0 + (beta - 1.0) * min(1.0, total / count / beta_queue_scale), qs


def busy_share(rows: tuple[_StaticRow, ...], loads: Mapping[WorkerId, WorkerLoad],
               now: float) -> float:
    """b: the GPUs of the active workers in ``rows`` that hold unfinished work
    (:meth:`WorkerLoad.busy`) over the GPUs of all active workers in ``rows`` with a load
    tracker; 1.0 when there are none (β as given)."""
    busy = total = 0
    for row in rows:
        if row[3] is not None:
            continue
        ld = loads.get(row[1])
        if ld is None:
            continue  # reported by the placement's pass (UnknownWorker)
        total += row[2]
        if ld.busy(now):
            busy += row[2]
    return busy / total if total else 1.0


@dataclass(frozen=True, slots=True)
class PullCredit:
    """J's credit for the route-time pull (module docstring, "Pull credit").

    ``min_blocks``: the cache manager's ``PullConfig.min_blocks`` (a shorter gap is not
    copied, so it gets no credit). ``max_blocks``: the longest copy J counts on.
    ``copy_base_s`` + ``copy_block_s``·k: the estimated time of a k-block copy, from the
    deployment's link facts, not measured: the default is a 512-token block of Qwen3-30B-A3B
    KV (48 MiB) over two 40 GB/s RDMA rank pairs, plus a command round trip. Without ``wait``
    the credit needs the worker's queue to cover it, so a rough figure only moves the border
    case (docs/evaluation.md "Pull credit"). ``displace_block_s``: δ, J's price for each
    block the copy moves (module docstring; services/calibration.py
    ``PULL_DISPLACE_BLOCK_S``). ``wait``: the credit also goes to a worker whose queue is
    shorter than the copy, the request waiting there for it to land (module docstring;
    services/calibration.py ``PULL_WAIT``)."""

    min_blocks: int
    max_blocks: int
    copy_base_s: float = 0.002
    copy_block_s: float = 0.0006
    displace_block_s: float = 0.0
    wait: bool = False

    def __post_init__(self) -> None:
        for name in ("min_blocks", "max_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInput(f"PullCredit.{name} must be an integer >= 1, got {v!r}")
        if self.max_blocks < self.min_blocks:
            raise InvalidInput(f"PullCredit.max_blocks ({self.max_blocks}) is below "
                               f"min_blocks ({self.min_blocks})")
        _check_nonneg("PullCredit.copy_base_s", self.copy_base_s, " of seconds")
        _check_nonneg("PullCredit.copy_block_s", self.copy_block_s, " of seconds")
        _check_nonneg("PullCredit.displace_block_s", self.displace_block_s, " of seconds")
        if not isinstance(self.wait, bool):
            raise InvalidInput(f"PullCredit.wait must be a bool, got {self.wait!r}")


def pull_copy_s(credit: PullCredit | None, pulled_blocks: int) -> float:
    """What the worker waits for at most (the copy's estimated time, cost-model seconds) when
    J placed with ``credit`` and counted on a pull of ``pulled_blocks`` blocks
    (``Decision.pulled_blocks``): t0 + t1·pulled_blocks with ``credit.wait``, else 0 (the
    credit without its wait does not hold the request: it recomputes what has not landed)."""
    if credit is None or not credit.wait or pulled_blocks <= 0:
        return 0.0
    return credit.copy_base_s + credit.copy_block_s * pulled_blocks


def _check_counts(name: str, counts: Mapping[WorkerId, int]) -> None:
    """Every value of ``counts`` an integer >= 0 (not a bool); else InvalidInput naming
    ``name[worker]``. Cheap: these maps name only the workers with a hit."""
    for w, h in counts.items():
        if h.__class__ is not int or h < 0:  # fast exact-int check first, then the slow one
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise InvalidInput(f"{name}[{w!r}] must be an integer >= 0, got {h!r}")


def _check_nonneg(name: str, value: float, unit: str) -> None:
    """``value`` a finite number >= 0 (not a bool); else InvalidInput naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise InvalidInput(f"{name} must be a finite number{unit} >= 0, got {value!r}")


def check_beta_busy(beta_busy_power: float) -> None:
    """k of the busy-share β: a finite number >= 0 (0: β fixed)."""
    _check_nonneg("beta_busy_power", beta_busy_power, "")


def check_beta_queue(beta_queue_scale: float) -> None:
    """τ of the load-following β: a finite number of (cost-model) seconds >= 0 (0: off)."""
    _check_nonneg("beta_queue_scale", beta_queue_scale, " of seconds")


def check_weights(beta: float, lam: float) -> None:
    """β ≥ 1 and λ ≥ 0, finite (§5.3)."""
    for name, v, lo in (("beta", beta, 1.0), ("lam", lam, 0.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
            raise InvalidInput(f"{name} must be a finite number >= {lo}, got {v!r}")


def place_j(
    request: RequestInfo,
    view: ClusterView,
    held_blocks: Mapping[WorkerId, int],
    loads: Mapping[WorkerId, WorkerLoad],
    now: float,
    *,
    profile: Profile,
    beta: float,
    lam: float,
    policy: str = "vertumnus",
    beta_queue_scale: float = 0.0,
    beta_busy_power: float = 0.0,
    pull: PullCredit | None = None,
    holdings: Mapping[WorkerId, int] | None = None,
    pending: Mapping[WorkerId, int] | None = None,
) -> Decision:
    """Place ``request`` by minimum J; see the module docstring for the exact rule.

    ``pull``: J's credit for the route-time pull (None: off); ``holdings``: the blocks each
    worker holds of the request's prefix per the trie alone (what a pull copies from; None:
    ``held_blocks``, which may add prefixes of unfinished requests). ``pending`` (with
    ``pull`` only): the leading blocks of the request each worker will hold once its own
    reconcile copies after a split or merge have landed, where more than it holds
    (services/cachemgr/reconcile.py ``pending_reach``); credited as a pull from the worker's
    pending copy (module docstring, "A pending prefix"), without the displacement price where
    it reaches at least as far as the best holder.

    Raises :class:`InvalidInput` (bad request / held count / time / credit),
    :class:`UnknownWorker` (a worker of the view has no load tracker) or
    :class:`NoEligibleWorker`. Pure: reads ``loads``, changes nothing; the caller reserves
    ``Decision.predicted_s`` on the chosen worker.
    """
    # --- validation (cheap: held_blocks names only the workers with a hit) ---------------
    if not isinstance(request, RequestInfo):
        raise InvalidInput(f"request must be a RequestInfo, got {type(request).__name__}")
    if not isinstance(view, ClusterView):
        raise InvalidInput(f"view must be a ClusterView, got {type(view).__name__}")
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise InvalidInput(f"now must be a finite number of seconds, got {now!r}")
    _check_counts("held_blocks", held_blocks)

    # H of the pull credit (module docstring): 0 turns the credit off for this request.
    pull_h = pull_min = pull_max = 0
    pull_t0 = pull_t1 = pull_d = 0.0
    pull_wait = False
    pend_get: Callable[[WorkerId, int], int] | None = None
    if pull is not None:
        if not isinstance(pull, PullCredit):
            raise InvalidInput(f"pull must be a PullCredit, got {type(pull).__name__}")
        src = held_blocks if holdings is None else holdings
        if src is not held_blocks:
            _check_counts("holdings", src)
        # H over the holders a copy can come from: workers of the view that are not
        # UNAVAILABLE (the cache manager copies from no other; the policy contract ignores
        # holders outside the view).
        index = view._index
        for w, h in src.items():
            if h > pull_h:
                wv = index.get(w)
                if wv is not None and wv.lifecycle is not _UNAVAILABLE:
                    pull_h = h
        if pending:
            _check_counts("pending", pending)
            pend_get = pending.get
        pull_min, pull_max = pull.min_blocks, pull.max_blocks
        pull_t0, pull_t1, pull_d = pull.copy_base_s, pull.copy_block_s, pull.displace_block_s
        pull_wait = pull.wait
        if pull_h < pull_min:
            pull_h = 0

    L = request.length
    Lm1 = L - 1
    B = view.block_size
    workers = view.workers
    n = len(workers)
    ids, degs, rows, active = _static_rows(view)
    pre_q: list[float | None] | None = None
    if beta > 1.0:
        if beta_busy_power > 0.0:
            beta = 1.0 + (beta - 1.0) * busy_share(rows, loads, now) ** beta_busy_power
        if beta_queue_scale > 0.0 and beta > 1.0:
            beta, pre_q = load_beta(beta, beta_queue_scale, rows, loads, now)

    # C_min: the smallest degree of an eligible worker (active, and L fits both its max_seq_len
    # and its KV capacity). Known before the pass, so J is computed in the same pass as P, s, q.
    cmin = 0
    for c, limit in active:
        if L <= limit:
            cmin = c
            break

    excl: list[Exclusion | None] = [None] * n
    qs: list[float | None] = [None] * n
    ps: list[int | None] = [None] * n
    moved: dict[int, float] = {}  # row -> δ·(blocks copied) in its J (the credit's price)
    credited: dict[int, int] = {}  # row -> blocks J counted on beyond what the worker holds
    waits: dict[int, float] = {}  # row -> how much longer than its queue it waits for a copy
    # Only q and P are kept per worker: the other candidate terms follow from them and `terms`
    # and are computed if the decision's columns are ever read (_j_columns).

    # (degree, P) as P·n + rank of the degree (an int key: cheaper than a tuple) ->
    # (s = Ê_degree(L − P, P), extra-GPU term, β·s + λ·extra = J − q)
    terms: dict[int, tuple[float, float, float]] = {}
    ecmin: dict[int, float] = {}  # P -> Ê_{C_min}(L − P, P)
    predict = profile.predict_fast

    held_get = held_blocks.get
    loads_get = loads.get
    best = pref = -1
    best_h = seed = -1
    best_j = pref_v = 0.0
    best_c = pref_ck = best_crc = 0
    best_id = ""

    # --- one pass: eligibility, P, R, q, s, the extra-GPU term, J, argmin J, argmin (J − q) ---
    for i, wid, c, lexcl, max_len, limit, wcrc, ck, dk in rows:
        ld = loads_get(wid)
        if ld is None:
            raise UnknownWorker(f"no load tracker for worker {wid!r} of the cluster view")
        if lexcl is not None:
            excl[i] = lexcl
            continue
        if L > limit:  # one test for both limits (speed); then which one it broke
            excl[i] = Exclusion.TOO_LONG if L > max_len else Exclusion.NO_MEMORY
            continue
        # q first: the pull credit depends on it.
        if pre_q is not None:
            q = pre_q[i]  # type: ignore[assignment]  # an active worker's: computed
        elif ld.__class__ is WorkerLoad:
            # ld.queue_delay(now), inlined (speed; NOTE: keep in step with that method).
            q = ld._queued_s
            if ld._running:
                floor = ld.overrun_floor_s
                per = ld._per_clock_s
                for a in ld._running.values():
                    rem = a.predicted_s - (now - a.started_at) * per  # type: ignore[operator]
                    q += rem if rem > floor else floor
            if ld._foreign_s:  # other scheduler replicas' work (live only)
                f = ld._foreign_s - (now - ld._foreign_at) * ld._per_clock_s
                if f > 0.0:
                    q += f
        else:
            q = ld.queue_delay(now)
        blocks = own = held_get(wid, 0)
        src_h = pull_h
        reconciled = False
        if pend_get is not None:
            r = pend_get(wid, 0)
            if r and r >= src_h:
                # Its own pending copy reaches as far as any holder's or further: routed
                # here, the reconcile copies bring it (on_reuse runs before the pull, which
                # then sends no second copy), and they move nothing out of their source.
                src_h, reconciled = r, True
        if src_h:
            gap = src_h - own
            # The credit (module docstring): the copy is sent and lands before it starts. It
            # fits: H full blocks of the request are at most L tokens, within the limit.
            if pull_min <= gap <= pull_max:
                copy_s = pull_t0 + pull_t1 * gap
                if q >= copy_s:
                    blocks = src_h
                elif pull_wait:
                    # It may wait for the copy to land, or start without it: the lower J.
                    key = min(src_h * B, Lm1) * n + dk
                    t = terms.get(key)
                    if t is None:
                        t = _new_term(terms, ecmin, predict, L, min(src_h * B, Lm1), key, c,
                                      cmin, beta, lam)
                    # A reconcile copy moves nothing out of its source (no δ).
                    j_wait = copy_s + t[2] + (0.0 if reconciled else pull_d * gap)
                    key = min(own * B, Lm1) * n + dk
                    t = terms.get(key)
                    if t is None:
                        t = _new_term(terms, ecmin, predict, L, min(own * B, Lm1), key, c,
                                      cmin, beta, lam)
                    if j_wait < q + t[2]:
                        blocks = src_h
                        waits[i] = copy_s - q
                        q = copy_s
            if blocks != own:
                credited[i] = blocks - own
        p = blocks * B
        if p > Lm1:
            p = Lm1
        # (s, extra, J − q) memoised per (degree, P): most workers miss (P = 0) and share one
        # value per degree.
        key = p * n + dk
        t = terms.get(key)
        if t is None:
            t = _new_term(terms, ecmin, predict, L, p, key, c, cmin, beta, lam)
        s, extra, v = t
        j = q + v
        if blocks != own and pull_d and not reconciled:
            m = moved[i] = pull_d * (blocks - own)
            j += m
        ps[i] = p
        qs[i] = q
        # NOTE: tie-break (lower J, then smaller degree, then the request's rendezvous rank of
        # the worker) is independent of the view's order, so every scheduler replica picks the
        # same worker; see _rendezvous for why not the worker id.
        if best < 0 or j < best_j:
            best, best_j, best_c, best_id, best_crc, best_h = i, j, c, wid, wcrc, -1
        elif j == best_j and c <= best_c:
            if c < best_c:
                best, best_c, best_id, best_crc, best_h = i, c, wid, wcrc, -1
            else:
                if seed < 0:
                    seed = zlib.crc32(request.request_id.encode())
                if best_h < 0:
                    best_h = _rendezvous_crc(seed, best_crc)
                h = _rendezvous_crc(seed, wcrc)
                if h < best_h or (h == best_h and wid < best_id):
                    best, best_id, best_crc, best_h = i, wid, wcrc, h
        if blocks != own:
            # PreferDegree (§7.1) leaves the load out, so it prices the worker without the
            # copy that only its queue makes count: its own prefix, as without the credit.
            p_own = min(own * B, Lm1)
            key = p_own * n + dk
            t = terms.get(key)
            if t is None:
                t = _new_term(terms, ecmin, predict, L, p_own, key, c, cmin, beta, lam)
            v = t[2]
        if pref < 0 or v < pref_v or (v == pref_v and ck < pref_ck):  # ck: (degree, id)
            pref, pref_v, pref_ck = i, v, ck

    if best < 0:
        # The exclusions themselves, not their text: the error carries them as data (every
        # worker has one here: one without is a candidate).
        raise NoEligibleWorker(request.request_id,
                               {ids[i]: e for i, e in enumerate(excl) if e is not None})

    p_best: int = ps[best]  # type: ignore[assignment]
    # Credited on the chosen worker: P beyond its own prefix (only the credit gives that).
    pulled = credited.get(best, 0) if p_best > min(held_get(ids[best], 0) * B, Lm1) else 0
    cols = CandidateColumns.deferred(
        lambda: _j_columns(ids, rows, excl, qs, ps, terms, L, moved))
    return Decision(
        policy=policy,
        request_id=request.request_id,
        length=L,
        now=float(now),
        worker=ids[best],
        degree=degs[best],
        prefix_tokens=p_best,
        uncached_tokens=L - p_best,
        predicted_s=terms[p_best * n + rows[best][8]][0],
        reused_blocks=p_best // B,
        preferred_degree=degs[pref],
        preferred_worker=ids[pref],
        objective="min",
        score_label="J",
        columns=cols,
        epoch=workers[best].epoch,
        beta=beta,
        pulled_blocks=pulled,
        pull_wait_s=waits.get(best, 0.0),
    )


def _new_term(terms: dict[int, tuple[float, float, float]], ecmin: dict[int, float],
              predict: Callable[[int, int, int], float], L: int, p: int, key: int, c: int,
              cmin: int, beta: float, lam: float) -> tuple[float, float, float]:
    """(s, extra, β·s + λ·extra) of a degree-``c`` worker reusing ``p`` of ``L`` tokens,
    stored in ``terms`` under ``key`` (the caller looked there first: most workers share a
    (degree, P)); ``ecmin`` memoises Ê_{C_min} per P."""
    s = predict(L - p, p, c)
    if c == cmin:
        extra = 0.0
    else:
        e_min = ecmin.get(p)
        if e_min is None:
            e_min = ecmin[p] = predict(L - p, p, cmin)
        extra = c * s - cmin * e_min
    t = terms[key] = (s, extra, beta * s + lam * extra)
    return t


def _j_columns(
    ids: tuple[WorkerId, ...],
    rows: tuple[_StaticRow, ...],
    excl: list[Exclusion | None],
    qs: list[float | None],
    ps: list[int | None],
    terms: dict[int, tuple[float, float, float]],
    L: int,
    moved: dict[int, float] | None = None,
) -> ColumnTuples:
    """The candidate columns of a :func:`place_j` decision from what it kept: each eligible
    worker's q and P, (s, extra, J − q) per (degree, P) and the pull credit's displacement
    price per credited row (``moved``) -- the same values, and J by the same additions, as
    the placement compared."""
    n = len(ids)
    degs = tuple(r[2] for r in rows)
    ss: list[float | None] = [None] * n
    extras: list[float | None] = [None] * n
    js: list[float | None] = [None] * n
    rs: list[int | None] = [None] * n
    for i in range(n):
        p = ps[i]
        if p is None:
            continue
        s, extra, v = terms[p * n + rows[i][8]]
        j = qs[i] + v  # type: ignore[operator]
        if moved and i in moved:
            j += moved[i]
        ss[i], extras[i], js[i], rs[i] = s, extra, j, L - p
    return (ids, degs, tuple(excl), tuple(qs), tuple(ss), tuple(extras), tuple(js), tuple(ps),
            tuple(rs))


def preferred_degree_at(
    length: int,
    prefix_tokens: int,
    degrees: tuple[int, ...] | list[int],
    *,
    profile: Profile,
    beta: float,
    lam: float,
) -> int:
    """The degree minimising β·s + λ·extraGPU when *every* degree reuses the same P.

    The paper's PreferDegree (what :func:`place_j` reports) gives each worker its own P. This is
    the alternative design.md calls a fair experiment: evaluate each supported degree at one
    common prefix — e.g. the MatchedPath length — so the answer does not depend on where replicas
    happen to be. Ties go to the smaller degree. Raises :class:`InvalidInput` on bad arguments.
    """
    check_weights(beta, lam)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise InvalidInput(f"length must be an integer >= 1, got {length!r}")
    if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
        raise InvalidInput(f"prefix_tokens must be an integer >= 0, got {prefix_tokens!r}")
    degs = sorted(set(degrees))
    if not degs or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in degs):
        raise InvalidInput(f"degrees must be a non-empty set of integers >= 1, got {degrees!r}")
    p = min(prefix_tokens, length - 1)
    r = length - p
    cmin = degs[0]
    base = cmin * profile.predict(r, p, cmin)
    best_c, best_v = cmin, math.inf
    for c in degs:
        s = profile.predict(r, p, c)
        v = beta * s + lam * (c * s - base)
        if v < best_v:
            best_c, best_v = c, v
    return best_c
