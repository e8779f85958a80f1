"""Certificates for the mutual-TLS tests, made with the openssl CLI: a CA and one certificate it
signed for both roles (server and client), naming the given hosts."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certs(directory: Path, names: list[str], ips: list[str] = ("127.0.0.1",)) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt"))
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", f"/CN=pulseinfer-test-ca-{directory.name}", "-keyout", str(ca_key), "-out", str(ca),
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", "/CN=pulseinfer", "-keyout", str(key), "-out", str(csr),
    )  # fmt: skip
    extensions = directory / "ext.cnf"
    alt = ",".join([f"DNS:{n}" for n in names] + [f"IP:{ip}" for ip in ips])
    extensions.write_text(f"subjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "2", "-extfile", str(extensions), "-out", str(cert),
    )  # fmt: skip
    return Certs(ca, cert, key)
