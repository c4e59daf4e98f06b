"""The shaped link of ``tp.py --link RATE`` (as root): two network namespaces joined by a veth
pair, each end shaped to RATE by ``tc tbf``, and a thread (or process) moved into one."""

from __future__ import annotations

import ctypes
import os
import subprocess

LINK_SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000


def enter_netns(path: str) -> None:
    """Move the calling thread (and the threads and processes it starts later) into the network
    namespace at ``path`` (a /var/run/netns entry, or /proc/self/ns/net to come back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


class Link:
    """Two network namespaces joined by a veth pair, each end shaped by ``tc tbf`` to the
    rate (what each side sends), addresses LINK_SUBNET.1 (leader) and .2 (worker)."""

    def __init__(self, rate: str, ip: str, tc: str, burst_ms: float = 10.0) -> None:
        self.rate, self.ip, self.tc, self.burst_ms = rate, ip, tc, burst_ms
        self.names = (f"fq{os.getpid()}-leader", f"fq{os.getpid()}-worker")
        self.made: list[str] = []

    def _run(self, *argv: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def up(self) -> None:
        for name in self.names:
            self._run(self.ip, "netns", "add", name)
            self.made.append(name)
            self._run(self.ip, "-n", name, "link", "set", "lo", "up")
        lead, work = self.names
        self._run(
            self.ip,
            "-n",
            lead,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            work,
        )
        bits = {"k": 10**3, "m": 10**6, "g": 10**9}[self.rate.rstrip("bit")[-1]]
        rate_bps = int(self.rate.rstrip("bit")[:-1]) * bits
        # Burst: burst_ms at the rate (10 ms by default), and never below a 64 KiB GSO segment
        # (veth sends those). A frame smaller than the burst that finds the bucket full
        # passes at the veth's speed: the worker's half of a 262k-row head's logits (524 KB)
        # does with 10 ms at 1gbit (1.25 MB); 1 ms (125 KB) paces it at the rate, as a wire.
        burst = max(int(rate_bps / 8 * self.burst_ms / 1000), 96 * 1024)
        for i, name in enumerate(self.names):
            self._run(
                self.ip, "-n", name, "addr", "add", f"{LINK_SUBNET}.{i + 1}/24", "dev", "eth0"
            )
            self._run(self.ip, "-n", name, "link", "set", "eth0", "up")
            self._run(
                self.tc,
                "-n",
                name,
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                str(burst),
                "latency",
                "20ms",
            )

    def down(self) -> None:
        for name in reversed(self.made):
            subprocess.run([self.ip, "netns", "del", name], capture_output=True)
        self.made.clear()
