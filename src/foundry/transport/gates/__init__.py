"""The tensor-parallel data plane: the ranks swap their partial of one gate and sum them.

Twice per layer (gates ATTN and FFN) each rank holds a partial of shape (rows, n_embd) float32;
``GateExchange.exchange`` sends it to the peers, receives theirs, and returns the sum. In a pair
float addition of the two is commutative bit for bit, so both ranks get bit-identical sums; in
a world of N ranks (:class:`MeshGateExchange`) every rank adds the N partials in rank order,
``((p0 + p1) + p2) + ...``, and gets the same bits. The call is synchronous: the inference
engine's forward pass blocks in it.

Both ranks tag every partial with the same :class:`~foundry.wire.tp.GateHeader` (layer, gate,
seq, rows, n_embd; ``seq`` counts gates from ``first_seq``), so a rank that got out of step is
caught at the first gate where the tags differ, with both tags in the message. A peer that
stalls, dies or closes makes ``exchange`` raise :class:`GateError` within ``timeout_s`` of no
progress; the exchange is then unusable (it has closed its socket or marked the slab closed so
the peer fails fast too), and the services re-handshake.

Three transports:

- :class:`TcpGateExchange`: both ranks write header + partial, then read the peer's, full
  duplex with no per-gate handshake. The socket is non-blocking and one poll loop interleaves
  send and receive, so a multi-MiB prefill partial cannot deadlock when the kernel clamps the
  socket buffers (a blocking "sendall, then recv" on both sides would). No copies: the partial
  is sent from its own buffer, the peer's lands through ``recvmsg_into`` in a reused array.
  Over TLS (``foundry.transport.tls``; an ``ssl.SSLSocket``, which has no scatter/gather
  calls) the same loop uses ``send`` and ``recv_into`` one buffer at a time; the bytes inside
  TLS are the same. One socket's non-blocking moves, plain or TLS, are ``channel``'s
  :class:`~foundry.transport.gates.channel.GateChannel`, which both TCP exchanges drive.
- :class:`MeshGateExchange`: a world of N > 2 ranks: a TCP connection (plain or TLS) to every
  other rank; per gate, reduce-scatter then allgather: the columns cut into N chunks, the rank
  sends each peer its chunk of its partial, sums its own chunk's N pieces in rank order and
  sends that sum to every peer, one poll loop over all of them (two hops, 2(N-1)/N partials
  out; docs/tp.md, "Which exchange", has the choice against all-to-all, a star and a ring).
- :class:`ShmGateExchange`: a slab file in ``/dev/shm`` mapped by both ranks on one host (see
  ``SlabLayout`` for the layout and the seqlock rule). A plain file + ``mmap`` rather than
  ``multiprocessing.shared_memory``: before Python 3.13 the attaching process registers the
  segment with its resource tracker, which then warns about a "leak" and may unlink it under
  the creator; a file has one owner, the creator, who unlinks it.

Which one runs is decided from the two hellos (``foundry.wire.tp.negotiate_gate_transport``): the
leader creates a slab before its hello and names it there; when both ranks offered shared memory
and :func:`local_host_id` matches, the worker attaches to it, otherwise the leader closes it and
both use a TCP connection of their own (not the control socket, whose frames would interleave).

The package, by job: ``base`` (constants, :class:`GateError`, the host id, the base class),
``channel`` (one TCP or TLS socket as the TCP exchanges drive it), ``tcp``, ``mesh``, ``shm``
(one transport each). Importers use the names here.
"""

from foundry.transport.gates.base import (
    DEFAULT_GATE_TIMEOUT_S,
    SHM_SLEEP_FIRST_S,
    SHM_SLEEP_MAX_S,
    SHM_SPIN_S,
    SHM_YIELD_POLLS,
    TCP_SPIN_S,
    TLS_SEND_CHUNK,
    TSO_MACHINES,
    GateError,
    GateExchange,
    StepGates,
    local_host_id,
)
from foundry.transport.gates.mesh import MeshGateExchange
from foundry.transport.gates.shm import ShmGateExchange
from foundry.transport.gates.tcp import TcpGateExchange

__all__ = [
    "DEFAULT_GATE_TIMEOUT_S",
    "SHM_SLEEP_FIRST_S",
    "SHM_SLEEP_MAX_S",
    "SHM_SPIN_S",
    "SHM_YIELD_POLLS",
    "TCP_SPIN_S",
    "TLS_SEND_CHUNK",
    "TSO_MACHINES",
    "GateError",
    "GateExchange",
    "MeshGateExchange",
    "ShmGateExchange",
    "StepGates",
    "TcpGateExchange",
    "local_host_id",
]
