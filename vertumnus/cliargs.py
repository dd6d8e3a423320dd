"""Option parsing shared by the CLI's commands: one error line, exit status 2.

Every check here runs before a command starts its work, so that bad input costs nothing and
leaves nothing half-written: a list option's entries, a seed, a file the command reads and a
file or directory it writes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import typer

from shared.ids import InvalidInput

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

    from shared.slo import SloTable

T = TypeVar("T", int, float, str)


def fail(msg: str, code: int = 2) -> NoReturn:
    """Print ``error: msg`` on stderr and exit with ``code`` (2: a usage error)."""
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def comma_list(text: str, name: str, conv: Callable[[str], T], kind: str, *,
               valid: Callable[[T], bool] | None = None, need: str = "at least one value",
               unique: bool = False) -> tuple[T, ...]:
    """``--name``'s comma-separated values converted by ``conv`` (each entry stripped of
    blanks first), in the order given; refuses no value at all, an empty entry (``a,,b``,
    ``a,``: a typo, not a value to skip), a value that does not convert (naming ``kind``),
    one that ``valid`` rejects (saying what it ``need``s) and, with ``unique``, a value given
    twice (compared after conversion: ``1`` and ``1.0`` are the same number)."""
    if not text.strip():
        fail(f"--{name} needs {need}, got {text!r}")
    entries = [x.strip() for x in text.split(",")]
    if not all(entries):
        fail(f"--{name} has an empty entry in {text!r}")
    try:
        vals = tuple(conv(x) for x in entries)
    except ValueError:
        fail(f"--{name} must be comma-separated {kind}, got {text!r}")
    if valid is not None and not all(valid(v) for v in vals):
        fail(f"--{name} needs {need}, got {text!r}")
    if unique:
        twice = [v for i, v in enumerate(vals) if v in vals[:i]]
        if twice:
            fail(f"--{name} repeats {', '.join(map(str, dict.fromkeys(twice)))}, got {text!r}")
    return vals


def check_seed(seed: int, name: str = "seed") -> int:
    """``--name`` as a random seed: an integer >= 0 (what numpy's generators take); else
    exits 2 naming the option."""
    if seed < 0:
        fail(f"--{name} must be an integer >= 0, got {seed}")
    return seed


# The lower bound of each weight of J, for the message only: the check itself is
# services.scheduler.placement.check_weights, the scheduler's own (§5.3).
_J_WEIGHT_MIN = {"beta": 1.0, "lam": 0.0}


def j_weight(value: float, name: str, *, default: float | None = None) -> float:
    """``--beta`` or ``--lam`` (``name``) as a weight of J: a value the scheduler takes
    (:func:`services.scheduler.placement.check_weights`: β >= 1, λ >= 0, finite) or the
    option's documented ``default`` sentinel (e.g. -1: the calibrated default), returned as
    given. Anything else exits 2 naming the option and the bound, before any run."""
    from services.scheduler.placement import check_weights
    from shared.ids import InvalidInput

    if default is not None and value == default:
        return value
    try:
        if name == "beta":
            check_weights(value, 0.0)
        else:
            check_weights(1.0, value)
    except InvalidInput:
        also = "" if default is None else f"{default:g} (the calibrated default) or "
        fail(f"--{name} must be {also}a finite number >= {_J_WEIGHT_MIN[name]}, "
             f"got {value:g}")
    return value


def beta_busy_option(value: float) -> float | None:
    """``--beta-busy-power``: k of J's busy-share β, a finite number >= 0 (0: β fixed, the
    paper's form; :func:`services.scheduler.placement.check_beta_busy`), or -1 for the
    calibrated default (None). Else exits 2."""
    from services.scheduler.placement import check_beta_busy
    from shared.ids import InvalidInput

    if value == -1.0:
        return None
    try:
        check_beta_busy(value)
    except InvalidInput:
        fail(f"--beta-busy-power must be a finite number >= 0 (0: β fixed; -1: the calibrated "
             f"default), got {value:g}")
    return value


def beta_queue_option(value: float) -> float:
    """``--beta-queue-scale``: τ of J's queue-following β, a finite number of seconds >= 0 (0:
    off; :func:`services.scheduler.placement.check_beta_queue`). Else exits 2."""
    from services.scheduler.placement import check_beta_queue
    from shared.ids import InvalidInput

    try:
        check_beta_queue(value)
    except InvalidInput:
        fail(f"--beta-queue-scale must be a finite number of seconds >= 0 (0: off), "
             f"got {value:g}")
    return value


def _kind(path: Path, option: str | None = None) -> str | None:
    """:func:`shared.files.path_kind` of ``path``; a path that cannot be looked at exits 2
    naming ``option`` (None: returns None for the caller to say)."""
    from shared.files import path_kind
    from shared.ids import InvalidInput

    try:
        return path_kind(path, option or "path")
    except InvalidInput as exc:
        if option is None:
            return None
        fail(str(exc))


def _dir_problem(directory: Path) -> str | None:
    """Why files cannot be written in ``directory``, created first (with its parents) if
    missing; None when they can. Creating it is the only reliable test: a path under /proc
    or on a read-only mount looks fine until then."""
    kind = _kind(directory)
    if kind is None:
        return "cannot be looked at (permission denied on a parent directory?)"
    if kind not in ("missing", "dir"):
        return "exists and is not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, a read-only or virtual file system, …
        return f"cannot be created ({exc.strerror or exc})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def _refuse_empty(label: str, text: str, what: str) -> None:
    """Exit 2 when ``text``, given for ``label`` (an option or argument naming a ``what``:
    "file" or "directory"), is empty or blank."""
    if not text.strip():
        here = "; '.' for the current directory" if what == "directory" else ""
        fail(f"{label} {text!r}: an empty path names no {what} (give one{here})")


def path_option(label: str, what: str = "file") -> Callable[[str | Path], Path]:
    """A typer ``parser`` for the path option or argument ``label`` (``--json``, ``FILE``)
    naming a ``what`` ("file" or "directory"): its text as a path; an empty or blank one
    exits 2. ``Path("")`` is ``.``, the current directory: a directory option would scatter
    its files there, and a file option would fail later naming ``.``, not what was typed
    (an unset shell variable, most likely). ``.`` names the current directory on purpose."""

    def parse(text: str | Path) -> Path:
        if isinstance(text, Path):  # a default, already a path
            return text
        _refuse_empty(label, text, what)
        return Path(text)

    return parse


def text_path_option(label: str) -> Callable[[str], str]:
    """:func:`path_option` for an option whose text is a path or a name (``--trace``:
    'synthetic' or a file): the text itself, refused when empty or blank."""

    def parse(text: str) -> str:
        _refuse_empty(label, text, "file")
        return text

    return parse


out_option = path_option("--out", "directory")
"""``--out``'s parser (:func:`path_option`): an empty path would write into the current
directory."""


def output_dir(path: Path, name: str = "out") -> Path:
    """The directory ``--name`` writes into: created if missing (with its parents), and
    writable. Exits 2 naming the option, the path and the problem when it is a file, cannot
    be created or is not writable. Call it after the cheap checks, before the long work: it
    creates the directory."""
    p = Path(path)
    why = _dir_problem(p)
    if why is not None:
        fail(f"--{name} {p}: {why}")
    return p


@contextlib.contextmanager
def writing_into(path: Path, name: str = "out") -> Iterator[Path]:
    """:func:`output_dir` for the run in the block, which writes there. Bad input the run
    finds before writing (a trace that does not parse, say: raised as InvalidInput) takes
    the directory away again when the check created it and it is still empty, so that a
    refused run leaves nothing behind. A write that fails once the work is done (a path
    taken by a directory, a full disk) exits 1 naming the file, instead of a traceback."""
    p = Path(path)
    made = _kind(p) == "missing"
    output_dir(p, name)
    try:
        yield p
    except InvalidInput:
        if made:
            with contextlib.suppress(OSError):
                p.rmdir()  # only when empty
        raise
    except OSError as exc:
        # A rename's target is its second file name (shared/files.py write_text_atomic).
        name_ = exc.filename2 or exc.filename
        where = f" {name_}" if name_ else ""
        fail(f"--{name} {p}: cannot write{where}: {exc.strerror or exc}", 1)


def output_file(path: Path, name: str) -> Path:
    """A file ``--name`` will write: not a directory, writable if it exists, and in a
    directory that exists (created if missing, with its parents) and is writable. Exits 2
    naming the option, the path and the problem. The file itself is not created."""
    p = Path(path)
    kind = _kind(p, f"--{name}")
    if kind == "dir":
        fail(f"--{name} {p}: is a directory, not a file")
    if kind != "missing" and not os.access(p, os.W_OK):
        fail(f"--{name} {p}: file is not writable")
    why = _dir_problem(p.parent)
    if why is not None:
        fail(f"--{name} {p}: its directory {p.parent} {why}")
    return p


def input_file(path: Path, name: str) -> Path:
    """A file ``--name`` reads: it exists, is a regular file (not a directory, a device or a
    pipe, which could block) and is readable. Exits 2 naming the option, the path and the
    problem; the content is the caller's to check."""
    p = Path(path)
    what = f"--{name} {p}"
    kind = _kind(p, f"--{name}")
    if kind == "missing":
        fail(f"{what}: no such file")
    if kind == "dir":
        fail(f"{what}: is a directory, not a file")
    if kind != "file":
        fail(f"{what}: not a regular file")
    if not os.access(p, os.R_OK):
        fail(f"{what}: file is not readable")
    return p


def degrees_option(text: str, name: str = "degrees") -> tuple[int, ...]:
    """``--degrees``: integers >= 1, each once, each a CP degree the lattice takes (a power
    of two no larger than a node: :class:`services.controller.lattice.Lattice`, the check a
    simulated pool makes, run here before any work). Exits 2 naming the option."""
    from services.controller.lattice import Lattice
    from shared.ids import InvalidInput

    degs = comma_list(text, name, int, "integers", valid=lambda v: v >= 1,
                      need="integers >= 1", unique=True)
    try:
        # Any pool those degrees tile: only the degree checks can fail for it.
        Lattice(max(degs), degs)
    except InvalidInput as exc:
        fail(f"--{name}: {exc}")
    return degs


def profile_file(path: Path | None, degrees: Sequence[int] | None = None) -> Path | None:
    """``--profile``: a readable profile JSON, loaded once now so that a wrong file (a
    directory, not UTF-8, not JSON, not a profile, no κ for one of ``degrees`` when given: the
    controller would judge that degree's capacity by a placeholder) exits 2 naming it before
    any run."""
    if path is None:
        return None
    from shared.costmodel import Profile
    from shared.ids import InvalidInput

    input_file(path, "profile")
    try:
        Profile.load(path, degrees=degrees)
    except InvalidInput as exc:  # Profile.load's contract: every malformed file is one
        fail(f"--profile: {exc}")
    return path


def nats_settings() -> None:
    """The ``VTM_NATS_*`` credentials and TLS settings of this environment, checked as every
    service and ``up`` check theirs: two ways to authenticate, a missing or unreadable file
    or a file that is no certificate exits 2 naming the setting, before any connection (else
    a tool would report it as a server it cannot reach). Only those settings
    (:func:`shared.natsauth.env_nats_security_options`): the tools that call it (``tap``,
    ``status``, ``replay --nats``) read no other, so another invalid one
    (``VTM_LOG__LEVEL=verbose``) is left to the service that reads it, not reported here as a
    security setting."""
    from shared.ids import InvalidInput
    from shared.natsauth import env_nats_security_options

    try:
        env_nats_security_options()
    except InvalidInput as exc:
        fail(f"NATS security settings: {exc}")


def vtm_environment(own: type[BaseSettings] | None = None) -> None:
    """Exit 2 when this process's environment has a ``VTM_*`` variable that no vertumnus
    process reads (:func:`shared.envcheck.unknown_variables`: a misspelt name, which the
    settings would silently ignore): one ``error:`` line naming each such variable and the
    known name closest to it, as ``up`` and every service refuse it. A variable another
    process reads is no error: one environment serves several processes. ``own``: the
    settings class the command reads (None: the common :class:`~shared.settings.ServiceSettings`,
    whose ``VTM_NATS_*`` the NATS tools read); it only spares imports, the verdict is the
    same for any class.

    Which commands call it: those that read ``VTM_*`` variables -- ``replay``
    (``VTM_API_KEY``, ``VTM_GATEWAY_CA``, with ``--nats`` the ``VTM_NATS_*`` credentials),
    ``tap`` and ``status`` (``VTM_NATS_*``) and ``profile --backend torch`` (rankd's
    ``VTM_TORCH_*``), first thing, before their own checks read a setting. ``up`` refuses
    through its config (vertumnus.live.stack.UpConfig) and the service commands through
    their mains (shared.servicemain), with the same lines. The offline commands (``simulate``,
    ``tune``, ``size``, ``report``, ``profile --backend sim``, ``demo``, ...) do not call it:
    they read no ``VTM_*`` variable, so none can change what they compute, and refusing
    one there would only stop offline work over a name meant for a service -- which that
    service refuses when it starts."""
    from shared.envcheck import unknown_variables
    from shared.settings import ServiceSettings

    stray = unknown_variables(os.environ, ServiceSettings if own is None else own)
    if stray:
        fail("; ".join(stray))


def nats_url_option(url: str, name: str = "nats") -> str:
    """``--nats``: the URL of the NATS server a tool connects to, checked as every service
    checks its ``VTM_NATS_URL`` (:func:`shared.servicemain.check_nats_url`): a scheme of
    nats, tls, ws or wss (none: ``nats://``), a host and a valid port. A malformed one exits 2
    naming the option and the problem (a password in it shown as ***), before any connection:
    else nats-py's parse error would be reported as a server the tool cannot reach, and a
    URL of another scheme (``http://``) be tried as a host for seconds. One server: the
    tools hand the URL to nats-py as it is, which takes no comma-separated list.

    Unlike a service's ``VTM_NATS_URL`` (where ``nats:4222``, compose's host, means
    ``nats://nats:4222``), ``--nats`` needs its scheme: a value typed without one (``bad``,
    ``localhost``) is far likelier a slip than a host name, and would otherwise be tried as one
    for seconds and reported as a server that cannot be reached."""
    from types import SimpleNamespace

    from shared.servicemain import NATS_SCHEMES, SettingProblem, check_nats_url, shown_url

    if "://" not in url:
        fail(f"--{name}: {shown_url(url)!r} is not a NATS server URL: it needs a scheme "
             f"({', '.join(s + '://' for s in NATS_SCHEMES)}) and a host, e.g. "
             "nats://127.0.0.1:4222")
    try:  # check_nats_url reads a settings object's nats_servers only
        check_nats_url(SimpleNamespace(nats_servers=[url]))  # type: ignore[arg-type]
    except SettingProblem as exc:
        fail(f"--{name}: {exc.problem}")
    return url


SLO_HELP = ("TTFT deadlines by prompt length: a table name (qwen3-30b-a3b, deepseek-v4-flash: "
            "paper Table 2) or BOUND:SECONDS pairs, e.g. 8192:1,inf:10 (under 8,192 tokens "
            "1 s, else 10 s)")


def slo_table(text: str) -> SloTable:
    """``--slo``'s table (:func:`sim.metrics.parse_slo`); a bad one exits 2 naming why."""
    from shared.ids import InvalidInput
    from shared.slo import parse_slo

    try:
        return parse_slo(text)
    except InvalidInput as exc:
        fail(f"--slo: {exc}")
