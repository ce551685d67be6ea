"""Host memory: what is free, what this process holds, and one allocator setting that keeps it honest.

* :func:`available_bytes` is the kernel's ``MemAvailable`` (``/proc/meminfo``): free memory plus what it can
  reclaim (page cache) without swapping — what a new calibration can count on.
* :func:`rss_bytes` / :func:`peak_rss_bytes` read this process's resident set and its high-water mark
  (``VmRSS`` / ``VmHWM`` in ``/proc/self/status``); :func:`reset_peak_rss` restarts the high-water mark (writing
  ``5`` to ``/proc/self/clear_refs``), so a phase's exact peak can be read without sampling.
* :func:`pin_mmap_threshold` fixes glibc's ``M_MMAP_THRESHOLD``. By default glibc raises the threshold to the size
  of every large block it frees (up to 32 MiB), after which blocks of activation size come from the heap and are
  kept there when freed: a layer-by-layer calibration then holds about twice the memory it uses. With the
  threshold fixed, blocks of 256 KiB or more are mapped and unmapped, and resident memory follows what is alive.
  The CLI and the local launcher call it in every rank; library users on CPU may call it themselves. It costs time:
  every such block is mapped (and its pages faulted in) afresh — SmolLM2-135M's w8a8-int8 calibration, 32 × 256
  tokens, one process: 19.4 s instead of 11.6 s, for a peak growth of 104 MiB instead of 178 MiB. The environment
  variable ``SHARDCAL_MMAP_THRESHOLD`` overrides the threshold (bytes), and ``0`` leaves glibc's default alone.

Everything degrades to ``None`` / ``False`` where the platform has no such file or function (not Linux, not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from ..errors import UsageError

#: The threshold :func:`pin_mmap_threshold` sets by default: blocks of at least this many bytes are mmapped.
DEFAULT_MMAP_THRESHOLD = 256 << 10
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_headroom(root: Path) -> int | None:
    """What this process's cgroup may still allocate (v2 ``memory.max - memory.current``, or v1), None if unlimited."""
    for limit_name, usage_name in (
        ("memory.max", "memory.current"),
        ("memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        for folder in (root, root / "memory"):
            try:
                limit = (folder / limit_name).read_text().strip()
                usage = int((folder / usage_name).read_text().strip())
            except (OSError, ValueError):
                continue
            if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
                return None
            return max(0, int(limit) - usage)
    return None


def available_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int | None:
    """Host memory a new process can count on: ``MemAvailable`` (free + reclaimable memory of the machine), or less
    when this process's cgroup (a container's memory limit) allows less; None where unknown."""
    free = _meminfo_available(Path(meminfo))
    headroom = _cgroup_headroom(Path(cgroup))
    if free is None or headroom is None:
        return free if headroom is None else headroom
    return min(free, headroom)


def rss_bytes() -> int | None:
    """This process's resident memory now (``VmRSS``), or None where unknown."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """This process's highest resident memory since it started or since :func:`reset_peak_rss` (``VmHWM``)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Restart the high-water mark :func:`peak_rss_bytes` reads at the current resident size; False if unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def pin_mmap_threshold(threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (default: ``SHARDCAL_MMAP_THRESHOLD`` from the environment,
    else :data:`DEFAULT_MMAP_THRESHOLD`; see the module docstring). False where there is no glibc, or when the
    threshold is 0 (glibc's default kept)."""
    if threshold is None:
        threshold = _threshold_from_env()
    if threshold == 0:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def _threshold_from_env() -> int:
    text = os.environ.get("SHARDCAL_MMAP_THRESHOLD", "").strip()
    if not text:
        return DEFAULT_MMAP_THRESHOLD
    if not text.isdigit():
        raise UsageError(f"SHARDCAL_MMAP_THRESHOLD={text!r}: expected a number of bytes (0: glibc's default)")
    return int(text)
