"""The two clients `foundry up` uses: blocking FDTC requests on the coordinator's admin link,
and a greedy generation through the gateway (gRPC), as `foundry ctl generate` would ask."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from foundry.transport.stream import BlockingStream
from foundry.up.plan import StackError, addr
from foundry.wire import fdtc

# The exported model and the TP pair must answer a generation within this time.
SERVE_TIMEOUT_S = 60.0


class AdminLink:
    """Blocking FDTC requests on the coordinator's admin link, one answer per request."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._stream: BlockingStream[fdtc.Message] | None = None

    def request(self, msg: fdtc.Message, timeout_s: float | None = None) -> fdtc.Message:
        return self.requests(msg, 1, timeout_s)[0]

    def requests(
        self, msg: fdtc.Message, count: int, timeout_s: float | None = None
    ) -> list[fdtc.Message]:
        """The ``count`` answers to ``msg``; an ERROR in their place is a StackError."""
        try:
            got = self._exchange(msg, count, timeout_s or self.timeout_s)
        except (OSError, fdtc.FdtcProtocolError) as exc:
            self.close()
            raise StackError(f"coordinator admin link {addr(*self.address)}: {exc}") from None
        if isinstance(got[-1], fdtc.Error):
            raise StackError(f"the coordinator answered {msg.TYPE.name}: {got[-1].message}")
        return got

    def _exchange(self, msg: fdtc.Message, count: int, timeout_s: float) -> list[fdtc.Message]:
        if self._stream is None:
            sock = socket.create_connection(self.address, timeout=timeout_s)
            self._stream = BlockingStream(
                sock,
                fdtc.FdtcDecoder(),
                timeout_s=timeout_s,
                frame_deadline_s=timeout_s,
                name="admin link",
            )
        self._stream.set_timeout(timeout_s)
        self._stream.send_pieces(fdtc.encode_parts(msg))
        got = [self._stream.recv(f"the answer to {msg.TYPE.name}")]
        while len(got) < count and not isinstance(got[-1], fdtc.Error):
            got.append(self._stream.recv(f"the answer to {msg.TYPE.name}"))
        return got

    def status(self) -> tuple[fdtc.SwarmStatus, fdtc.SwarmDetail]:
        """SWARM_STATUS and SWARM_DETAIL, taken together (SWARM_DETAIL_REQ)."""
        status, detail = self.requests(fdtc.SwarmDetailReq(), 2)
        if (
            not isinstance(status, fdtc.SwarmStatus)
            or not isinstance(detail, fdtc.SwarmDetail)
            or detail.n_rows != status.n_rows
        ):
            raise StackError(
                f"the coordinator answered SWARM_DETAIL_REQ with {status!r}, {detail!r}"
            )
        return status, detail

    def export(self, path: Path) -> Path:
        got = self.request(fdtc.Export(path=str(path)), timeout_s=300.0)
        if not isinstance(got, fdtc.ControlAck) or not got.ok:
            raise StackError(f"export failed: {getattr(got, 'message', got)!r}")
        return Path(got.message)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def generate(
    target: str,
    prompt: str,
    max_tokens: int,
    token: str | None,
    check_stop: Callable[[], None],
    within_s: float = SERVE_TIMEOUT_S,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """A generation through the gateway (greedy at temperature 0); retried while the pair is
    still coming up."""
    import grpc

    from foundry.api.v1 import inference_pb2, inference_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    deadline = time.monotonic() + within_s
    with grpc.insecure_channel(target) as channel:
        stub_class: Callable[[grpc.Channel], Any] = inference_pb2_grpc.InferenceServiceStub
        stub = stub_class(channel)
        while True:
            request = inference_pb2.GenerateRequest(
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
            )
            try:
                pieces = [
                    token.text
                    for event in stub.Generate(request, metadata=metadata, timeout=30.0)
                    for token in event.tokens
                ]
                return "".join(pieces)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    details = exc.details() if hasattr(exc, "details") else str(exc)
                    raise StackError(f"generation through the gateway failed: {details}") from None
            check_stop()
            time.sleep(0.3)
