"""The torch device of the engine (``VTM_TORCH_DEVICE``): checked once, before anything is
built, by every process that puts a model on it -- the rank daemons' pool and its decode role
(``torch_backend.TorchPool.start``), ``vertumnus profile --backend torch``
(``profiling.rankd_engine``).

Without the check a bad value failed deep inside torch, and late: ``cuda`` on a machine
without CUDA in a spawned rank's ``torch.cuda.set_device`` (a traceback from the world's
start) or, for the decode role, in the first request's decode step.
"""

from __future__ import annotations

from typing import Final

import torch

from shared.ids import InvalidInput

DEVICES: Final[tuple[str, ...]] = ("cpu", "cuda")
DEVICE_SETTING: Final[str] = "VTM_TORCH_DEVICE"


def check_device(value: object, source: str = DEVICE_SETTING, gpus: range | None = None) -> str:
    """``value`` when it is a device the engine runs on, else :class:`InvalidInput` naming
    ``source`` (the variable or option the value came from): not one of :data:`DEVICES`;
    ``cuda`` with no CUDA device here; ``cuda`` with ``gpus`` (the GPU indices the caller will
    use: global rank r of a pool over ``gpus`` runs on ``cuda:{r + gpus.start}``) not all
    present. Pure but for asking torch about the CUDA devices."""
    if value not in DEVICES:
        raise InvalidInput(f"{source} must be 'cpu' or 'cuda', got {value!r}")
    if value == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInput(f"{source} is cuda, but no CUDA device is available here "
                               "(torch.cuda.is_available() is False); use cpu")
        if gpus is not None and len(gpus):
            n = torch.cuda.device_count()
            if gpus.start < 0 or gpus.stop > n:
                raise InvalidInput(
                    f"{source} is cuda, but GPUs {gpus.start}-{gpus.stop - 1} are not all "
                    f"present here (torch.cuda.device_count() is {n})")
    return str(value)


def decode_device(value: object, gpus: range, source: str = DEVICE_SETTING) -> torch.device:
    """Where the decode role of a pool over ``gpus`` puts its model and the KV it receives:
    ``cuda:{gpus.start}`` (the range's first GPU, the one its global rank 0 runs on) for
    ``cuda``, else the CPU. ``value`` is checked first (:func:`check_device`), so a bad one
    raises :class:`InvalidInput` naming ``source`` before anything is built."""
    if check_device(value, source, gpus) == "cuda":
        return torch.device("cuda", gpus.start)
    return torch.device("cpu")


__all__ = ["DEVICES", "DEVICE_SETTING", "check_device", "decode_device"]
