"""The embedded default workload: a seeded synthetic generator with load phases.

The project ships no trace (traces are third-party and downloaded by the user), so the
default run needs a workload the project generates itself. It mixes the regimes the paper's
system exploits:

* short chat requests, most behind one of a few shared **system prompts** with Zipf
  popularity, some of them **multi-turn sessions** whose every turn extends the previous
  turn's prefix (previous input + previous output + new user tokens);
* **long** document requests (> 32K tokens) over a pool of documents with Zipf popularity,
  so a long prefix recurs with short new suffixes (the regime where CP barely helps);
* **phases**: a cycle of (duration, rate multiplier, long share) segments, so the load and the
  long/short mix move over time and a controller has reasons to split and merge.

Arrivals: conversation starts form a piecewise-constant Poisson process whose rate is chosen
so that the *request* rate (follow-up turns included) is ``rate × multiplier`` in steady
state; follow-up turns come an exponential think time after the previous turn (so a phase's
sessions spill into the next one) and are dropped past the end.
Block identities are chained over content keys (:mod:`sim.workloads.blocks`), so equal prefix
⇔ equal id. Deterministic for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from sim.workloads.blocks import chain_hash
from sim.workloads.parsing import MAX_SPAN_S, MAX_TOKENS
from sim.workloads.workload import Request, Workload


@dataclass(frozen=True, slots=True)
class LogNormalLength:
    """Token counts ~ round(lognormal(median, sigma)), clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        # sigma and median are bounded so that median·exp(sigma·z) stays a float (round()
        # of an infinity is an OverflowError); a median past the token bound is clipped to
        # hi anyway. hi by the messages' token bound, as every trace reader bounds a length.
        if not (0 < self.median <= MAX_TOKENS and 0 <= self.sigma <= MAX_SIGMA
                and 0 <= self.lo <= self.hi <= MAX_TOKENS):
            raise InvalidInput(f"bad length distribution {self}: needs 0 < median <= "
                               f"{MAX_TOKENS:,}, 0 <= sigma <= {MAX_SIGMA:g}, "
                               f"0 <= lo <= hi <= {MAX_TOKENS:,}")

    def sample(self, rng: np.random.Generator) -> int:
        x = self.median * math.exp(self.sigma * rng.standard_normal())
        return int(min(max(round(x), self.lo), self.hi))


@dataclass(frozen=True, slots=True)
class Phase:
    """A segment of the load cycle: ``duration_s`` at ``rate_multiplier`` × the base rate,
    with ``long_share`` of conversation starts being long document requests (None: the
    config's ``long_share``)."""

    duration_s: float
    rate_multiplier: float
    long_share: float | None = None

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise InvalidInput(f"phase duration must be finite and > 0, got {self.duration_s}")
        if not (self.rate_multiplier >= 0 and math.isfinite(self.rate_multiplier)):
            raise InvalidInput(f"phase rate multiplier must be >= 0, got {self.rate_multiplier}")
        if self.long_share is not None and not 0 <= self.long_share <= 1:
            raise InvalidInput(f"phase long_share must be in [0, 1], got {self.long_share}")


# One 10-minute cycle: a short-heavy steady phase, a long-heavy phase at lower request rate,
# a short burst, and a calm mixed phase. Measured for seed 0 (rate 8): requests/s 6.3, 4.5,
# 12.4, 5.2 (session follow-ups spill into the next phase); long-token share 0.32, 0.71,
# 0.06, 0.29; predicted CP4 demand per 20 s window 82, 149, 108, 77 s uncached and 56, 50,
# 60, 25 s behind an oracle cache — against Σκ_4 ≈ 59 s for ten CP4 workers (40 GPUs).
DEFAULT_PHASES: Final[tuple[Phase, ...]] = (
    Phase(150.0, 1.0, 0.04),
    Phase(150.0, 0.5, 0.30),
    Phase(150.0, 2.0, 0.01),
    Phase(150.0, 0.4, 0.10),
)


MAX_POOL: Final[int] = 100_000
"""Most system prompts or long documents a synthetic workload may draw from (each is sampled
when the workload is generated)."""
MAX_SIGMA: Final[float] = 10.0
"""Largest log-space spread of a length distribution (e^(10·z) is already beyond any clip)."""
MAX_SEGMENTS: Final[int] = 100_000
"""Most phase segments the cycled schedule may make over ``duration_s``."""

MAX_REQUESTS = 1_000_000
"""Most requests (:meth:`SyntheticConfig.expected_requests`: the base rate × the phases'
multipliers over the duration) a synthetic workload may ask for: a million take about
30 s and gigabytes to generate; a rate far beyond would exhaust memory."""


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the synthetic workload (time in s, lengths in tokens, rates in req/s)."""

    duration_s: float = 600.0
    rate: float = 8.0
    """Base request rate (req/s), follow-up turns included, before phase multipliers."""
    long_share: float = 0.08
    """Share of conversation starts that are long document requests (phases may override)."""
    phases: tuple[Phase, ...] = DEFAULT_PHASES
    """Cycled to fill ``duration_s``; empty = one steady phase at ``rate`` and ``long_share``."""
    short_len: LogNormalLength = field(
        default_factory=lambda: LogNormalLength(1500, 0.9, 32, 24_000)
    )
    """User tokens of a short request's first turn (after any system prompt)."""
    long_len: LogNormalLength = field(
        default_factory=lambda: LogNormalLength(56_000, 0.4, 32_769, 131_000)
    )
    """Document tokens of a long request."""
    output_len: LogNormalLength = field(default_factory=lambda: LogNormalLength(200, 0.9, 1, 2048))
    n_system_prompts: int = 6
    system_prompt_len: LogNormalLength = field(
        default_factory=lambda: LogNormalLength(2048, 0.5, 512, 8192)
    )
    system_prompt_share: float = 0.85
    """Share of short conversations that start with a shared system prompt."""
    system_prompt_zipf: float = 1.2
    session_share: float = 0.35
    """Share of short conversations that are multi-turn sessions."""
    mean_turns: float = 4.0
    """Mean turns of a session (≥ 2, geometric)."""
    turn_len: LogNormalLength = field(default_factory=lambda: LogNormalLength(400, 0.8, 8, 8192))
    """New user tokens of a follow-up turn."""
    think_time_s: float = 20.0
    """Mean gap (s) between a turn's arrival and the next turn's."""
    long_doc_pool: int = 64
    """Distinct long documents (0: every long request has its own document)."""
    long_doc_zipf: float = 0.6
    question_len: LogNormalLength = field(default_factory=lambda: LogNormalLength(80, 0.6, 8, 1024))
    max_input_len: int = 131_072
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        checks = [
            (self.duration_s > 0 and math.isfinite(self.duration_s), "duration_s must be > 0"),
            (self.rate > 0 and math.isfinite(self.rate), "rate must be > 0 req/s"),

            (0 <= self.long_share <= 1, "long_share must be in [0, 1]"),
            (0 <= self.system_prompt_share <= 1, "system_prompt_share must be in [0, 1]"),
            (0 <= self.session_share <= 1, "session_share must be in [0, 1]"),
            (2 <= self.mean_turns < math.inf, "mean_turns must be finite and >= 2"),
            (self.think_time_s > 0, "think_time_s must be > 0"),
            (0 <= self.system_prompt_zipf < math.inf and 0 <= self.long_doc_zipf < math.inf,
             "system_prompt_zipf and long_doc_zipf must be finite and >= 0"),
            (0 <= self.n_system_prompts <= MAX_POOL and 0 <= self.long_doc_pool <= MAX_POOL,
             f"n_system_prompts and long_doc_pool must be in [0, {MAX_POOL:,}]"),
            (1 <= self.max_input_len <= MAX_TOKENS,
             f"max_input_len must be in [1, {MAX_TOKENS:,}]"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.duration_s <= MAX_SPAN_S, f"duration_s must be at most {MAX_SPAN_S:g} s"),
            (self._segment_count() <= MAX_SEGMENTS,
             f"the phases cycle into more than {MAX_SEGMENTS:,} segments over duration_s; "
             "make them longer"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidInput(f"SyntheticConfig: {msg}")
        # After the checks above: the count needs a finite rate, duration and phases.
        expected = self.expected_requests()
        if expected > MAX_REQUESTS:
            shown = f"{expected:,.0f}" if expected < 1e15 else f"{expected:.3g}"
            raise InvalidInput(
                f"SyntheticConfig: rate {self.rate:g} req/s over duration_s {self.duration_s:g}"
                f" s, phase multipliers included, makes about {shown} requests; at most "
                f"{MAX_REQUESTS:,} requests are allowed")

    def expected_requests(self) -> float:
        """Requests the workload has in steady state: ``rate`` × the integral of the phases'
        multipliers over ``duration_s`` (the generator draws conversation starts so that the
        request rate, follow-ups included, is rate × multiplier; the drawn count varies
        around this)."""
        if not self.phases:
            return self.rate * self.duration_s
        cycle = sum(p.duration_s for p in self.phases)
        full = math.floor(self.duration_s / cycle)
        total = full * sum(p.duration_s * p.rate_multiplier for p in self.phases)
        rest = self.duration_s - full * cycle
        for p in self.phases:
            if rest <= 0:
                break
            total += min(rest, p.duration_s) * p.rate_multiplier
            rest -= p.duration_s
        return self.rate * total

    def _segment_count(self) -> float:
        """How many phase segments :meth:`segments` makes (checked before it loops)."""
        if not self.phases or not (0 < self.duration_s < math.inf):
            return 1
        cycle = sum(p.duration_s for p in self.phases)
        return math.ceil(self.duration_s / cycle) * len(self.phases)

    def phase_at(self, t: float) -> Phase:
        """The phase in force at time ``t`` (s) of the cycled schedule."""
        if not self.phases:
            return Phase(self.duration_s, 1.0, self.long_share)
        cycle = sum(p.duration_s for p in self.phases)
        x = t % cycle
        for p in self.phases:
            if x < p.duration_s:
                return p
            x -= p.duration_s
        return self.phases[-1]

    def segments(self) -> list[tuple[float, float, Phase]]:
        """(start, end, phase) pieces covering [0, duration_s)."""
        if not self.phases:
            return [(0.0, self.duration_s, self.phase_at(0.0))]
        out: list[tuple[float, float, Phase]] = []
        t, i = 0.0, 0
        while t < self.duration_s:
            p = self.phases[i % len(self.phases)]
            end = min(t + p.duration_s, self.duration_s)
            out.append((t, end, p))
            t, i = end, i + 1
        return out

    def long_share_of(self, phase: Phase) -> float:
        return self.long_share if phase.long_share is None else phase.long_share

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _zipf_probs(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return w / w.sum()


class _Stream:
    """One conversation's append-only token stream and its full blocks' chained ids.

    Block j's content key is ("sys", k, j) while it lies wholly inside system prompt k, and
    ("conv", id, j) from the first block that holds conversation tokens on; chaining over the
    parent makes every later id conversation-specific.
    """

    def __init__(self, key: Any, prefix_key: Any | None, prefix_len: int, block_size: int):
        self.key = key
        self.prefix_key = prefix_key
        self.prefix_blocks = prefix_len // block_size if prefix_key is not None else 0
        self.block_size = block_size
        self.hashes: list[int] = []

    def ids_for(self, length: int) -> tuple[int, ...]:
        need = length // self.block_size
        parent = self.hashes[-1] if self.hashes else 0
        for j in range(len(self.hashes), need):
            key = (self.prefix_key, j) if j < self.prefix_blocks else (self.key, j)
            parent = chain_hash(parent, key)
            self.hashes.append(parent)
        return tuple(self.hashes[:need])


def generate(
    config: SyntheticConfig | None = None, *, seed: int = 0, name: str = "synthetic"
) -> Workload:
    """Generate the synthetic workload for ``config`` (default: :class:`SyntheticConfig()`)."""
    cfg = config or SyntheticConfig()
    rng = np.random.default_rng(seed)
    bsz = cfg.block_size
    sys_lens = [cfg.system_prompt_len.sample(rng) for _ in range(cfg.n_system_prompts)]
    sys_p = _zipf_probs(cfg.n_system_prompts, cfg.system_prompt_zipf) if sys_lens else None
    doc_lens = [cfg.long_len.sample(rng) for _ in range(cfg.long_doc_pool)]
    doc_p = _zipf_probs(cfg.long_doc_pool, cfg.long_doc_zipf) if doc_lens else None
    # (arrival, input_len, output_len, stream, session id)
    draft: list[tuple[float, int, int, _Stream, str | None]] = []
    conv = 0
    for start, end, phase in cfg.segments():
        long_share = cfg.long_share_of(phase)
        per_start = long_share + (1 - long_share) * (1 + cfg.session_share * (cfg.mean_turns - 1))
        start_rate = cfg.rate * phase.rate_multiplier / per_start
        if start_rate <= 0:
            continue
        t = start + rng.exponential(1.0 / start_rate)
        while t < end:
            conv += 1
            if rng.random() < long_share:
                if doc_lens:
                    d = int(rng.choice(len(doc_lens), p=doc_p))
                    doc_key, doc_len = ("doc", d), doc_lens[d]
                else:
                    doc_key, doc_len = ("doc-own", conv), cfg.long_len.sample(rng)
                q = cfg.question_len.sample(rng)
                length = min(doc_len + q, cfg.max_input_len)
                stream = _Stream(("long", conv), doc_key, doc_len, bsz)
                draft.append((t, length, cfg.output_len.sample(rng), stream, None))
            else:
                if sys_lens and rng.random() < cfg.system_prompt_share:
                    k = int(rng.choice(len(sys_lens), p=sys_p))
                    sp_key, sp_len = ("sys", k), sys_lens[k]
                else:
                    sp_key, sp_len = None, 0
                stream = _Stream(("conv", conv), sp_key, sp_len, bsz)
                length = min(sp_len + cfg.short_len.sample(rng), cfg.max_input_len)
                out = cfg.output_len.sample(rng)
                if rng.random() < cfg.session_share:
                    turns = 2 + int(rng.geometric(1.0 / (cfg.mean_turns - 1))) - 1
                    session = f"s{conv}"
                else:
                    turns, session = 1, None
                at = t
                for turn in range(turns):
                    if turn > 0:
                        at += rng.exponential(cfg.think_time_s)
                        length = min(length + out + cfg.turn_len.sample(rng), cfg.max_input_len)
                        out = cfg.output_len.sample(rng)
                    if at >= cfg.duration_s:
                        break
                    draft.append((at, length, out, stream, session))
            t += rng.exponential(1.0 / start_rate)
    # Hash ids after sorting, so each stream is extended in arrival order of its turns.
    draft.sort(key=lambda d: d[0])
    width = max(6, len(str(len(draft))))
    reqs = [
        Request(f"{name}-{i:0{width}d}", at, length, out, stream.ids_for(length), session)
        for i, (at, length, out, stream, session) in enumerate(draft)
    ]
    meta = {"format": "synthetic", "seed": seed, "config": cfg.as_dict()}
    return Workload(name, tuple(reqs), bsz, meta)


def phase_table(config: SyntheticConfig | None = None) -> list[dict[str, float]]:
    """The schedule as data: start, end, request rate and long share of each segment."""
    cfg = config or SyntheticConfig()
    return [
        {
            "start_s": a,
            "end_s": b,
            "rate": cfg.rate * p.rate_multiplier,
            "long_share": cfg.long_share_of(p),
        }
        for a, b, p in cfg.segments()
    ]


def steady(duration_s: float, rate: float, long_share: float, **kw: Any) -> SyntheticConfig:
    """A config with one steady phase (no load changes)."""
    return SyntheticConfig(duration_s=duration_s, rate=rate, long_share=long_share, phases=(), **kw)


SHORT_BLOCK_SIZE: Final[int] = 16
"""Block size of the short-prompt preset: prompts of tens to a few hundred tokens share
prefixes at a granularity a 512-token block would hide."""


def short_prompts(
    duration_s: float = 240.0,
    rate: float = 1.0,
    *,
    phases: tuple[Phase, ...] = DEFAULT_PHASES,
    **kw: Any,
) -> SyntheticConfig:
    """The short-prompt preset (``vertumnus up --backend torch`` default, workload name
    ``synthetic-short``): the default's structure — shared system prompts, multi-turn
    sessions, a pool of recurring "documents", load phases (``phases`` rescaled to fill
    ``duration_s``) — at lengths a CPU engine serves in milliseconds: system prompts
    32–160 tokens, first turns ~48, follow-ups ~24, documents 200–400, every prompt
    ≤ 512 tokens, blocks of :data:`SHORT_BLOCK_SIZE`. ``kw`` overrides any field.
    """
    if phases:
        k = duration_s / sum(p.duration_s for p in phases)
        phases = tuple(Phase(p.duration_s * k, p.rate_multiplier, p.long_share) for p in phases)
    base: dict[str, Any] = {
        "duration_s": duration_s,
        "rate": rate,
        "phases": phases,
        "short_len": LogNormalLength(48, 0.7, 4, 256),
        "long_len": LogNormalLength(280, 0.25, 200, 400),
        "output_len": LogNormalLength(16, 0.7, 1, 64),
        "n_system_prompts": 4,
        "system_prompt_len": LogNormalLength(80, 0.5, 32, 160),
        "turn_len": LogNormalLength(24, 0.6, 4, 96),
        "think_time_s": 8.0,
        "long_doc_pool": 8,
        "question_len": LogNormalLength(16, 0.5, 4, 64),
        "max_input_len": 512,
        "block_size": SHORT_BLOCK_SIZE,
    }
    base.update(kw)
    return SyntheticConfig(**base)


TOOL_AGENT_NAME: Final[str] = "tool-agent-shaped"
"""The workload name (and request-id prefix) of :data:`TOOL_AGENT_SHAPED`: the same as the file
``docs/workloads/tool-agent-shaped.toml`` gives it, so both generate the same requests."""

TOOL_AGENT_SHAPED: Final[SyntheticConfig] = SyntheticConfig(
    duration_s=600.0,
    rate=10.0,
    long_share=0.02,
    phases=(),
    n_system_prompts=20,
    system_prompt_len=LogNormalLength(6000, 0.3, 2048, 16384),
    system_prompt_share=0.95,
    system_prompt_zipf=1.0,
    short_len=LogNormalLength(800, 0.8, 32, 8192),
    session_share=0.5,
    mean_turns=5.0,
    turn_len=LogNormalLength(500, 0.8, 8, 4096),
    think_time_s=8.0,
)
"""A stand-in for the shape of Mooncake's Tool-Agent trace (the paper's §9.4 workload, not
shipped), as the paper describes it — "recurring system and tool prefixes", mean input ~8.6K
tokens: 95% of conversations start with one of 20 tool prefixes of ~6K tokens, half are agent
loops of ~5 turns 8 s apart, 2% are long documents; one steady phase of 10 req/s for 600 s.
The cache ablation's default workload (``sim/presets.py``); ``docs/workloads/
tool-agent-shaped.toml`` is the same as a file to edit."""


__all__: Sequence[str] = (
    "TOOL_AGENT_NAME",
    "TOOL_AGENT_SHAPED",
    "DEFAULT_PHASES",
    "SHORT_BLOCK_SIZE",
    "LogNormalLength",
    "Phase",
    "SyntheticConfig",
    "generate",
    "phase_table",
    "short_prompts",
    "steady",
)
