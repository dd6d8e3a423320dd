"""The decode role (first decode iteration after a CP prefill) and the KV hand-off.

:func:`decode_step` runs one token through the model over the full KV of the sequence
(prefix + new, as assembled by :meth:`PrefillResult.full_kv`) and returns the next greedy token
and the KV grown by one row. The KV may arrive on any device (the hand-off's bytes decode to
CPU tensors): :func:`kv_to_device` moves it to the model's, where the decode role put it
(``device.decode_device``: the configured ``VTM_TORCH_DEVICE``).

:class:`KVTransport` is the hand-off interface; :class:`InProcessTransport` is the in-process
implementation; :func:`encode_kv_chunks` / :class:`ChunkReassembler` are the chunked-bytes
serialisation a message transport (NATS) carries: each chunk is at most 512 KiB, header
included, so it fits NATS' default 1 MB max payload. :func:`encode_chunks` /
:class:`BlobReassembler` chunk any blob the same way (e.g. exported cache pages,
``kvcache.pages_to_bytes``).

Chunk layout (little endian): magic ``b"VKV1"``, u16 len(request_id), u32 seq, u32 total,
u32 len(payload), request_id (UTF-8), payload. The concatenated payloads of chunks 0..total-1
are one safetensors blob: tensors ``k.{layer}``, ``v.{layer}`` of shape (T, Hkv, D) and
metadata ``{"meta": <JSON>}``.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from services.rankd.engine.attention import masked_attention
from services.rankd.engine.errors import KVFormatError
from services.rankd.engine.model import KVLayers, Qwen3ForCausalLM
from shared.ids import InvalidInput

MAX_CHUNK_BYTES: Final[int] = 512 * 1024
_MAGIC: Final[bytes] = b"VKV1"
_HEADER = struct.Struct("<4sHIII")


@dataclass(frozen=True)
class DecodeResult:
    next_token: int
    logits: Tensor  # (vocab,)
    kv: KVLayers  # per layer (T + 1, Hkv, D)


def kv_to_device(kv: KVLayers, device: torch.device | str) -> KVLayers:
    """``kv`` on ``device``: tensors already there are kept as they are (no copy), the others
    are copied -- KV a rank on another device produced, or the CPU tensors the hand-off's
    bytes decode to. A copy onto a CUDA device is waited for, so that its time is counted by
    whoever called this (the decode role counts it as KV transfer), not by the next kernel."""
    dev = torch.device(device)
    out: KVLayers = []
    moved = False
    for k, v in kv:
        kk, vv = k.to(dev), v.to(dev)  # ``to`` returns the tensor itself when already there
        moved = moved or kk is not k or vv is not v
        out.append((kk, vv))
    if moved and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return out


@torch.no_grad()
def decode_logits(model: Qwen3ForCausalLM, kv: KVLayers, token: int) -> tuple[Tensor, KVLayers]:
    """The tensors of :func:`decode_step`: the logits (vocab,) of ``token`` at position
    T = len(kv) after the cached KV, and the KV grown by one row, all on the model's device.
    ``kv`` may be on any device: it is moved to the model's first (:func:`kv_to_device`)."""
    if len(kv) != model.config.num_hidden_layers:
        raise InvalidInput(f"KV has {len(kv)} layers, model has {model.config.num_hidden_layers}")
    # The hand-off delivers CPU tensors; a model on a GPU cannot cat or attend over them.
    kv = kv_to_device(kv, model.device)
    t = int(kv[0][0].shape[0])
    ids = model.check_request(torch.tensor([token]), t)
    pos = torch.tensor([t], device=model.device)
    k_pos = torch.arange(t + 1, device=model.device)
    h = model.embed(ids)
    out: KVLayers = []
    for i, layer in enumerate(model.model.layers):
        q, k, v = layer.attn_inputs(h, pos)
        kk, vv = torch.cat([kv[i][0], k]), torch.cat([kv[i][1], v])
        out.append((kk, vv))
        h = layer.finish(h, masked_attention(q, kk, vv, pos, k_pos, layer.self_attn.scale))
    return model.logits(model.final_hidden(h)[-1]), out


def decode_step(model: Qwen3ForCausalLM, kv: KVLayers, token: int) -> DecodeResult:
    """One decode iteration: ``token`` at position T = len(kv) after the cached KV (on any
    device, :func:`decode_logits`); the greedy next token, logits and grown KV on the model's
    device."""
    logits, out = decode_logits(model, kv, token)
    return DecodeResult(int(torch.argmax(logits).item()), logits, out)


# --- serialisation -------------------------------------------------------------------------
def kv_to_bytes(kv: KVLayers, meta: dict[str, Any] | None = None) -> bytes:
    tensors = {}
    for i, (k, v) in enumerate(kv):
        tensors[f"k.{i}"] = k.detach().contiguous().cpu()
        tensors[f"v.{i}"] = v.detach().contiguous().cpu()
    return st_save(tensors, metadata={"meta": json.dumps(meta or {}), "layers": str(len(kv))})


def kv_from_bytes(blob: bytes) -> tuple[KVLayers, dict[str, Any]]:
    try:
        tensors = st_load(blob)
        # safetensors.torch.load drops metadata; read it from the header directly.
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + n])
        md = header.get("__metadata__", {})
        layers = int(md["layers"])
        meta = json.loads(md["meta"])
        kv = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(layers)]
    except (SafetensorError, KeyError, ValueError, struct.error) as exc:
        raise KVFormatError(f"malformed KV payload: {exc!r}") from exc
    return kv, meta


def encode_chunks(key: str, blob: bytes, max_chunk: int = MAX_CHUNK_BYTES) -> list[bytes]:
    """Split any ``blob`` into chunks of at most ``max_chunk`` bytes (header included), tagged
    with ``key`` (a request id, or a replication id for exported pages)."""
    rid = key.encode()
    room = max_chunk - _HEADER.size - len(rid)
    if room < 1:
        raise InvalidInput(f"max_chunk {max_chunk} too small for the header")
    parts = [blob[i : i + room] for i in range(0, len(blob), room)] or [b""]
    return [
        _HEADER.pack(_MAGIC, len(rid), s, len(parts), len(p)) + rid + p for s, p in enumerate(parts)
    ]


def encode_kv_chunks(
    request_id: str,
    kv: KVLayers,
    meta: dict[str, Any] | None = None,
    max_chunk: int = MAX_CHUNK_BYTES,
) -> list[bytes]:
    """Serialise ``kv`` into chunks of at most ``max_chunk`` bytes each (header included)."""
    return encode_chunks(request_id, kv_to_bytes(kv, meta), max_chunk)


def parse_chunk(chunk: bytes) -> tuple[str, int, int, bytes]:
    """(request_id, seq, total, payload) of one chunk; :class:`KVFormatError` if malformed."""
    if len(chunk) < _HEADER.size:
        raise KVFormatError("chunk shorter than its header")
    magic, n_id, seq, total, n_pay = _HEADER.unpack_from(chunk)
    if magic != _MAGIC or seq >= total or len(chunk) != _HEADER.size + n_id + n_pay:
        raise KVFormatError("bad chunk header")
    rid = chunk[_HEADER.size : _HEADER.size + n_id].decode()
    return rid, seq, total, chunk[_HEADER.size + n_id :]


class BlobReassembler:
    """Collects chunks of any number of keys, in any order; duplicates are ignored.

    A set is named by its key *and* a ``tag`` the caller gives (the NATS reply inbox of the
    transfer: one per attempt), so a stray or malformed chunk carrying a real request id --
    or an earlier, abandoned attempt of the same request -- never mixes into a transfer.
    Bounded, since a sender may die mid-transfer and bad input may claim any chunk count: a
    set with no new chunk for ``stale_s`` seconds is dropped (checked as chunks arrive), and
    past ``max_pending`` open sets the least recently fed one goes. A chunk whose count
    contradicts its set's raises :class:`KVFormatError` and drops that set.
    """

    def __init__(self, *, max_pending: int = 64, stale_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1 or not stale_s > 0:
            raise InvalidInput("max_pending must be >= 1 and stale_s > 0")
        self.max_pending = max_pending
        self.stale_s = stale_s
        self._clock = clock
        # (key, tag) -> (total, parts by seq, last fed at); least recently fed first.
        self._open: OrderedDict[tuple[str, str], tuple[int, dict[int, bytes], float]] = \
            OrderedDict()
        self.dropped = 0  # sets given up (stale, over max_pending, or contradicted)

    @property
    def pending(self) -> int:
        return len(self._open)

    def add(self, chunk: bytes, tag: str = "") -> tuple[str, bytes] | None:
        """Returns (key, blob) once the set's last missing chunk arrives."""
        rid, seq, total, payload = parse_chunk(chunk)
        now = self._clock()
        opened = self._open
        while opened:  # the least recently fed first: stop at the first fresh one
            first = next(iter(opened))
            if now - opened[first][2] <= self.stale_s:
                break
            del opened[first]
            self.dropped += 1
        name = (rid, tag)
        entry = opened.pop(name, None)
        if entry is None:
            entry = (total, {}, now)
        elif entry[0] != total:
            self.dropped += 1
            raise KVFormatError(f"request {rid}: inconsistent chunk count")
        parts = entry[1]
        parts[seq] = payload
        if len(parts) == total:
            return rid, b"".join(parts[i] for i in range(total))
        opened[name] = (total, parts, now)
        while len(opened) > self.max_pending:
            opened.popitem(last=False)
            self.dropped += 1
        return None


class ChunkReassembler:
    """:class:`BlobReassembler` for KV hand-off chunks: yields decoded KV."""

    def __init__(self, **bounds: Any) -> None:
        self._blobs = BlobReassembler(**bounds)

    @property
    def blobs(self) -> BlobReassembler:
        return self._blobs

    def add(self, chunk: bytes, tag: str = "") -> tuple[str, KVLayers, dict[str, Any]] | None:
        """Returns (request_id, kv, meta) once the request's last missing chunk arrives."""
        done = self._blobs.add(chunk, tag)
        if done is None:
            return None
        kv, meta = kv_from_bytes(done[1])
        return done[0], kv, meta


def decode_kv_chunks(chunks: Iterable[bytes]) -> tuple[str, KVLayers, dict[str, Any]]:
    """Reassemble one request's complete set of chunks."""
    r = ChunkReassembler()
    for c in chunks:
        done = r.add(c)
        if done is not None:
            return done
    raise KVFormatError("incomplete chunk set")


# --- transports -----------------------------------------------------------------------------
class KVTransport(Protocol):
    """Hands a prefilled request's KV (and metadata: first token, positions...) to decode."""

    def send(self, request_id: str, kv: KVLayers, meta: dict[str, Any]) -> None: ...

    def recv(
        self, request_id: str, timeout: float | None = None
    ) -> tuple[KVLayers, dict[str, Any]]:
        """Blocks until the KV of ``request_id`` arrived; TimeoutError after ``timeout`` s."""
        ...


class InProcessTransport:
    """Zero-copy hand-off between threads of one process (tests, single-node dev)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._box: dict[str, tuple[KVLayers, dict[str, Any]]] = {}

    def send(self, request_id: str, kv: KVLayers, meta: dict[str, Any]) -> None:
        with self._cv:
            self._box[request_id] = (kv, dict(meta))
            self._cv.notify_all()

    def recv(
        self, request_id: str, timeout: float | None = None
    ) -> tuple[KVLayers, dict[str, Any]]:
        with self._cv:
            if not self._cv.wait_for(lambda: request_id in self._box, timeout):
                raise TimeoutError(f"no KV for request {request_id}")
            return self._box.pop(request_id)


class ChunkedBytesTransport:
    """The serialised path: ``send`` produces ≤ 512 KiB chunks through ``publish(bytes)``;
    the receiving side feeds every arriving chunk to :meth:`deliver`. With a publish that
    delivers locally this is an in-process loopback of exactly what NATS will carry."""

    def __init__(self, publish: Any = None, max_chunk: int = MAX_CHUNK_BYTES) -> None:
        self._publish = publish or self.deliver
        self._max = max_chunk
        self._asm = ChunkReassembler()
        self._inbox = InProcessTransport()
        self.chunks_sent = 0
        self.largest_chunk = 0

    def send(self, request_id: str, kv: KVLayers, meta: dict[str, Any]) -> None:
        for c in encode_kv_chunks(request_id, kv, meta, self._max):
            self.chunks_sent += 1
            self.largest_chunk = max(self.largest_chunk, len(c))
            self._publish(c)

    def deliver(self, chunk: bytes) -> None:
        done = self._asm.add(chunk)
        if done is not None:
            self._inbox.send(*done)

    def recv(
        self, request_id: str, timeout: float | None = None
    ) -> tuple[KVLayers, dict[str, Any]]:
        return self._inbox.recv(request_id, timeout)
