"""The FDTC link as the coordinator sees it: a table of which message may pass in which state.

Theory of operation
-------------------
The coordinator serves two kinds of peer over the same framing, and the first message says
which: DATASET or REGISTER opens a **worker** link, an admin request (START, PAUSE, RESUME,
CHECKPOINT, SHUTDOWN, STATUS_REQ, EXPORT) an **admin** link (the gateway, ``foundry ctl``).

A worker link goes through these states::

    CONNECTED --REGISTER--> REGISTERED --WEIGHTS sent--> READY --SHUTDOWN sent--> STOPPING
        |  ^                    |                          |                          |
        |  DATASET (optional,   +--------- DEREGISTER received, or close() ----------+--> CLOSED
        |  before REGISTER)
        +--admin request--> ADMIN

- CONNECTED: nothing said yet. The worker may announce its data (DATASET, our extension)
  and then must REGISTER. A refusal (REGISTER_ACK accepted=0 + ERROR) may be sent from here.
- REGISTERED: the coordinator answers REGISTER_ACK (and MODEL_CONFIG to a worker that
  spoke DATASET). The worker asks for weights; HEARTBEAT and STATUS may come at any time.
- READY: WEIGHTS went out on this link, so the worker holds weights and GRADIENTS may
  arrive (after START for a seed-only worker, after ASSIGN for one of ours).
- STOPPING: SHUTDOWN went out. Messages the worker sent before it saw SHUTDOWN still arrive
  and are legal; DEREGISTER or end of stream ends the link.

Each side acts on what it has seen, and the two directions cross on the wire. The table is
therefore keyed by what the coordinator has *sent*, and admits everything a worker may
legitimately send under any interleaving: PAUSE changes no state, since gradients computed
before the worker read it still arrive (the coordinator acknowledges them as refused).
ERROR is legal in both directions in every open state; whether it ends the link is the
service's choice, made with ``close()``.

A (state, direction, type) triple missing from ``TRANSITIONS`` is a protocol error: a
received message raises FdtcProtocolError carrying the ERROR code to answer with
(NOT_REGISTERED before REGISTER, UNEXPECTED otherwise); a message we are about to send
raises LocalProtocolError, since it is our bug.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from types import MappingProxyType

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import ErrorCode, Message, MsgType

__all__ = ["ADMIN_REQUESTS", "TRANSITIONS", "CoordinatorLink", "Direction", "LinkState"]


class LinkState(Enum):
    CONNECTED = "connected"
    REGISTERED = "registered"
    READY = "ready"
    STOPPING = "stopping"
    ADMIN = "admin"
    CLOSED = "closed"


class Direction(Enum):
    RECEIVED = "received"  # from the peer
    SENT = "sent"  # by the coordinator


ADMIN_REQUESTS = frozenset({
    MsgType.START, MsgType.PAUSE, MsgType.RESUME, MsgType.CHECKPOINT, MsgType.SHUTDOWN,
    MsgType.STATUS_REQ, MsgType.EXPORT,
})


def _build() -> dict[tuple[LinkState, Direction, MsgType], LinkState]:
    S, Rx, Tx, M = LinkState, Direction.RECEIVED, Direction.SENT, MsgType  # table shorthand
    t: dict[tuple[LinkState, Direction, MsgType], LinkState] = {}
    # What a registered worker may send whatever happened since, and what the coordinator
    # may send it at any time. Neither changes the state.
    worker_anytime = (M.HEARTBEAT, M.STATUS, M.WEIGHTS_REQ, M.ERROR)
    coord_anytime = (
        M.REGISTER_ACK, M.MODEL_CONFIG, M.HEARTBEAT_ACK, M.STATUS_REQ, M.WEIGHTS_META,
        M.START, M.SYNC, M.CHECKPOINT, M.PAUSE, M.RESUME, M.ERROR,
    )

    def add(state: LinkState, direction: Direction, types: Iterable[MsgType],
            to: LinkState | None = None) -> None:
        for msg_type in types:
            t[state, direction, msg_type] = state if to is None else to

    # Before anything: who is this?
    add(S.CONNECTED, Rx, (M.DATASET, M.ERROR))
    add(S.CONNECTED, Rx, (M.REGISTER,), S.REGISTERED)
    add(S.CONNECTED, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.CONNECTED, Rx, ADMIN_REQUESTS, S.ADMIN)
    add(S.CONNECTED, Tx, (M.REGISTER_ACK, M.ERROR))  # a refusal after DATASET
    # A registered worker without weights on this link.
    add(S.REGISTERED, Rx, worker_anytime)
    add(S.REGISTERED, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.REGISTERED, Tx, coord_anytime)
    add(S.REGISTERED, Tx, (M.WEIGHTS,), S.READY)
    add(S.REGISTERED, Tx, (M.SHUTDOWN,), S.STOPPING)
    # Holding weights: rounds of ASSIGN / GRADIENTS / GRADIENTS_ACK and new weights.
    add(S.READY, Rx, (*worker_anytime, M.GRADIENTS))
    add(S.READY, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.READY, Tx, (*coord_anytime, M.WEIGHTS, M.ASSIGN, M.GRADIENTS_ACK))
    add(S.READY, Tx, (M.SHUTDOWN,), S.STOPPING)
    # Training is over; what was in flight still lands.
    add(S.STOPPING, Rx, (*worker_anytime, M.GRADIENTS))
    add(S.STOPPING, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.STOPPING, Tx, (M.GRADIENTS_ACK, M.HEARTBEAT_ACK, M.SHUTDOWN, M.ERROR))
    # Admin link: requests and answers, as many as it likes.
    add(S.ADMIN, Rx, (*ADMIN_REQUESTS, M.ERROR))
    add(S.ADMIN, Tx, (M.CONTROL_ACK, M.SWARM_STATUS, M.ERROR))
    return t


TRANSITIONS: Mapping[tuple[LinkState, Direction, MsgType], LinkState] = MappingProxyType(
    _build()
)


def _type_of(msg: Message | MsgType) -> MsgType:
    return msg if isinstance(msg, MsgType) else msg.TYPE


class CoordinatorLink:
    """One peer's link state; call ``receive`` for every decoded message and ``send``
    before writing each message."""

    def __init__(self) -> None:
        self.state = LinkState.CONNECTED

    def allowed(self, direction: Direction) -> frozenset[MsgType]:
        return frozenset(m for (s, d, m) in TRANSITIONS if s is self.state and d is direction)

    def receive(self, msg: Message | MsgType) -> LinkState:
        msg_type = _type_of(msg)
        try:
            self.state = TRANSITIONS[self.state, Direction.RECEIVED, msg_type]
        except KeyError:
            code = ErrorCode.NOT_REGISTERED if self.state is LinkState.CONNECTED else (
                ErrorCode.UNEXPECTED
            )
            allowed = ", ".join(sorted(m.name for m in self.allowed(Direction.RECEIVED)))
            raise FdtcProtocolError(
                f"{msg_type.name} is not allowed on a {self.state.value} link "
                f"(expected one of: {allowed or 'nothing'})",
                code,
            ) from None
        return self.state

    def send(self, msg: Message | MsgType) -> LinkState:
        msg_type = _type_of(msg)
        try:
            self.state = TRANSITIONS[self.state, Direction.SENT, msg_type]
        except KeyError:
            raise LocalProtocolError(
                f"cannot send {msg_type.name} on a {self.state.value} link"
            ) from None
        return self.state

    def close(self) -> None:
        self.state = LinkState.CLOSED
