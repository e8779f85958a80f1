"""Refuses a pool the machine cannot hold, naming the flag to change, rather than be killed (the
kernel's OOM killer, a SIGBUS on a full /dev/shm) or fail deep inside torch or mmap."""

from __future__ import annotations

import os
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def available_bytes(device: torch.device, shared: bool = False) -> int:
    """Free memory of the device; `shared`: of a /dev/shm segment, also bounded by that file system's free space."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    if shared:
        stat = os.statvfs(SHM_DIR)
        available = min(available, stat.f_bavail * stat.f_frsize)
    return available


def check_fits(nbytes: int, device: torch.device, what: str, shared: bool = False) -> None:
    available = available_bytes(device, shared)
    if nbytes > available:
        where = f"{SHM_DIR} (shared memory)" if shared and device.type == "cpu" else f"{device.type} memory"
        raise ValueError(f"{what} needs {nbytes / 2**30:.1f} GiB, {where} has {available / 2**30:.1f} GiB available")
