"""Host syncs: counting them on CUDA, and moving a step's small tensors between the host and the
device without them.

On CUDA every read of device memory by the host (`.tolist()`, `.item()`, `int(t)`, `.cpu()`, a
boolean mask, `nonzero`) waits until the GPU has drained everything queued before it, and so does a
copy from pageable host memory (`torch.tensor(list, device=cuda)`, `t.to(cuda)`): while it waits
the CPU cannot queue the next layer's kernels ahead of the GPU. A decode step moves its index
tensors with `to_device` (one pinned, non-blocking copy: no sync) and reads what the host must
know with `to_host` (one transfer: one sync, however many tensors).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") warns
ALIGN = 16  # bytes: where each packed part starts


class HostSyncs:
    """Syncs counted so far: `count` on the thread that counts, `other_threads` on the rest (the
    I/O thread's recalls, which never stall the compute thread)."""

    def __init__(self) -> None:
        self.count = 0
        self.other_threads = 0
        self._thread = threading.get_ident()

    def _add(self) -> None:
        if threading.get_ident() == self._thread:
            self.count += 1
        else:
            self.other_threads += 1


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Counts the host syncs made inside the block: CUDA reports each under
    `torch.cuda.set_sync_debug_mode("warn")`, set for the block (the previous mode and the warning
    filters are restored on exit). Without CUDA nothing can be counted: `count` stays 0 (the CPU
    has no device to wait for; tests/test_host_syncs.py counts the would-be syncs of a step there)."""
    syncs = HostSyncs()
    if not torch.cuda.is_available():
        yield syncs
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every sync warns, not only a line's first
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if _SYNC_WARNING in str(message):
                syncs._add()
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show  # catch_warnings restores it
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def to_device(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on `device`, with one copy: packed into one (on CUDA pinned) host buffer and
    copied with non_blocking, so the host goes on at once. Returns new tensors (views of one buffer there)."""
    pin = device.type == "cuda" and any(part.numel() for part in parts)
    return _unpack(_pack(parts, pin).to(device, non_blocking=True), parts)


def to_host(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors on the host, with one transfer: on CUDA one host sync however many tensors
    (of whatever dtypes) are read. Returns new host tensors."""
    return _unpack(_pack(parts, pin=False).cpu(), parts)


def _pack(parts: Sequence[torch.Tensor], pin: bool) -> torch.Tensor:
    """The parts' bytes in one buffer on their device (pinned if `pin`), each part at a multiple of
    ALIGN bytes: viewing it as its dtype needs its element size, and Triton specializes a kernel on
    whether each pointer is 16-byte aligned, so packed tables and lengths always give the same one."""
    devices = {part.device for part in parts}
    if len(devices) > 1:
        raise ValueError(f"cannot pack tensors of several devices: {sorted(map(str, devices))}")
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    offsets = _offsets(parts)
    buffer = parts[0].new_empty(offsets[-1], dtype=torch.uint8, pin_memory=pin)  # on the parts' device
    for part, start in zip(parts, offsets):
        buffer[start : start + part.numel() * part.element_size()].copy_(part.reshape(-1).view(torch.uint8))
    return buffer


def _unpack(buffer: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parts' views of a buffer `_pack` made of them."""
    return [
        buffer[start : start + part.numel() * part.element_size()].view(part.dtype).view(part.shape)
        for part, start in zip(parts, _offsets(parts))
    ]


def _offsets(parts: Sequence[torch.Tensor]) -> list[int]:
    """Where each part starts in the packed buffer, and its total size last."""
    offsets = [0]
    for part in parts:
        if part.element_size() > ALIGN:
            raise ValueError(f"cannot pack {part.dtype}: elements of more than {ALIGN} bytes")
        offsets.append(offsets[-1] + -(-part.numel() * part.element_size() // ALIGN) * ALIGN)
    return offsets
