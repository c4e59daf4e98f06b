"""The protocol exception tree, shared by every wire codec (FDTC, tensor-parallel frames).

::

    ProtocolError                  any violation of a wire protocol
    ├── LocalProtocolError         we misused the API: a value that does not fit its field
    │                              (an over-long worker id, a u32 given -1), a message sent in
    │                              a state that does not allow it. A bug on our side; fix the
    │                              caller. Raised on the send path only.
    └── RemoteProtocolError        the peer's bytes break the protocol. Raised on the receive
        │                          path only; answer with an ERROR where possible and close
        │                          that connection (never the process).
        ├── FdtcProtocolError      ... on an FDTC link: bad magic, unknown type, a length over
        │                          the limit, a payload of the wrong size or with a bad value,
        │                          a message the link's state does not allow, tensor sizes
        │                          that do not fit the model.
        ├── TpProtocolError        ... on the TP control link: close and re-handshake
        │   ├── VersionMismatch    the peer speaks another TP protocol version
        │   └── IdentityMismatch   the peer's hello describes another model or role
        └── FrontendProtocolError  ... on the TP leader's frontend link

Every codec declares its messages the same way (``foundry.wire.layout``) and raises its
branch of this one tree; a service catches ``ProtocolError`` (or ``RemoteProtocolError``)
whatever the link.

Either kind leaves the codec object that raised it in a terminal state: a decoder that saw bad
bytes refuses further input, because after a framing error it can no longer find the next
frame boundary.
"""

from __future__ import annotations

# ERROR error_code suggested for a peer's bad bytes: 1 = BAD_FRAME (see fdtc.ErrorCode). It is
# spelled here as a number because fdtc imports this module, not the other way round.
_BAD_FRAME = 1


class ProtocolError(Exception):
    """Base class of every wire-protocol error."""


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""


class FdtcProtocolError(RemoteProtocolError):
    """A peer's FDTC bytes are malformed or arrive out of order.

    ``error_code`` is the ERROR code (an ``fdtc.ErrorCode`` value) that best answers it:
    BAD_FRAME for malformed bytes, UNEXPECTED or NOT_REGISTERED for a message in the wrong
    state, so a server can reply ``Error(exc.error_code, str(exc))`` without a lookup table.
    """

    def __init__(self, message: str, error_code: int = _BAD_FRAME) -> None:
        super().__init__(message)
        self.error_code = error_code


class TpProtocolError(RemoteProtocolError):
    """The peer's tensor-parallel bytes break the protocol (raised on the receive path only)."""


class VersionMismatch(TpProtocolError):
    """The two ranks run different protocol versions; names both."""


class IdentityMismatch(TpProtocolError):
    """The two ranks loaded different models (or both claim one role, or run different execution
    modes); names field and values."""


class FrontendProtocolError(RemoteProtocolError):
    """Bad bytes on the frontend link (names the problem)."""
