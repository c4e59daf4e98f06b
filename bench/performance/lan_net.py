"""The shaped network of ``lan.py`` (as root): a star of network namespaces behind one bridge,
every port shaped both ways by ``tc tbf``; or loopback, with no namespaces and no shaping."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess

SUBNET = "10.77.0"


class Network:
    """A star of namespaces behind one bridge, each port shaped both ways; or loopback."""

    def __init__(self, hosts: int, rate: str, ip: str, tc: str) -> None:
        self.hosts = hosts
        self.rate = rate
        self.ip = ip
        self.tc = tc
        self.prefix = f"fl{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.made: list[str] = []

    @property
    def shaped(self) -> bool:
        return self.rate != "loopback"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}" if self.shaped else "127.0.0.1"

    def _run(self, *argv: str) -> str:
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed: {res.stderr.strip()}")
        return res.stdout

    def _add_ns(self, name: str) -> None:
        self._run(self.ip, "netns", "add", name)
        self.made.append(name)
        self._run(self.ip, "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        # Burst: 10 ms at the rate, and never below a 64 KiB GSO segment (veth sends those).
        bits = parse_rate(self.rate)
        self._tbf("add", ns, dev, max(bits // 8 // 100, 96 * 1024))

    def _tbf(self, verb: str, ns: str, dev: str, burst: int) -> None:
        self._run(
            self.tc,
            "-n",
            ns,
            "qdisc",
            verb,
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            self.rate,
            "burst",
            str(burst),
            "latency",
            "20ms",
        )

    def pace(self, burst: int) -> None:
        """Every port in frames of one MTU, shaped with a burst of ``burst`` bytes (so a
        few-KB message is paced at the rate, not sent in one burst)."""
        ports = [(self.ns(i), "eth0") for i in range(self.hosts)]
        ports += [(self.switch, f"p{i}") for i in range(self.hosts)]
        for ns, dev in ports:
            self._run(self.ip, "-n", ns, "link", "set", dev, "gso_max_size", "1500")
            self._tbf("replace", ns, dev, burst)

    def up(self) -> None:
        if not self.shaped:
            return
        self._add_ns(self.switch)
        self._run(self.ip, "-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._run(self.ip, "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.hosts):
            host = self.ns(i)
            self._add_ns(host)
            port = f"p{i}"
            self._run(
                self.ip,
                "-n",
                host,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            self._run(self.ip, "-n", self.switch, "link", "set", port, "master", "br0")
            self._run(self.ip, "-n", self.switch, "link", "set", port, "up")
            self._run(self.ip, "-n", host, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            self._run(self.ip, "-n", host, "link", "set", "eth0", "up")
            self._shape(host, "eth0")  # what host i sends
            self._shape(self.switch, port)  # what host i receives

    def down(self) -> None:
        for name in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                self._run(self.ip, "netns", "del", name)
        self.made.clear()

    def prefix_argv(self, i: int) -> list[str]:
        return [self.ip, "netns", "exec", self.ns(i)] if self.shaped else []

    def port_bytes(self, i: int) -> tuple[int, int]:
        """(bytes host i sent, bytes host i received), from its switch port's counters."""
        if not self.shaped:
            return 0, 0
        out = json.loads(self._run(self.ip, "-n", self.switch, "-s", "-j", "link", "show", f"p{i}"))
        stats = out[0]["stats64"]
        # The switch port receives what the host sends, and sends what the host receives.
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def add_tool_flags(ap: argparse.ArgumentParser) -> None:
    """``--ip`` and ``--tc``: iproute2's commands (default ``FOUNDRY_IP`` / ``FOUNDRY_TC``, else
    the ones on PATH)."""
    ap.add_argument("--ip", default=os.environ.get("FOUNDRY_IP") or shutil.which("ip") or "ip")
    ap.add_argument("--tc", default=os.environ.get("FOUNDRY_TC") or shutil.which("tc") or "tc")


def add_shaped_flags(ap: argparse.ArgumentParser) -> None:
    """``--rate`` (default loopback: no namespaces), ``--burst-bytes`` and the tool flags of a
    script that puts each rank in a namespace of its own behind a shaped port."""
    ap.add_argument(
        "--rate",
        default="loopback",
        help="(as root) each rank in a network namespace of its own behind a port tbf-shaped "
        "to this rate (tc syntax, e.g. 1gbit; default loopback: no namespaces)",
    )
    ap.add_argument(
        "--burst-bytes",
        type=int,
        default=None,
        help="with --rate: one-frame segments and this tbf burst on every port, so small "
        "messages are paced (Network.pace; default: Network's burst)",
    )
    add_tool_flags(ap)


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate such as ``1gbit`` or ``100mbit``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"rate {rate!r}: use e.g. 1gbit, 100mbit or loopback")
    scale = {None: 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]
    return int(float(m.group(1)) * scale)


def rates_arg(text: str) -> list[str]:
    rates = [r.strip() for r in text.split(",") if r.strip()]
    for r in rates:
        if r != "loopback":
            parse_rate(r)
    return rates
