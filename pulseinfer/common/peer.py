"""Knowing at once that the process at the other end of a ZMQ connection is gone.

A process that dies, by kill -9 too, closes its sockets; ZMQ reports the closed connection as
EVENT_DISCONNECTED on a monitor socket, in any pid namespace and over ipc:// or tcp://. Waiting
for a timeout instead left requests stalled for the whole timeout (30 s) after a kv_store died.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message


class PeerLoss:
    """Disconnects of one connected socket's peers, as they happen."""

    def __init__(self, socket: zmq.Socket):
        self.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def happened(self) -> bool:
        """True if a peer disconnected since the last call."""
        lost = False
        while self.monitor.poll(0):
            recv_monitor_message(self.monitor)
            lost = True
        return lost

    def close(self) -> None:
        self.monitor.close(linger=0)


def watch(context: zmq.Context, address: str) -> tuple[zmq.Socket, PeerLoss]:
    """A socket connected to `address` only to watch the process bound there (it sends nothing)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket, PeerLoss(socket)
