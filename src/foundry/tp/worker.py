"""A worker rank (rank 1 of the pair, or 1 .. N-1 of a world): dial the leader, agree, then
run every command it mirrors.

One thread does everything: numpy and the gate exchange block it, and there is nothing else to
do while they do. The loop:

1. dial the leader with capped exponential backoff (``transport.backoff``);
2. bring the pair up (``foundry.tp.handshake``): read the leader's hello, which says the world
   (the pair, or N ranks and their shares), ask for a rank (``--rank``, else the one held last,
   else any), load the slices of the rank given (kept while the rank and shares stay), and
   for N > 2 connect the gates to the other workers from the WORLD frame (lower ranks dialed,
   higher ranks accepted on ``--gate-listen``). While the leader's shares are still to be
   chosen (``--shares auto`` or ``ranks``) the hello states this rank's weight (its measured
   speed, ``tp.calibrate``, or its ``--share``); the leader answers with the rank it keeps it
   under and the worker dials again until the shares are chosen. The same identity or version
   mismatch met :data:`MISMATCH_REPEATS` dials in a row ends the process with :data:`EXIT_MISMATCH`
   (dialing again with the same files cannot help); a mismatch met once (one garbage hello,
   a stray process on the port), a busy leader, a refused or broken connection mean "dial
   again";
3. receive commands and run each through :class:`~foundry.tp.lockstep.RankState`, shipping the
   vocabulary half of the logits back after every command that produced some;
4. on any failure (gate, control link, bad bytes, a command that does not fit the session
   table) close both links, forget every session and go back to 1: the leader re-creates the
   sessions it still has. STOP from the leader ends the process with :data:`EXIT_STOPPED`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from foundry.model.formats.gguf_model import GGUFError
from foundry.model.infer.engines import make_engine
from foundry.model.kernels.quant import threads as kernel_threads
from foundry.model.shard.shares import MAX_WORLD, Shares
from foundry.model.shard.table import ExpertSplit, SplitError
from foundry.model.spec.arch import spec as arch_spec
from foundry.obs.metrics import TpMetrics
from foundry.tp.calibrate import rank_speed
from foundry.tp.handshake import (
    ACK_ACCEPTED,
    ACK_BUSY,
    ACK_NOTED,
    ACK_SHM_FAILED,
    DEFAULT_EXPERT_SPLIT,
    RankModel,
    check_replicated,
    exchange_hellos,
    execution_mode,
    expert_split_for,
    header_model,
    load_rank,
    split_of_mode,
    world_shares,
)
from foundry.tp.link import DEFAULT_FRAME_DEADLINE_S, ControlLink, LinkError
from foundry.tp.lockstep import (
    RankState,
)
from foundry.tp.worker_mesh import connect_mesh
from foundry.tp.worker_pair import PAIR_FAILURES, WorkerPair
from foundry.transport.backoff import backoff_delay
from foundry.transport.gates import (
    DEFAULT_GATE_TIMEOUT_S,
    GateError,
    GateExchange,
    ShmGateExchange,
    TcpGateExchange,
    local_host_id,
)
from foundry.transport.tls import PeerContexts, wrap_blocking
from foundry.wire.tp import (
    CommandAck,
    FrameType,
    GateTransport,
    Hello,
    IdentityMismatch,
    RankWeight,
    Role,
    SharesFrom,
    VersionMismatch,
    WorldInfo,
    WorldMismatch,
    encode,
    negotiate_gate_transport,
)

log = logging.getLogger("foundry.tp.worker")

EXIT_STOPPED = 0
EXIT_MISMATCH = 2  # the pair can never form with these files: fix the command line
BACKOFF_BASE_S = 0.05
# The same mismatch, dials in a row, before the worker gives up: a real leader with another
# model answers the same every time; one garbage hello does not end the worker.
MISMATCH_REPEATS = 3
# How soon a worker whose weight the leader keeps dials again (the shares are chosen when the
# last worker's weight is in).
NOTED_RETRY_S = 0.2


@dataclass(frozen=True)
class WorkerOptions:
    model: Path
    leader_host: str = "127.0.0.1"
    leader_port: int = 7090
    ctx_size: int | None = None
    shm: bool = True  # offer the shared-memory data plane (used when on the leader's host)
    gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S
    control_timeout_s: float = 1.0
    handshake_timeout_s: float = 5.0
    retry_max_s: float = 2.0
    # Must equal the leader's (the hello checks); None (--expert-split auto): the leader's.
    expert_split: ExpertSplit | None = DEFAULT_EXPERT_SPLIT
    device: str = "cpu"  # --device: numpy here, or PyTorch on a GPU (model.infer.engines)
    lora: Path | None = None  # a LoRA adapter merged at load (every rank loads the same)
    tls: ssl.SSLContext | None = None  # dial the leader over TLS (control and gate connections)
    # The gate links to the other workers of a world of N > 2 over mutual TLS (the same files
    # as ``tls``; None without all three, and then such a world is refused when ``tls`` is on)
    peer_tls: PeerContexts | None = None
    frame_deadline_s: float = DEFAULT_FRAME_DEADLINE_S
    rank: int | None = None  # --rank: the rank to ask for (None: the next free one)
    # --gate-listen: where a worker of a world of N > 2 takes the gate connections of the
    # ranks above it (port 0: any free one; the leader tells the others which)
    gate_host: str = "0.0.0.0"
    gate_port: int = 0
    # --share: this rank's share, used when the leader runs --shares ranks, checked against
    # the leader's shares otherwise; --speed: the speed stated under --shares auto instead of
    # the one measured (docs/tp.md, "Shares by speed")
    share: int | None = None
    speed: int | None = None


class RankRefused(Exception):
    """This worker's --rank does not fit the leader's world: fix the command line."""


class _Busy(Exception):
    """The leader has a worker already."""


class _Noted(Exception):
    """The leader keeps this worker's weight under a rank until every worker has stated its
    own."""


class Worker(WorkerPair):
    def __init__(
        self,
        options: WorkerOptions,
        model: RankModel | None = None,
        metrics: TpMetrics | None = None,
    ) -> None:
        self.options = options
        if options.rank is not None and options.rank < 1:
            raise ValueError(f"--rank must be >= 1 (rank 0 is the leader), got {options.rank}")
        # The slices are loaded once the leader's hello and answer say the world and the rank
        # (kept across pairings while they stay); the hello needs only the file's header.
        self.model: RankModel | None = model
        if model is None:
            self.cfg, self.identity = header_model(options.model, options.ctx_size, options.lora)
            check_replicated(options.model)  # a damaged file is refused before any dial
        else:
            self.cfg, self.identity = model.cfg, model.identity
        self.rank = options.rank or 1
        self.metrics = metrics or TpMetrics(rank=self.rank)
        self._state: RankState | None = None
        self._kept = {"prefill": 0, "decode": 0}
        # --expert-split auto (None): the leader's, from its last hello; before any hello,
        # what the leader's auto picks for the pair (expert_split_for), worked out once.
        self._leader_split: ExpertSplit | None = None
        self._pair_split: ExpertSplit | None = None
        if model is not None:
            self._load(model.weights.rank, model.weights.world, model.weights.shares)
        self._gate_listener: socket.socket | None = None
        self._world_seen: WorldInfo | None = None  # from the leader's last hello
        self._offer_shm = options.shm
        self._noted = 0  # the rank the leader keeps this worker's weight under (0: none)
        self._speed: int | None = options.speed  # measured at the first hello that states it
        self._stop = threading.Event()
        self.pairs_formed = 0

    @property
    def expert_split(self) -> ExpertSplit:
        """The split this rank cuts by: --expert-split, else (auto) the leader's."""
        if self.options.expert_split is not None:
            return self.options.expert_split
        if self._leader_split is not None:
            return self._leader_split
        if self.model is not None:
            return self.model.weights.expert_split
        if self._pair_split is None:
            self._pair_split = expert_split_for(self.options.model)[0]
        return self._pair_split

    def _load(self, rank: int, world: int, shares: Shares) -> None:
        """Hold rank's slices of a world of ``world`` ranks holding ``shares`` (read from the
        file unless held already) and an engine over them."""
        w = self.model.weights if self.model is not None else None
        split = self.expert_split
        if w is None or (w.rank, w.world, w.shares, w.expert_split) != (
            rank,
            world,
            shares,
            split,
        ):
            log.info(
                "loading rank %d of %d (shares %s, expert split %s) of %s",
                rank,
                world,
                ",".join(map(str, shares)),
                split.value,
                self.options.model,
            )
            self._state = self.model = None  # the old slices go before the new ones come in
            self.model = load_rank(
                self.options.model,
                rank,
                self.options.ctx_size,
                split,
                world,
                shares,
                self.options.lora,
            )
        if self._state is None:
            assert self.model is not None
            weights = self.model.weights
            engine = make_engine(
                self.cfg,
                weights,
                rank=weights.rank,
                world=weights.world,
                ctx_size=self.identity.ctx_size,
                device=self.options.device,
            )
            self._state = RankState(engine, self.identity.ctx_size)
            self._kept = dict(self._state.kept)
        self.rank = rank
        self.metrics.set_rank(rank)

    def request_stop(self) -> None:
        """Leave at the next command boundary (or sync checkpoint, where it asks to cancel)."""
        self._stop.set()

    # -- the dial loop -------------------------------------------------------------------

    def run(self) -> int:
        """Serve until STOP or request_stop (EXIT_STOPPED), or a mismatch (EXIT_MISMATCH)."""
        o = self.options
        attempt = 0
        mismatches: list[str] = []  # the same mismatch, dials in a row
        noted_told = 0  # the rank the last "keeps this worker's weight" line named
        while not self._stop.is_set():
            try:
                link, gate, transport = self._connect()
            except WorldMismatch as exc:
                log.info(
                    "the leader runs another world than this hello said (%s); dialing "
                    "again with it",
                    exc,
                )
                mismatches = []
                continue
            except (IdentityMismatch, VersionMismatch) as exc:
                self.metrics.failures.labels("identity").inc()
                mismatches = [*mismatches, str(exc)] if str(exc) in mismatches else [str(exc)]
                if len(mismatches) >= MISMATCH_REPEATS:
                    log.error(
                        "the leader at %s:%d refused this worker: %s",
                        o.leader_host,
                        o.leader_port,
                        exc,
                    )
                    return EXIT_MISMATCH
                log.error(
                    "the peer at %s:%d does not match this worker: %s; dialing again "
                    "(giving up after %d such answers in a row)",
                    o.leader_host,
                    o.leader_port,
                    exc,
                    MISMATCH_REPEATS,
                )
            except RankRefused as exc:
                log.error("%s", exc)
                return EXIT_MISMATCH
            except (SplitError, GGUFError) as exc:  # its slices cannot be cut from this file
                log.error("cannot load rank %d's slices: %s", self.rank, exc)
                return EXIT_MISMATCH
            except _Noted:
                if self._noted != noted_told:  # said once a rank, not at every dial
                    log.info(
                        "the leader keeps this worker's weight under rank %d until every "
                        "worker has stated its own; dialing again",
                        self._noted,
                    )
                    noted_told = self._noted
                mismatches = []
                self._stop.wait(NOTED_RETRY_S)
                continue
            except _Busy:
                log.warning(
                    "the leader at %s:%d already has a worker%s; dialing again",
                    o.leader_host,
                    o.leader_port,
                    f" of rank {o.rank}" if o.rank else " of every rank",
                )
                self.metrics.failures.labels("busy").inc()
                mismatches = []
            except PAIR_FAILURES as exc:
                mismatches = []
                # A leader that is not up yet is normal at start: say so quietly, then now
                # and then (the delay is capped at retry_max_s, so the log stays readable).
                level = logging.INFO if attempt < 3 else logging.WARNING
                if attempt < 3 or attempt % 30 == 0:
                    log.log(
                        level,
                        "cannot reach the leader at %s:%d (%s); dialing again",
                        o.leader_host,
                        o.leader_port,
                        exc,
                    )
            else:
                attempt = 0
                mismatches = []
                if self._serve(link, gate, transport):
                    return EXIT_STOPPED
                continue
            delay = backoff_delay(attempt, base_s=BACKOFF_BASE_S, cap_s=o.retry_max_s)
            attempt += 1
            self._stop.wait(delay)
        return EXIT_STOPPED

    def _connect(self) -> tuple[ControlLink, GateExchange, GateTransport]:
        o = self.options
        sock = self._dial()
        link = ControlLink(
            sock,
            timeout_s=o.handshake_timeout_s,
            expect_hello=True,
            frame_deadline_s=o.frame_deadline_s,
        )
        link.deadline = time.monotonic() + 2 * o.handshake_timeout_s
        gate: GateExchange | None = None
        gsock: socket.socket | None = None
        try:
            mine = self._hello()
            # The worker receives no LOGITS: the leader's frames bound its decoder.
            peer = exchange_hellos(link, mine, max_rows=1, on_peer=self._learn_world)
            world, shares = (
                (2, (1, 1))
                if peer.world is None
                else (peer.world.world_size, world_shares(peer.world))
            )
            transport = negotiate_gate_transport(mine, peer)
            ack = link.expect(FrameType.COMMAND_ACK, "the leader's answer to the hello")
            assert isinstance(ack, CommandAck)
            if ack.status == ACK_BUSY:
                raise _Busy
            if ack.status == ACK_NOTED and mine.weight is not None:
                self._noted = ack.session_id
                raise _Noted
            if ack.status != ACK_ACCEPTED:
                raise LinkError(f"the leader answered the hello with status {ack.status}")
            rank = 1 if peer.world is None else ack.session_id
            asked = 1 if mine.world is None else mine.world.rank
            if not 1 <= rank < world or (asked and rank != asked):
                raise LinkError(f"the leader gave rank {rank} of {world}, asked for {asked}")
            if o.share is not None and not self._noted and shares[rank] != o.share:
                raise RankRefused(
                    f"--share {o.share} conflicts with the leader's shares "
                    f"{','.join(map(str, shares))}, which give rank {rank} {shares[rank]}: the "
                    "leader's list wins; drop --share, or start the leader with --shares ranks"
                )
            self._load(rank, world, shares)
            if transport is GateTransport.SHM:
                try:
                    gate = ShmGateExchange.attach(
                        peer.shm_name,
                        n_embd=self.identity.n_embd,
                        rank=1,
                        timeout_s=o.gate_timeout_s,
                    )
                except GateError:
                    link.send(CommandAck(status=ACK_SHM_FAILED))
                    self._offer_shm = False
                    raise
            else:
                gsock = self._dial()
                try:
                    gsock.sendall(encode(CommandAck(status=ACK_ACCEPTED, seq=ack.seq)))
                except OSError:
                    gsock.close()
                    raise
                if world == 2:
                    gate, gsock = (
                        TcpGateExchange(
                            gsock, rank=1, n_embd=self.identity.n_embd, timeout_s=o.gate_timeout_s
                        ),
                        None,
                    )
            link.send(CommandAck(status=ACK_ACCEPTED))
            if world > 2:
                assert gsock is not None
                assert self._gate_listener is not None
                gate = connect_mesh(
                    link,
                    gsock,
                    self._gate_listener,
                    rank=rank,
                    world=world,
                    n_embd=self.identity.n_embd,
                    peer_tls=o.peer_tls,
                    handshake_timeout_s=o.handshake_timeout_s,
                    gate_timeout_s=o.gate_timeout_s,
                    stop=self._stop,
                )
                gsock = None
            link.deadline = None
            link.set_timeout(o.control_timeout_s)
            assert gate is not None
        except BaseException:
            if gate is not None:
                gate.close()
            if gsock is not None:
                gsock.close()
            link.close()
            raise
        return link, gate, transport

    def _hello(self) -> Hello:
        """Our hello: the world extension once the leader's hello has told us the world (the
        first is plain), asking for ``--rank``, else the rank held last, else any; with it the
        threads this rank computes on (the kernels' pool, as the leader counts its own)."""
        world: WorldInfo | None = None
        weight: RankWeight | None = None
        seen = self._world_seen
        if seen is not None:
            n = seen.world_size
            held = self.model is not None and self.model.weights.world == n
            asked = self.options.rank or self._noted or (self.rank if held else 0)
            port = self._listen_gates()[1] if n > 2 else 0
            world = WorldInfo(
                world_size=n,
                shares=seen.shares,
                rank=asked,
                gate_port=port,
                shares_from=seen.shares_from,
            )
            if seen.pending:
                weight = RankWeight(
                    share=self.options.share or 0,
                    speed=self._my_speed() if seen.shares_from is SharesFrom.SPEED else 0,
                )
        return Hello(
            role=Role.WORKER,
            identity=self.identity,
            host_id=local_host_id(),
            shm_offered=self._offer_shm and (world is None or world.world_size == 2),
            execution_mode=execution_mode(self.expert_split),
            architecture=arch_spec(self.cfg).name,
            world=world,
            weight=weight,
            threads=None if world is None else kernel_threads(),
        )

    def _my_speed(self) -> int:
        """This rank's speed for the leader's --shares auto: --speed, else measured once."""
        if self._speed is None:
            self._speed = rank_speed(None)
        return self._speed

    def _learn_world(self, leader: Hello) -> None:
        """The leader's hello says the world: remember it for the next hello, and refuse a
        --rank it has no place for."""
        self._world_seen = leader.world
        n = 2 if leader.world is None else leader.world.world_size
        if self.options.expert_split is None:
            sent = self.expert_split
            self._leader_split = split_of_mode(leader.execution_mode)
            if self._leader_split is not sent:
                raise WorldMismatch(
                    f"the leader cuts the experts by {self._leader_split.value}, this hello "
                    f"said {sent.value} (--expert-split auto takes the leader's)"
                )
        if self.options.rank is not None and not 1 <= self.options.rank < n:
            raise RankRefused(
                f"--rank {self.options.rank} does not exist in the leader's "
                f"world of {n} ranks (ranks 1 .. {n - 1} are workers)"
            )
        if (
            self.options.share is not None
            and leader.world is not None
            and leader.world.shares_from is SharesFrom.SPEED
        ):
            raise RankRefused(
                f"--share {self.options.share} conflicts with the leader's "
                "--shares auto, which gives every rank the share of its measured "
                "speed; drop --share, or start the leader with --shares ranks"
            )
        if n > 2 and self.options.tls is not None and self.options.peer_tls is None:
            raise RankRefused(
                f"the leader's world of {n} ranks runs TLS, and the gate links "
                "between its workers are mutual TLS: give this worker "
                "--tls-cert, --tls-key and --tls-ca (docs/guide/tls.md)"
            )

    def _listen_gates(self) -> tuple[str, int]:
        """The socket the ranks above this one dial for their gates (bound once)."""
        if self._gate_listener is None:
            o = self.options
            listener = socket.create_server((o.gate_host, o.gate_port), backlog=MAX_WORLD)
            self._gate_listener = listener
        host, port = self._gate_listener.getsockname()[:2]
        return str(host), int(port)

    def _dial(self) -> socket.socket:
        """A connection to the leader's port, TLS done when configured."""
        o = self.options
        sock = socket.create_connection((o.leader_host, o.leader_port), o.handshake_timeout_s)
        if o.tls is None:
            return sock
        return wrap_blocking(
            o.tls,
            sock,
            server_side=False,
            server_hostname=o.leader_host,
            timeout_s=o.handshake_timeout_s,
        )
