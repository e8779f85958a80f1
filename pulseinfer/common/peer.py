"""Knowing at once that the process at the other end of a ZMQ connection is gone.

A process that dies, by kill -9 too, closes its sockets; ZMQ reports the closed connection as
EVENT_DISCONNECTED on a monitor socket, in any pid namespace and over ipc:// or tcp://. Waiting
for a timeout instead left requests stalled for the whole timeout (30 s) after a kv_store died.
"""

from __future__ import annotations

import itertools

import zmq
from zmq.utils.monitor import recv_monitor_message

# pyzmq's default monitor address is named by the socket's file descriptor; a descriptor reused
# before libzmq's reaper has unbound the closed socket's monitor gave "Address already in use".
_monitor_ids = itertools.count()


class PeerLoss:
    """Disconnects of one connected socket's peers, as they happen."""

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED, addr=f"inproc://peer-loss-{next(_monitor_ids)}")

    def happened(self) -> bool:
        """True if a peer disconnected since the last call."""
        lost = False
        while self.monitor.poll(0):
            recv_monitor_message(self.monitor)
            lost = True
        return lost

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.disable_monitor()
        self.monitor.close(linger=0)


def watch(context: zmq.Context, address: str) -> tuple[zmq.Socket, PeerLoss]:
    """A socket connected to `address` only to watch the process bound there (it sends nothing)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket, PeerLoss(socket)
