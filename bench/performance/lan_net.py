"""The shaped network of ``lan.py`` (as root): a star of network namespaces behind one bridge,
every port shaped both ways by ``tc tbf``; or loopback, with no namespaces and no shaping."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
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
        burst = max(bits // 8 // 100, 96 * 1024)
        self._run(
            self.tc,
            "-n",
            ns,
            "qdisc",
            "add",
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
