"""Host syncs of a step, counted on the CPU: what would be a sync on CUDA.

On CUDA a host read of device memory stalls the CPU until the GPU drains, so it cannot queue the
next layer ahead; pulseinfer.common.syncs.count_host_syncs counts them there. The CPU has no device
to wait for, so DeviceTracker counts what would be syncs: a TorchFunctionMode follows which tensors
would live on the device (made with a `device=` argument, moved with `.to(device)`, or computed from
such a tensor) and counts, at the innermost frame of the package's code, every op that on CUDA would
read such a tensor on the host (`.tolist()`, `.item()`, `int()`, `bool()`, `.cpu()`, `nonzero`, a
boolean mask, a host index or value, `unique`, ...), copy host memory to the device blocking
(`torch.tensor(..., device=)`, `.to(device)` without non_blocking), or mix host and device tensors
(an error on CUDA). The tracker must be active from before the engine is built (it marks the device
tensors as they are made) and counts while `counting` is set.

What the proxy misses: ops of other threads (the mode is per thread; the I/O thread's recalls do not
stall the compute thread), code paths taken on CUDA only (the Triton kernels' wrappers, the pinned
pool's copies, stream and event waits), syncs inside torch's CUDA ops that leave no trace on the host
(a cuBLAS workspace allocation, the caching allocator freeing memory), and a tensor made without
`device=` that CUDA code would still place on the device (a step makes its host tensors without
one). `.to(x)` of a device tensor is taken for a move between devices, never a read (on the CPU the
device and the host are one).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import pulseinfer.gpu_worker
from pulseinfer.common import syncs as syncs_module

ROOT = Path(pulseinfer.gpu_worker.__file__).parent.parent  # the package's source: gpu_worker/, kernels/, ...
SYNCS = Path(syncs_module.__file__)
T = torch.Tensor
READS = {T.tolist, T.item, T.__int__, T.__float__, T.__bool__, T.__index__, T.__complex__, T.numpy, T.cpu, T.__contains__}
READS |= {T.__repr__, T.__format__, T.__array__}
SHAPED_BY_DATA = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select, torch.unique}
SHAPED_BY_DATA |= {T.unique, torch.unique_consecutive, T.unique_consecutive, torch.bincount, T.bincount, torch.equal, T.equal}
INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put}
HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
MOVES = {T.to, T.cuda, T.cpu, torch.as_tensor}  # on the CPU these may return their input itself


class DeviceTracker(TorchFunctionMode):
    """Marks the tensors that would be on the device and, while `counting`, counts the would-be
    syncs by (kind, site): the site is the innermost frame of the package's code; a sync inside
    common/syncs.py (its one transfer) is counted as `to_host` at its caller's site."""

    def __init__(self):
        super().__init__()
        self.counting = False
        self.syncs: Counter[tuple[str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if self.counting and (kind := _sync(func, args, kwargs, tensors)):
            self.syncs[_site(kind)] += 1
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            return out  # in place: the tensor stays where it is
        on_device = func not in READS and func is not T.pin_memory and (_names_device(func, args, kwargs) or any(map(_on_device, tensors)))
        if func in MOVES and out is args[0] and _on_device(out) != on_device:
            out = out.clone()  # moved between the host and the device: a new tensor there
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and on_device:
                value._on_device = True
        return out


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, "_on_device", False)


def _host(value) -> bool:
    """A host tensor with elements (a 0-d one is a scalar, which CUDA ops take from the host)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and not _on_device(value)


def _names_device(func, args, kwargs) -> bool:
    """`torch.empty(..., device=d)`, `torch.tensor(..., device=d)`, `t.to(d)`: the result is on the device."""
    moves = func in (T.to, T.cuda) and (func is T.cuda or any(isinstance(a, (torch.device, str)) for a in args[1:]))
    return moves or kwargs.get("device") is not None


def _sync(func, args, kwargs, tensors: list[torch.Tensor]) -> str | None:
    """What kind of host sync the call would be on CUDA, if any."""
    device = any(map(_on_device, tensors))
    if func in READS:
        return "read" if _on_device(args[0]) else None
    if func in SHAPED_BY_DATA or (func is torch.where and len(args) == 1):
        return "shape from data" if device else None
    if func in (torch.repeat_interleave, T.repeat_interleave):
        return "shape from data" if device and isinstance(args[1], torch.Tensor) and "output_size" not in kwargs else None
    if func in HOST_DATA or func in (T.to, T.cuda):
        copies = _names_device(func, args, kwargs) and not _on_device(args[0])
        return "pageable copy" if copies and not kwargs.get("non_blocking") else None
    if func is T.copy_:
        crossing = _on_device(args[0]) != _on_device(args[1]) and args[1].dim() > 0
        return "pageable copy" if crossing and not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking") else None
    if func in INDEXING:
        return _indexing(args)
    return "mixed devices" if device and any(map(_host, tensors)) else None  # an error on CUDA


def _indexing(args) -> str | None:
    """Indexing with a boolean mask, with host indices into a device tensor (or the reverse), or
    setting host values into a device tensor: each reads or copies across on CUDA."""
    target, index = args[0], args[1]
    indices = list(index) if isinstance(index, tuple) else [index]
    tensors = [i for i in indices if isinstance(i, torch.Tensor)]
    if any(i.dtype == torch.bool and (_on_device(target) or _on_device(i)) for i in tensors):
        return "boolean mask"
    if _on_device(target) and (any(map(_host, tensors)) or any(isinstance(i, list) for i in indices)):
        return "host index"
    if not _on_device(target) and any(map(_on_device, tensors)):
        return "device index"
    value = args[2] if len(args) > 2 else None
    if _on_device(target) and _host(value) or not _on_device(target) and _on_device(value):
        return "host value"
    return None


def _site(kind: str) -> tuple[str, str]:
    """(kind, file:function of the innermost frame of the package's code outside common/syncs.py)."""
    frame, transfer = sys._getframe(2), False
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path == SYNCS:
            transfer = True
        elif path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / "tests") and ".venv" not in path.parts:
            return ("to_host" if transfer else kind, f"{path.relative_to(ROOT)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return kind, "elsewhere"


def place_on_device(tensors: Iterable[torch.Tensor]) -> None:
    """Marks tensors made before the tracker was entered as the device's (a model's weights): moved
    to the device, they are then taken as already there, without a copy."""
    for tensor in tensors:
        tensor._on_device = True
