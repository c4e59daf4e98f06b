"""``--device``: where a process computes, resolved once for training and serving alike.

- ``cpu``: the numpy engine (the reference, every CPU): the default;
- ``cuda``: PyTorch on the first CUDA GPU; PyTorch is an optional extra
  (``pip install 'foundry[gpu]'``), and without it or without a GPU this says so;
- ``auto``: ``cuda`` where PyTorch sees a GPU, else ``cpu``; for training (``training=True``)
  without a GPU, PyTorch on the CPU where it is installed (on all the process's threads it
  trains faster than numpy: docs/gpu.md), numpy where it is not (armv7 has no torch wheel);
  serving keeps the numpy engine, whose kernels read quantized files in place;
- ``torch-cpu``: PyTorch on the CPU, which is how a machine without a GPU (CI) runs the GPU
  path end to end.

``resolve`` answers None for numpy or the torch device to use; ``train.backend.select`` and
``infer.engines.make_engine`` build their backend or engine on it.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["DEVICES", "INSTALL_HINT", "DeviceError", "resolve", "torch_available"]

DEVICES = ("cpu", "cuda", "auto", "torch-cpu")
INSTALL_HINT = "pip install 'foundry[gpu]' (PyTorch with CUDA; see docs/gpu.md)"


class DeviceError(ValueError):
    """The asked-for device cannot be had here; the message says what to do."""


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def resolve(device: str, *, training: bool = False) -> str | None:
    """The torch device (``"cuda"`` or ``"cpu"``) that ``--device`` names, or None for the
    numpy engine; DeviceError says how to get a missing one."""
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")
    if device == "cpu":
        return None
    if not torch_available():
        if device == "auto":
            return None
        raise DeviceError(
            f"--device {device} needs PyTorch, which is not installed: {INSTALL_HINT}"
        )
    import torch

    if device == "torch-cpu":
        if "OMP_NUM_THREADS" not in os.environ:
            # torch's CPU threads spin while they wait: on a shared or loaded host two of them
            # ran `foundry train` 25x slower than one. The CPU path is for checks, not speed.
            torch.set_num_threads(1)
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if device == "auto":
        return "cpu" if training else None
    raise DeviceError(
        f"--device cuda: PyTorch {torch.__version__} sees no CUDA GPU (a CPU-only build, "
        f"or no driver); install a CUDA build ({INSTALL_HINT}) or use --device cpu"
    )
