"""What machine is this? sw_detect_profile, and the per-profile training table.

Detection reads a few files under ``root`` (``/`` normally; tests pass a fake tree):

- ``proc/device-tree/model``: a Raspberry Pi names itself there ("Raspberry Pi 4 Model B
  Rev 1.4"). Pi 4 and newer (400, 5, 500, Compute Module 4/5) map to RPI4_2G / 4G / 8G by
  memory, the nearest profile the protocol has; Pi 3 and older, Zero included, to RPI3.
- ``proc/meminfo`` (MemTotal) and the CPUs this process may use; both capped by the cgroup
  limits (v2 ``memory.max`` / ``cpu.max``, v1 ``memory.limit_in_bytes`` / CFS quota), so a
  2 GiB, 2-CPU container on a 64-core server is classified as the small machine it is.
- ``proc/cpuinfo``: the CPU's name, for the description only.

Any other machine is classified by cores and memory (``MACHINE_CLASSES``, first match wins).
Memory thresholds sit about 10 % under the nominal size, because MemTotal excludes what the
firmware and kernel reserve (a "16 GB" laptop reports about 15.5 GiB).

The batch table (micro-batch and accumulation per profile, ``PROFILE_TABLE``) is policy and
lives here; the profile enum and its names are the wire's (``foundry.wire.fdtc``).
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from foundry.wire.fdtc import HardwareProfile, profile_name

__all__ = [
    "MACHINE_CLASSES",
    "PROFILE_TABLE",
    "HardwareInfo",
    "classify",
    "default_threads",
    "detect_profile",
    "profile_accumulation_steps",
    "profile_batch_size",
    "profile_name",
]

GIB_MB = 1024  # memory is counted in MiB ("memory_mb" on the wire)

# sw_profile_batch_size / sw_profile_accumulation_steps. Samples per round grow with the
# machine's expected compute (a Pi 4 ~ 2x a Pi 3, each class above ~ 2x the one below); the
# micro-batch is what memory allows, and accumulation makes up the rest, so small devices run
# small batches and accumulate more. The coordinator re-balances by measured samples/s later.
# profile: (micro-batch, accumulation steps), and samples per round in the comment.
PROFILE_TABLE: Mapping[HardwareProfile, tuple[int, int]] = MappingProxyType(
    {
        HardwareProfile.RPI3: (1, 8),  # 8
        HardwareProfile.RPI4_2G: (2, 8),  # 16
        HardwareProfile.RPI4_4G: (4, 4),  # 16
        HardwareProfile.RPI4_8G: (8, 2),  # 16
        HardwareProfile.LAPTOP_LIGHT: (8, 4),  # 32
        HardwareProfile.LAPTOP_MID: (16, 4),  # 64
        HardwareProfile.DESKTOP_MID: (32, 4),  # 128
        HardwareProfile.DESKTOP_HEAVY: (64, 4),  # 256
        HardwareProfile.SERVER: (128, 4),  # 512
        HardwareProfile.UNKNOWN: (2, 4),  # 8: as careful as a Pi 3 until measured
    }
)


def _known(profile: int) -> HardwareProfile:
    try:
        return HardwareProfile(profile)
    except ValueError:
        return HardwareProfile.UNKNOWN


def profile_batch_size(profile: int) -> int:
    """sw_profile_batch_size: the micro-batch a machine of this profile starts with."""
    return PROFILE_TABLE[_known(profile)][0]


def profile_accumulation_steps(profile: int) -> int:
    """sw_profile_accumulation_steps: micro-batches accumulated per round at the start."""
    return PROFILE_TABLE[_known(profile)][1]


# Non-Pi machines: (profile, at least this many cores, at least this much memory in MiB).
MACHINE_CLASSES: tuple[tuple[HardwareProfile, int, int], ...] = (
    (HardwareProfile.SERVER, 24, 60 * GIB_MB),  # "64 GB", many cores
    (HardwareProfile.DESKTOP_HEAVY, 12, 28 * GIB_MB),  # "32 GB"
    (HardwareProfile.DESKTOP_MID, 8, 14 * GIB_MB),  # "16 GB"
    (HardwareProfile.LAPTOP_MID, 4, 7 * GIB_MB),  # "8 GB"
    (HardwareProfile.LAPTOP_LIGHT, 2, 3 * GIB_MB),  # "4 GB"
)
# Raspberry Pi 4 and newer, by memory: below 3 GiB the 1 and 2 GB boards, below 6 GiB 4 GB.
PI_MEMORY_CLASSES: tuple[tuple[HardwareProfile, int], ...] = (
    (HardwareProfile.RPI4_2G, 3 * GIB_MB),
    (HardwareProfile.RPI4_4G, 6 * GIB_MB),
)
_PI_PROFILES = frozenset(
    {
        HardwareProfile.RPI3,
        HardwareProfile.RPI4_2G,
        HardwareProfile.RPI4_4G,
        HardwareProfile.RPI4_8G,
    }
)
_PI_GENERATION = re.compile(r"Raspberry Pi (?:Compute Module )?(\d)")
# cgroup "no limit" is a huge number (v1: 2**63 rounded down to a page); anything above this
# is not a limit a machine could have.
_NO_LIMIT_BYTES = 1 << 60


@dataclass(frozen=True)
class HardwareInfo:
    profile: HardwareProfile
    cores: int
    memory_mb: int
    description: str

    @property
    def batch_size(self) -> int:
        return profile_batch_size(self.profile)

    @property
    def accumulation_steps(self) -> int:
        return profile_accumulation_steps(self.profile)


def classify(model: str | None, cores: int, memory_mb: int) -> HardwareProfile:
    """The profile of a machine: ``model`` is its device-tree model string, if it has one."""
    if model is not None and "Raspberry Pi" in model:
        match = _PI_GENERATION.search(model)
        if match is None or int(match.group(1)) < 4:
            return HardwareProfile.RPI3
        for profile, below in PI_MEMORY_CLASSES:
            if memory_mb < below:
                return profile
        return HardwareProfile.RPI4_8G
    for profile, min_cores, min_memory in MACHINE_CLASSES:
        if cores >= min_cores and memory_mb >= min_memory:
            return profile
    return HardwareProfile.UNKNOWN


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def _meminfo_mb(root: Path) -> int | None:
    text = _read(root / "proc/meminfo")
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    if match:
        return int(match.group(1)) // 1024
    if root == Path("/"):  # no /proc (macOS, BSD): ask the OS
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
        except (ValueError, OSError):
            return None
    return None


def _cgroup_memory_mb(root: Path) -> int | None:
    for rel in ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(root / rel) or "").strip()
        if text.isdigit() and int(text) < _NO_LIMIT_BYTES:
            return int(text) // (1 << 20)
    return None


def _cgroup_cpus(root: Path) -> int | None:
    """CPUs a CFS quota allows (rounded up), or None without a quota."""
    quota = period = None
    v2 = (_read(root / "sys/fs/cgroup/cpu.max") or "").split()
    if len(v2) == 2 and v2[0].isdigit() and v2[1].isdigit():
        quota, period = int(v2[0]), int(v2[1])
    else:
        q = (_read(root / "sys/fs/cgroup/cpu/cpu.cfs_quota_us") or "").strip()
        p = (_read(root / "sys/fs/cgroup/cpu/cpu.cfs_period_us") or "").strip()
        if q.isdigit() and p.isdigit():  # -1 (no quota) is not all digits
            quota, period = int(q), int(p)
    if quota is None or not period:
        return None
    return max(1, math.ceil(quota / period))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects taskset / cpusets
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return None


def _physical_cores(root: Path, cpus: set[int]) -> int | None:
    """Distinct (package, core) pairs among ``cpus`` (sysfs topology), None where unknown: two
    hyperthreads of one core share its execution units, and a memory-bound decode gains
    nothing from the second."""
    cores = set()
    for cpu in cpus:
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        core, package = _read(topology / "core_id"), _read(topology / "physical_package_id")
        if core is None or package is None:
            return None
        cores.add((package.strip(), core.strip()))
    return len(cores) or None


def default_threads(root: Path = Path("/")) -> int:
    """The threads a computing process uses unless told (``--threads``): the CPUs it may run
    on (affinity, capped by a cgroup CPU quota), or the physical cores among them where those
    are known and fewer."""
    allowed = _allowed_cpus()
    n = len(allowed) if allowed else (os.cpu_count() or 1)
    quota = _cgroup_cpus(root)
    if quota is not None:
        n = min(n, quota)
    if allowed:
        physical = _physical_cores(root, allowed)
        if physical is not None:
            n = min(n, physical)
    return max(1, n)


def _cpu_name(root: Path) -> str:
    text = _read(root / "proc/cpuinfo") or ""
    match = re.search(r"^(?:model name|Model|Hardware)\s*:\s*(.+)$", text, re.MULTILINE)
    name = match.group(1).strip() if match else ""
    arch = platform.machine()
    return f"{name} ({arch})" if name else arch or "unknown CPU"


def detect_profile(root: Path = Path("/"), *, cpu_count: int | None = None) -> HardwareInfo:
    """sw_detect_profile: this machine's profile, cores and memory.

    ``cpu_count`` replaces the CPUs the OS reports (tests); a cgroup quota still caps it.
    """
    model_text = _read(root / "proc/device-tree/model")
    model = model_text.rstrip("\0\n ") if model_text else None
    cores = cpu_count if cpu_count is not None else _usable_cpus()
    quota_cpus = _cgroup_cpus(root)
    if quota_cpus is not None:
        cores = min(cores, quota_cpus)
    memory = _meminfo_mb(root)
    limit = _cgroup_memory_mb(root)
    if limit is not None:
        memory = limit if memory is None else min(memory, limit)
    memory_mb = memory or 0
    profile = classify(model, cores, memory_mb)
    description = model if profile in _PI_PROFILES and model else _cpu_name(root)
    return HardwareInfo(profile, max(cores, 1), memory_mb, description)
