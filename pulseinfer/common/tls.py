"""gRPC between hosts (docs/deployment.md, several nodes): mutual TLS from certificate files (on Kubernetes, a
kubernetes.io/tls Secret with ca.crt), or plaintext on loopback and unix sockets only unless the
operator says --insecure. Node and gateway each present a certificate the other's CA signed."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

# a peer that vanishes (power, a cut link) sends no RST: pings find it within about 3 s, so its
# in-flight requests fail in time (the 5 s) instead of when TCP gives up, minutes later
CLIENT_KEEPALIVE = (
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
# the server side accepts those pings (its default answers a ping more often than every 5 min with GOAWAY)
SERVER_KEEPALIVE = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


@dataclass(frozen=True)
class TlsConfig:
    tls_cert: str | None = None  # PEM certificate this process presents
    tls_key: str | None = None  # its private key
    tls_ca: str | None = None  # PEM CA bundle the peer's certificate must chain to (mutual: both sides check)
    insecure: bool = False  # allow plaintext gRPC on a non-loopback address (a private network you trust)

    def __post_init__(self) -> None:
        given = [f for f in (self.tls_cert, self.tls_key, self.tls_ca) if f]
        if given and len(given) != 3:
            raise ValueError("mutual TLS needs all three of --tls-cert, --tls-key and --tls-ca")
        if given and self.insecure:
            raise ValueError("--insecure and --tls-* contradict each other: give one")

    @property
    def enabled(self) -> bool:
        return self.tls_cert is not None

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return tuple(Path(f).read_bytes() for f in (self.tls_key, self.tls_cert, self.tls_ca))

    def check_plaintext(self, address: str, role: str) -> None:
        """Refuses plaintext gRPC on an address other hosts can reach, unless --insecure."""
        if not self.enabled and not self.insecure and not is_local(address):
            raise ValueError(
                f"{role} {address} is not a loopback address: give --tls-cert/--tls-key/--tls-ca for mutual TLS "
                "(docs/deployment.md 'Several nodes'), or --insecure to serve plaintext on a network you trust"
            )

    def add_port(self, server: grpc.aio.Server, address: str) -> None:
        if self.enabled:
            key, cert, ca = self._read()
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
            bound = server.add_secure_port(address, credentials)
        else:
            self.check_plaintext(address, "--listen")
            bound = server.add_insecure_port(address)
        if bound == 0:
            raise RuntimeError(f"cannot listen on {address}")

    def channel(self, address: str, server_name: str | None = None) -> grpc.aio.Channel:
        """A channel to a node; `server_name`: the name its certificate must carry when `address` is
        an IP found by resolving that name (a headless Service's pods share one certificate)."""
        if self.enabled:
            key, cert, ca = self._read()
            credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            named = (("grpc.ssl_target_name_override", server_name),) if server_name else ()
            return grpc.aio.secure_channel(address, credentials, options=CLIENT_KEEPALIVE + named)
        return grpc.aio.insecure_channel(address, options=CLIENT_KEEPALIVE)


def is_local(address: str) -> bool:
    """A unix socket, or a HOST:PORT whose host is loopback (localhost, 127.0.0.0/8, ::1)."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
