"""The FDTC link as each side sees it: tables of which message may pass in which state.

Theory of operation
-------------------
Three roles speak FDTC. The **coordinator** serves two kinds of peer over the same framing,
and the first message says which: DATASET or REGISTER opens a **worker** link, an admin
request (START, PAUSE, RESUME, CHECKPOINT, SHUTDOWN, STATUS_REQ, EXPORT) an **admin** link
(the gateway, ``foundry ctl``). The **worker** and the **admin** client are the two peers.

A worker link goes through these states::

    CONNECTED --REGISTER--> REGISTERED --WEIGHTS--> READY --SHUTDOWN--> STOPPING
        |  ^                    |                     |                     |
        |  DATASET (optional,   +----------- DEREGISTER, or close() -------+--> CLOSED
        |  once, before REGISTER)
        +--admin request--> ADMIN

- CONNECTED: nothing said yet. The worker may announce its data (DATASET, our extension)
  and then must REGISTER. A refusal (REGISTER_ACK accepted=0 + ERROR) may be sent from here.
- REGISTERED: the coordinator answers REGISTER_ACK (and MODEL_CONFIG to a worker that
  spoke DATASET). The worker asks for weights; HEARTBEAT and STATUS may come at any time.
- READY: WEIGHTS went over this link, so the worker holds weights and GRADIENTS may
  arrive (after START for a seed-only worker, after ASSIGN for one of ours).
- STOPPING: SHUTDOWN went over the link. Messages the worker sent before it saw SHUTDOWN
  still arrive and are legal; DEREGISTER or end of stream ends the link.

START, PAUSE, RESUME, CHECKPOINT and SHUTDOWN may go to every registered worker, whether it
speaks our extensions or only the seed protocol.

Each side acts on what it has seen, and the two directions cross on the wire. Each table is
therefore keyed by what its side has seen of the transitions *the other side* cannot know
yet, and admits everything the peer may legitimately send under any interleaving:

- the coordinator's table (``TRANSITIONS``) moves on what the coordinator has *sent*
  (WEIGHTS, SHUTDOWN) and on what it has received (REGISTER, DEREGISTER); PAUSE changes no
  state, since gradients computed before the worker read it still arrive (the coordinator
  acknowledges them as refused);
- the worker's table is the coordinator's with the directions swapped (``_mirror``): it
  moves when the worker sends REGISTER or DEREGISTER and when it *receives* WEIGHTS or
  SHUTDOWN. The byte stream keeps order, so whatever the coordinator may send in one of its
  states, the worker may receive in the same state;
- the admin client's table is the admin link's half of that mirror: CONNECTED, then ADMIN
  once a request went out.

ERROR is legal in both directions in every open state; whether it ends the link is the
service's choice, made with ``close()``. Two orders inside a state are kept apart from the
table: a WEIGHTS is legal only after a WEIGHTS_META announced it (the seed header's "sent
before weights"), and a link announces its DATASET at most once; ``Lifecycle`` checks both
on the sending and the receiving side.

The coordinator listens for the two kinds of peer on two ports, and each port's connection
knows its kind before the first byte: ``Lifecycle(Role.COORDINATOR, link=Link.WORKER)`` keeps
only the worker link's entries (an admin request there is refused like any other message
before REGISTER), ``link=Link.ADMIN`` only the admin link's (a REGISTER there is refused).
Without ``link`` the table serves both, and the first message says which.

A (state, direction, type) triple missing from the role's table is a protocol error: a
received message raises FdtcProtocolError carrying the ERROR code to answer with
(NOT_REGISTERED where the link waits for a REGISTER, UNEXPECTED otherwise); a message we are
about to send raises LocalProtocolError, since it is our bug. ``FdtcConnection``
(``foundry.wire.fdtc_connection``) runs one of these tables over the decoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from functools import partial
from types import MappingProxyType

from foundry.wire.errors import FdtcProtocolError, LocalProtocolError
from foundry.wire.fdtc import ErrorCode, Message, MsgType

__all__ = [
    "ADMIN_REQUESTS",
    "TABLES",
    "TRANSITIONS",
    "Direction",
    "Lifecycle",
    "Link",
    "LinkState",
    "Role",
]


class Role(Enum):
    COORDINATOR = "coordinator"  # serves worker links and admin links
    WORKER = "worker"
    ADMIN = "admin"  # a client of the coordinator's admin link (gateway, ctl, foundry up)


class Link(Enum):
    """Which of the coordinator's two links a connection is (the port it came in on)."""

    WORKER = "worker"
    ADMIN = "admin"


class LinkState(Enum):
    CONNECTED = "connected"
    REGISTERED = "registered"
    READY = "ready"
    STOPPING = "stopping"
    ADMIN = "admin"
    CLOSED = "closed"


class Direction(Enum):
    RECEIVED = "received"  # from the peer
    SENT = "sent"  # by the side that owns the table


ADMIN_REQUESTS = frozenset(
    {
        MsgType.START,
        MsgType.PAUSE,
        MsgType.RESUME,
        MsgType.CHECKPOINT,
        MsgType.SHUTDOWN,
        MsgType.STATUS_REQ,
        MsgType.EXPORT,
        MsgType.SWARM_DETAIL_REQ,
    }
)

_Table = dict[tuple[LinkState, Direction, MsgType], LinkState]

# What a registered worker may send whatever happened since, and what the coordinator may
# send it at any time. Neither changes the state.
_WORKER_ANYTIME = (MsgType.HEARTBEAT, MsgType.STATUS, MsgType.WEIGHTS_REQ, MsgType.ERROR)
_COORD_ANYTIME = (
    MsgType.REGISTER_ACK,
    MsgType.MODEL_CONFIG,
    MsgType.BASE_MODEL,
    MsgType.TRAIN_PLAN,
    MsgType.HEARTBEAT_ACK,
    MsgType.STATUS_REQ,
    MsgType.WEIGHTS_META,
    MsgType.START,
    MsgType.SYNC,
    MsgType.CHECKPOINT,
    MsgType.PAUSE,
    MsgType.RESUME,
    MsgType.ERROR,
)
_COORD_STOPPING = (MsgType.GRADIENTS_ACK, MsgType.HEARTBEAT_ACK, MsgType.SHUTDOWN, MsgType.ERROR)
_ADMIN_REPLIES = (MsgType.CONTROL_ACK, MsgType.SWARM_STATUS, MsgType.SWARM_DETAIL, MsgType.ERROR)


def _add(
    t: _Table,
    state: LinkState,
    direction: Direction,
    types: Iterable[MsgType],
    to: LinkState | None = None,
) -> None:
    for msg_type in types:
        t[state, direction, msg_type] = state if to is None else to


def _coordinator() -> _Table:
    S, Rx, Tx, M = LinkState, Direction.RECEIVED, Direction.SENT, MsgType  # table shorthand
    t: _Table = {}
    add = partial(_add, t)
    # Before anything: who is this?
    add(S.CONNECTED, Rx, (M.DATASET, M.BASE_MODEL, M.ERROR))
    add(S.CONNECTED, Rx, (M.REGISTER,), S.REGISTERED)
    add(S.CONNECTED, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.CONNECTED, Rx, ADMIN_REQUESTS, S.ADMIN)
    add(S.CONNECTED, Tx, (M.REGISTER_ACK, M.ERROR))  # a refusal after DATASET
    # A registered worker without weights on this link.
    add(S.REGISTERED, Rx, _WORKER_ANYTIME)
    add(S.REGISTERED, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.REGISTERED, Tx, _COORD_ANYTIME)
    add(S.REGISTERED, Tx, (M.WEIGHTS,), S.READY)
    add(S.REGISTERED, Tx, (M.SHUTDOWN,), S.STOPPING)
    # Holding weights: rounds of ASSIGN / GRADIENTS / GRADIENTS_ACK and new weights.
    add(S.READY, Rx, (*_WORKER_ANYTIME, M.GRADIENTS, M.WEIGHTS_DIGEST))
    add(S.READY, Rx, (M.DEREGISTER,), S.CLOSED)
    add(
        S.READY,
        Tx,
        (*_COORD_ANYTIME, M.WEIGHTS, M.ASSIGN, M.LOCAL_ASSIGN, M.UPDATE, M.GRADIENTS_ACK),
    )
    add(S.READY, Tx, (M.SHUTDOWN,), S.STOPPING)
    # Training is over; what was in flight still lands.
    add(S.STOPPING, Rx, (*_WORKER_ANYTIME, M.GRADIENTS, M.WEIGHTS_DIGEST))
    add(S.STOPPING, Rx, (M.DEREGISTER,), S.CLOSED)
    add(S.STOPPING, Tx, _COORD_STOPPING)
    # Admin link: requests and answers, as many as it likes.
    add(S.ADMIN, Rx, (*ADMIN_REQUESTS, M.ERROR))
    add(S.ADMIN, Tx, _ADMIN_REPLIES)
    return t


def _one_link(
    t: Mapping[tuple[LinkState, Direction, MsgType], LinkState], *, admin: bool
) -> _Table:
    """The entries of one link: the worker link's, or the admin link's and the ERROR either
    side may send before anything else was said."""
    return {
        (state, direction, msg_type): to
        for (state, direction, msg_type), to in t.items()
        if (LinkState.ADMIN in (state, to)) is admin
        or (admin and state is LinkState.CONNECTED and msg_type is MsgType.ERROR)
    }


def _mirror(t: Mapping[tuple[LinkState, Direction, MsgType], LinkState], *, admin: bool) -> _Table:
    """The peer's table: one link of the coordinator's with the directions swapped. What one
    side may send in a state the other may receive in it, since the byte stream keeps order;
    and a state is entered on the same message on both sides (sent by one, received by the
    other)."""
    swap = {Direction.RECEIVED: Direction.SENT, Direction.SENT: Direction.RECEIVED}
    return {
        (state, swap[direction], msg_type): to
        for (state, direction, msg_type), to in _one_link(t, admin=admin).items()
    }


_COORDINATOR = _coordinator()
TABLES: Mapping[Role, Mapping[tuple[LinkState, Direction, MsgType], LinkState]] = MappingProxyType(
    {
        Role.COORDINATOR: MappingProxyType(_COORDINATOR),
        Role.WORKER: MappingProxyType(_mirror(_COORDINATOR, admin=False)),
        Role.ADMIN: MappingProxyType(_mirror(_COORDINATOR, admin=True)),
    }
)
TRANSITIONS = TABLES[Role.COORDINATOR]
# The coordinator's table cut to the link a port serves.
_LINK_TABLES: Mapping[Link, Mapping[tuple[LinkState, Direction, MsgType], LinkState]] = {
    Link.WORKER: MappingProxyType(_one_link(_COORDINATOR, admin=False)),
    Link.ADMIN: MappingProxyType(_one_link(_COORDINATOR, admin=True)),
}


def _type_of(msg: Message | MsgType) -> MsgType:
    return msg if isinstance(msg, MsgType) else msg.TYPE


class Lifecycle:
    """One link's state as ``role`` sees it; call ``receive`` for every decoded message and
    ``send`` before writing each message. ``link`` cuts the coordinator's table to one of
    its links (see the module docstring)."""

    def __init__(self, role: Role, *, link: Link | None = None) -> None:
        if link is not None and role is not Role.COORDINATOR:
            raise ValueError(f"only the coordinator serves more than one link, not {role.value}")
        self.role = role
        self.link = link
        self.state = LinkState.CONNECTED
        self._table = TABLES[role] if link is None else _LINK_TABLES[link]
        self._weights_announced = False  # a WEIGHTS_META passed and its WEIGHTS did not yet
        self._dataset_seen = False  # a DATASET passed (at most one per link)

    def may_receive_after(self, before: Iterable[MsgType], msg_type: MsgType) -> bool:
        """Whether ``msg_type`` may arrive once the messages ``before`` (decoded, not yet
        received) have moved the state: the state at that point of the byte stream."""
        state = self.state
        for earlier in before:
            state = self._table.get((state, Direction.RECEIVED, earlier), state)
        return (state, Direction.RECEIVED, msg_type) in self._table

    def allowed(self, direction: Direction) -> frozenset[MsgType]:
        return frozenset(m for (s, d, m) in self._table if s is self.state and d is direction)

    def may_send(self, msg: Message | MsgType) -> bool:
        """Whether ``send`` would take ``msg`` now."""
        msg_type = _type_of(msg)
        if msg_type is MsgType.WEIGHTS and not self._weights_announced:
            return False
        if msg_type is MsgType.DATASET and self._dataset_seen:
            return False
        return (self.state, Direction.SENT, msg_type) in self._table

    def receive(self, msg: Message | MsgType) -> LinkState:
        msg_type = _type_of(msg)
        try:
            state = self._table[self.state, Direction.RECEIVED, msg_type]
        except KeyError:
            expected = self.allowed(Direction.RECEIVED)
            code = (
                ErrorCode.NOT_REGISTERED if MsgType.REGISTER in expected else (ErrorCode.UNEXPECTED)
            )
            allowed = ", ".join(sorted(m.name for m in expected))
            raise FdtcProtocolError(
                f"{msg_type.name} is not allowed on a {self.state.value} link "
                f"(expected one of: {allowed or 'nothing'})",
                code,
            ) from None
        if msg_type is MsgType.WEIGHTS and not self._weights_announced:
            raise FdtcProtocolError(
                "WEIGHTS without a WEIGHTS_META before it", ErrorCode.UNEXPECTED
            )
        if msg_type is MsgType.DATASET and self._dataset_seen:
            raise FdtcProtocolError(
                "a second DATASET: the link announced its data already; REGISTER is next",
                ErrorCode.NOT_REGISTERED,
            )
        self._announce(msg_type)
        self.state = state
        return state

    def send(self, msg: Message | MsgType) -> LinkState:
        msg_type = _type_of(msg)
        try:
            state = self._table[self.state, Direction.SENT, msg_type]
        except KeyError:
            raise LocalProtocolError(
                f"cannot send {msg_type.name} on a {self.state.value} link"
            ) from None
        if msg_type is MsgType.WEIGHTS and not self._weights_announced:
            raise LocalProtocolError("cannot send WEIGHTS without a WEIGHTS_META before it")
        if msg_type is MsgType.DATASET and self._dataset_seen:
            raise LocalProtocolError("cannot send a second DATASET on one link")
        self._announce(msg_type)
        self.state = state
        return state

    def _announce(self, msg_type: MsgType) -> None:
        if msg_type is MsgType.DATASET:
            self._dataset_seen = True
        elif msg_type is MsgType.WEIGHTS_META:
            self._weights_announced = True
        elif msg_type is MsgType.WEIGHTS:
            self._weights_announced = False

    def close(self) -> None:
        self.state = LinkState.CLOSED
