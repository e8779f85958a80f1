"""Offloaded requests on the worker.

An offloaded request holds a fixed device footprint: sink blocks (the first tokens), a ring of
recent-window blocks (the partly filled block included) and a hot buffer of recalled blocks.
Every other full block lives in the host pool. Each block is written back once, when it fills
(earlier than it leaves the window, so the write has a window's worth of steps to complete);
its key summary (low-rank keys, or min and max per kv head: --scorer) stays on device for selection.

Decode attends sink + selected host blocks + window, in logical order: with a budget that
covers every host block the attended K/V are the dense ones, bit for bit, in the dense order.
Prefill of an offloaded request attends its whole context (read back from the host pool).

Modules, one concern each: `config` (flags, footprint geometry, the host tier), `layout` (where
a request's blocks live), `hot` (the hot buffers' LRU), `selection` (top blocks per row, block
tables), `recall` (copies from the host pool, the I/O thread), `writes` (new K/V to the device
and the host pool), `counters`, `step` (one step, layer by layer), `manager` (requests' lives).
"""
