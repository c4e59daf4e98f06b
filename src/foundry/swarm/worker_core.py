"""What a swarm worker is and holds: its options (``WorkerOptions``, a fine-tuning run's
``BaseFile``), and ``WorkerCore``, the state the link and the computing share: the model, the
weights held and the step they are of, the upload's codec, what the last round measured.

The weights change only here: WEIGHTS_META + WEIGHTS replace them, UPDATE adds to them
(``swarm.sync``: the worker then holds bit for bit what the coordinator expects, and says so
with WEIGHTS_DIGEST every few steps). With ``--overlap`` a local round may start ahead of the
UPDATE of the round before, from the held weights minus this worker's own last
pseudo-gradient (``round_start``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundry.compression import Compressor, deserialize_tensors
from foundry.hardware import HardwareInfo, detect_profile
from foundry.model.formats.tuning import FileIdentity
from foundry.model.spec.config import ModelConfig
from foundry.model.text.data import Corpus
from foundry.model.train.backend import NUMPY, Backend
from foundry.model.train.training import Params
from foundry.obs.metrics import WorkerMetrics
from foundry.obs.timeline import Timeline, now_us
from foundry.swarm import sync
from foundry.transport.fdtc_stream import FdtcStream
from foundry.transport.stream import LINK_DEAD_AFTER_S
from foundry.wire import fdtc
from foundry.wire.fdtc import Compression, ErrorCode

log = logging.getLogger("foundry.worker")

HEARTBEAT_INTERVAL_S = 0.5


class Refused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerOptions:
    host: str
    port: int
    worker_id: str
    hardware: HardwareInfo
    slowdown: float = 1.0  # >1 makes this worker that many times slower (benchmarks, tests)
    backoff_cap_s: float = 10.0
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    max_attempts: int = 0  # 0 = reconnect forever
    tls: ssl.SSLContext | None = None  # dial the coordinator over TLS (transport.tls)
    # The link fails within this many seconds of the coordinator's host going silent
    # (transport.stream.watch_liveness); the worker then reconnects.
    link_timeout_s: float = LINK_DEAD_AFTER_S
    # Where gradients are computed (``--device``): numpy on this CPU, or PyTorch on a GPU.
    backend: Backend = NUMPY
    # GRADIENTS over this many bytes go up as FRAGMENT frames of this size.
    fragment_size: int = fdtc.FRAGMENT_SIZE
    # Fine-tuning (``--base-model``): this machine's copy of the base file.
    base: BaseFile | None = None


@dataclass(frozen=True)
class BaseFile:
    """A fine-tuning worker's base model: the file's identity and architecture (BASE_MODEL
    states them), its config, and the base loaded for training (a ``finetune.Base``), or None
    where PyTorch is missing (the coordinator then refuses the worker, saying so)."""

    identity: FileIdentity
    architecture: str
    cfg: ModelConfig
    loaded: Any = None


def hardware_for(profile_name: str | None) -> HardwareInfo:
    """The detected hardware, or a named profile forced with ``--profile``."""
    detected = detect_profile()
    if profile_name is None:
        return detected
    for p in fdtc.HardwareProfile:
        if profile_name.lower() in (fdtc.profile_name(p).lower(), p.name.lower()):
            return HardwareInfo(
                profile=p,
                cores=detected.cores,
                memory_mb=detected.memory_mb,
                description=f"forced profile {fdtc.profile_name(p)}",
            )
    names = ", ".join(p.name.lower() for p in fdtc.HardwareProfile)
    raise ValueError(f"unknown profile {profile_name!r}; choose one of: {names}")


class WorkerCore:
    """The state the worker's link (``worker.Worker``) and its computing
    (``worker_compute.Compute``) share, and the weights it holds."""

    def __init__(
        self, options: WorkerOptions, corpus: Corpus, timeline: Timeline | None = None
    ) -> None:
        self.opt = options
        self.corpus = corpus
        self.metrics = WorkerMetrics()
        self.metrics.info.labels(
            worker=options.worker_id,
            profile=fdtc.profile_name(options.hardware.profile).lower(),
        ).set(1)
        self.timeline = timeline or Timeline(None, "worker")
        self.idle_since_us: int | None = None  # end of the last send: the "wait" span starts
        self.cfg: ModelConfig | None = None
        self.backend: Backend = options.backend  # a fine-tuning run's, once BASE_MODEL came
        self.aux_loss_coef = 0.0
        self.params: Params | None = None
        self.global_step = 0
        self.compression = Compression.NONE
        self.topk_ratio = 0.01
        self.uplink: Compressor | None = None
        self.plan: fdtc.TrainPlan | None = None
        self.weights_step = -1  # global step of the weights held; -1: none
        # The inner optimizer of local-step rounds (the backend's), kept across them.
        self.inner: Any = None
        # This worker's last pseudo-gradient (exact) and the step its round started at, until
        # an UPDATE from that step on shows it merged into the held weights. With --overlap the
        # next LOCAL_ASSIGN comes first: it starts from the held weights minus this.
        self.unmerged: tuple[int, Params] | None = None
        self.trained_ahead = False  # logged once
        self.inner_steps_done = 0
        self.last_loss = float("nan")
        self.rate = 0.0
        self.samples_done = 0
        self.paused = False
        self.cannot_train: str | None = None  # why an assignment could not be trained on
        self.rng = random.Random(hash(options.worker_id))

    def load_weights(self, meta: fdtc.WeightsMeta, weights: fdtc.Weights) -> None:
        assert self.cfg is not None
        shapes = self.cfg.param_shapes()
        names = [t.name for t in meta.tensors]
        got = [tuple(t.shape) for t in meta.tensors]
        if (
            names != list(shapes)
            or got != [tuple(s) for s in shapes.values()]
            or any(t.dtype is not fdtc.DType.F32 for t in meta.tensors)
        ):
            raise Refused(
                int(ErrorCode.MODEL_MISMATCH),
                "WEIGHTS_META names tensors, shapes or types this worker's model does not have",
            )
        # Views of the received payload, not copies (``weights_tensors`` checks its size
        # against WEIGHTS_META): the decoder gave this message a buffer of its own, and an
        # UPDATE makes new arrays rather than writing into these (a big-endian host copies,
        # to swap bytes).
        params: Params = {
            name: t.astype(np.float32, copy=False)
            for name, t in fdtc.weights_tensors(meta, weights).items()
        }
        self.params = params
        self.global_step = meta.global_step
        self.weights_step = meta.global_step
        if self.unmerged is not None and meta.global_step > self.unmerged[0]:
            self.unmerged = None
        self.metrics.weight_bytes.labels(kind="full").inc(len(weights.data))

    async def apply_update(self, stream: FdtcStream, update: fdtc.Update) -> None:
        """Add an UPDATE to the held weights, as new arrays (a computation in a thread may
        still read the old ones); out of step, ask for full weights instead."""
        self.metrics.weight_bytes.labels(kind="update").inc(len(update.data))
        if self.params is not None:  # its sizes, on receipt, whatever step it is for
            update.check_tensors([t.size for t in self.params.values()])
        if self.params is None or update.base_step != self.weights_step:
            log.info(
                "UPDATE for step %d while holding step %d; asking for full weights",
                update.base_step,
                self.weights_step,
            )
            self.weights_step = -1
            await stream.send(fdtc.WeightsReq())
            return
        params = self.params
        names = list(params)
        start_us = now_us()
        tensors = deserialize_tensors(
            update.data, [params[k].size for k in names], Compression(update.compression)
        )
        self.params = {
            k: params[k] + t.reshape(params[k].shape) for k, t in zip(names, tensors, strict=True)
        }
        self.timeline.span("update", start_us, step=update.global_step, bytes=len(update.data))
        self.weights_step = self.global_step = update.global_step
        if self.unmerged is not None and update.base_step >= self.unmerged[0]:
            self.unmerged = None  # that round is in the weights now
        every = self.plan.digest_every if self.plan is not None else 0
        if sync.digest_due(update.base_step, update.global_step, every):
            digest = await asyncio.to_thread(sync.weights_digest, self.params, names)
            await stream.send(fdtc.WeightsDigest(update.global_step, digest))

    def starts_ahead(self, assign: fdtc.Assign | fdtc.LocalAssign) -> bool:
        """A LOCAL_ASSIGN sent before the UPDATE of the round this worker just trained
        (--overlap): it holds that round's start weights, and its own result is at hand."""
        return (
            isinstance(assign, fdtc.LocalAssign)
            and self.unmerged is not None
            and self.unmerged[0] == self.weights_step < assign.global_step
        )

    def round_start(self, assign: fdtc.LocalAssign) -> Params:
        """The weights a local-step round starts from: the held ones, or ahead of the UPDATE
        the held ones minus this worker's own last pseudo-gradient (its trained weights)."""
        assert self.params is not None
        if not self.starts_ahead(assign):
            self.unmerged = None  # merged, or its round was abandoned
            return self.params
        assert self.unmerged is not None
        if not self.trained_ahead:
            log.info(
                "step %d starts from this worker's own weights of step %d, ahead of "
                "that round's UPDATE (--overlap)",
                assign.global_step,
                self.unmerged[0],
            )
            self.trained_ahead = True
        pseudo = self.unmerged[1]
        return {k: np.subtract(p, pseudo[k]) for k, p in self.params.items()}
