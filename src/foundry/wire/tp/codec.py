"""Encoding hellos and control frames, the frame bounds that follow the batch
(:func:`logits_rows`, :func:`max_payload_for`), and the incremental :class:`TpDecoder`."""

from __future__ import annotations

from foundry.wire.errors import LocalProtocolError, TpProtocolError, VersionMismatch
from foundry.wire.framing import FrameDecoder
from foundry.wire.tp.control import (
    BATCH_ITEM,
    DRAW_ROW,
    FRAME_CLASSES,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    MASS_ROW,
    PICK_CANDIDATE,
    PICK_ROW,
    ROW_FLAGS,
    ROW_TOP,
    TP_MAX_DRAW_TOP_K,
    UNSUPPORTED_FRAME_TYPES,
    WORLD_ENTRY,
    Frame,
    FrameType,
    SyncCheckpoint,
)
from foundry.wire.tp.hello import (
    DS4_TP_BATCH_MAX_ROWS,
    HELLO_PREFIX,
    HELLO_SIZE,
    HELLO_SIZES,
    HELLO_WEIGHT_SIZE,
    HELLO_WORLD_SIZE,
    THREADS_EXT,
    TP_FRAME_MAGIC,
    TP_HELLO_MAGIC,
    TP_MAX_BATCH_ITEMS,
    TP_MAX_PAYLOAD,
    TP_MAX_WORLD,
    TP_PROTOCOL_VERSION,
    Hello,
    Identity,
    _decode_hello,
    _encode_hello,
    _version_message,
)


def encode_parts(frame: Frame) -> list[bytes | memoryview]:
    """The pieces of a hello or a control frame, to write in order (a LOGITS half as the view
    it is, uncopied)."""
    if isinstance(frame, Hello):
        return [_encode_hello(frame)]
    parts = frame._payload_parts()
    length = sum(len(p) for p in parts)
    header = FRAME_HEADER.pack(
        TP_FRAME_MAGIC, frame.TYPE, frame.header_flags, 0, frame.session_id, frame.seq, length
    )
    return [header, *parts]


def encode(frame: Frame) -> bytes:
    """The bytes of a hello or a control frame."""
    return b"".join(encode_parts(frame))


def logits_rows(max_sessions: int) -> int:
    """The most logits rows one command returns on a pair that runs ``max_sessions`` sessions
    at once: a VERIFY block (``DS4_TP_BATCH_MAX_ROWS``), or one row per session of an
    EVAL_BATCH or MIXED_BATCH (the prefill's last row and one for every other session)."""
    if not 1 <= max_sessions <= TP_MAX_BATCH_ITEMS:
        raise LocalProtocolError(
            f"max_sessions must be in [1, {TP_MAX_BATCH_ITEMS}], got {max_sessions}"
        )
    return max(DS4_TP_BATCH_MAX_ROWS, max_sessions)


def max_payload_for(identity: Identity, max_rows: int, vocab_block: int | None = None) -> int:
    """The largest legal control payload for this model on a pair whose commands return at
    most ``max_rows`` logits rows (``logits_rows``): the bound a rank's decoder uses, the
    larger of these frames (docs/protocol.md, Limits, gives the same formula).
    ``vocab_block``: the largest vocabulary block a worker returns (default the larger half,
    the pair's; a world of N ranks or unequal shares passes its own)."""
    if max_rows < 1:
        raise LocalProtocolError(f"max_rows must be >= 1, got {max_rows}")
    block = (identity.n_vocab + 1) // 2 if vocab_block is None else vocab_block
    return max(
        4 * identity.ctx_size,  # SYNC of a full context
        4 + 4 * max_rows * block,  # LOGITS: rows of the larger half (of the largest block)
        4 + ROW_TOP.size * max_rows,  # ROW_TOPS
        4 + DRAW_ROW.size * TP_MAX_BATCH_ITEMS,  # ROW_DRAW of every row (the worker's bound too)
        4 + MASS_ROW.size * TP_MAX_BATCH_ITEMS,  # ROW_MASS of every row
        # ROW_PICKS: every row cut to the largest top_k, each with all its candidates
        4 + max_rows * (PICK_ROW.size + PICK_CANDIDATE.size * TP_MAX_DRAW_TOP_K),
        WORLD_ENTRY.size * (TP_MAX_WORLD - 1),  # WORLD
        # MIXED_BATCH; MIXED_PREFILLS too (its prefills' tokens at most a context in all, its
        # prefills' 16-byte heads and its items at most TP_MAX_BATCH_ITEMS sessions)
        8 + 4 * identity.ctx_size + BATCH_ITEM.size * TP_MAX_BATCH_ITEMS,
        4 + 4 * DS4_TP_BATCH_MAX_ROWS,  # VERIFY
        SyncCheckpoint.LAYOUT.size,
    )


class TpDecoder(FrameDecoder[Frame]):
    """Incremental decoder (``foundry.wire.framing``): ``feed`` bytes as they arrive, take the
    hello (when ``expect_hello``) and then control frames with ``next_event``.

    The hello's 8-byte prefix is checked before the rest of it is kept, a control frame's
    28-byte header before its payload. After a :class:`TpProtocolError` the decoder is failed
    for good.
    """

    def __init__(self, max_payload: int = TP_MAX_PAYLOAD, *, expect_hello: bool = False) -> None:
        if max_payload < 0:
            raise ValueError(f"max_payload must be >= 0, got {max_payload}")
        super().__init__()
        self.max_payload = max_payload
        self._hello_next = expect_hello
        self._hello_prefix = b""
        # (type, session_id, seq, flags) of a header already validated, awaiting its payload.
        self._header: tuple[FrameType, int, int, int] = (FrameType.STOP, 0, 0, 0)

    def _header_size(self) -> int:
        return HELLO_PREFIX.size if self._hello_next else FRAME_HEADER_SIZE

    def _begin(self, header: bytes) -> int:
        if self._hello_next:
            size = self._check_hello_prefix(header)
            self._hello_prefix = header
            return size - HELLO_PREFIX.size
        ftype, session_id, seq, flags, length = self._parse_header(header)
        self._header = (ftype, session_id, seq, flags)
        return length

    def _finish(self, payload: memoryview) -> Frame:
        if self._hello_next:
            hello = _decode_hello(self._hello_prefix + bytes(payload), 0)
            self._hello_next = False
            return hello
        ftype, session_id, seq, flags = self._header
        try:
            return FRAME_CLASSES[ftype]._parse(  # type: ignore[return-value]
                payload,
                0,
                len(payload),
                session_id=session_id,
                seq=seq,
                **{name: bool(flags & flag) for name, flag in ROW_FLAGS},
            )
        except LocalProtocolError as exc:
            raise TpProtocolError(f"{ftype.name}: {exc}") from None

    def _eof_error(self, message: str) -> TpProtocolError:
        return TpProtocolError(message)

    @staticmethod
    def _check_hello_prefix(prefix: bytes) -> int:
        magic, version, size = HELLO_PREFIX.unpack(prefix)
        if magic == TP_FRAME_MAGIC:
            raise TpProtocolError("expected the peer's hello first, got a control frame")
        if magic != TP_HELLO_MAGIC:
            raise TpProtocolError(
                f"bad hello magic {magic:#010x} (expected {TP_HELLO_MAGIC:#010x}, 'DTPH'): "
                "the peer does not speak the TP protocol"
            )
        if version != TP_PROTOCOL_VERSION:
            raise VersionMismatch(_version_message(TP_PROTOCOL_VERSION, version))
        if size not in HELLO_SIZES:
            raise TpProtocolError(
                f"hello of version {version} must be {HELLO_SIZE} bytes "
                f"({HELLO_WORLD_SIZE} with the world extension, "
                f"{HELLO_WEIGHT_SIZE} with the weight too, {THREADS_EXT.size} more with the "
                f"threads), the peer says {size}"
            )
        return int(size)

    def _parse_header(self, header: bytes) -> tuple[FrameType, int, int, int, int]:
        magic, code, flags, reserved, session_id, seq, length = FRAME_HEADER.unpack(header)
        if magic == TP_HELLO_MAGIC:
            raise TpProtocolError("unexpected hello after the handshake")
        if magic != TP_FRAME_MAGIC:
            raise TpProtocolError(
                f"bad frame magic {magic:#010x} (expected {TP_FRAME_MAGIC:#010x}, 'DTP4'): "
                "the stream is out of step or the peer does not speak the TP protocol"
            )
        if code not in FrameType.__members__.values():
            raise TpProtocolError(f"unknown frame type {code}")
        ftype = FrameType(code)
        if ftype in UNSUPPORTED_FRAME_TYPES:
            raise TpProtocolError(
                f"frame type {ftype.name} ({code}) is not supported: "
                f"{UNSUPPORTED_FRAME_TYPES[ftype]}"
            )
        cls = FRAME_CLASSES[ftype]
        allowed = sum(flag for _, flag in ROW_FLAGS) if cls.ROWS_REPLY else 0
        if flags & ~allowed or reserved:
            rule = (
                "must be 0"
                if not allowed
                else "must be 0, 0x1 (ROW_TOPS), 0x3 (ROW_TOPS | ROW_DRAWS) or 0x7 (ROW_TOPS | "
                "ROW_DRAWS | ROW_MASS) / 0"
            )
            raise TpProtocolError(
                f"{ftype.name}: header flags {flags:#x} / reserved {reserved} {rule} "
                f"in protocol version {TP_PROTOCOL_VERSION}"
            )
        for (name, flag), (needed, needed_flag) in zip(ROW_FLAGS[1:], ROW_FLAGS, strict=False):
            if flags & flag and not flags & needed_flag:
                raise TpProtocolError(
                    f"{ftype.name}: header flags {flags:#x}: {name.upper()} ({flag:#x}) needs "
                    f"{needed.upper()} ({needed_flag:#x}); the flags must be 0, 0x1, 0x3 or 0x7"
                )
        if length > self.max_payload:
            raise TpProtocolError(
                f"{ftype.name} payload of {length} bytes exceeds the limit of "
                f"{self.max_payload} bytes"
            )
        base, unit = cls.PAYLOAD_BASE, cls.PAYLOAD_UNIT
        legal = length >= base and (length - base) % unit == 0 if unit else length == base
        if not legal:
            rule = f"{base} + a multiple of {unit}" if unit else f"exactly {base}"
            raise TpProtocolError(f"{ftype.name} payload must be {rule} bytes, got {length}")
        return ftype, session_id, seq, flags, length
