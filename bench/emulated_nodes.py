"""Several hosts on one machine (docs/deployment.md, several nodes), for the multi-node tests and benchmark: each node a
Linux network namespace with its own PID namespace and private /dev/shm and TMPDIR (so no ipc path
or shared-memory segment can cross nodes), the gateway in a namespace of its own that names the
nodes in its /etc/hosts (`ip netns exec` binds /etc/netns/<ns>/hosts there), all joined by veth
pairs to a bridge in a hub namespace. Nothing touches the host's own network: the test's traffic
stays inside the namespaces, and the test reaches the gateway from a thread that entered its
namespace (setns). Root only. Everything made is removed by `close` (and, for a run that was
killed, by the next run's sweep)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
PREFIX = "pie-"  # pie-<creator pid>-<role>
SUBNET = "10.231.7"
NODE_PORT = 50052
STATUS_PORT = 9400
HTTP_PORT = 8000
CLONE_NEWNET = 0x40000000
BIN = Path(sys.executable).parent


def missing() -> str | None:
    """Why the emulated cluster cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root: network and PID namespaces (ip netns, unshare)"
    for tool in ("ip", "unshare", "openssl"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def sweep() -> None:
    """Removes namespaces (and their processes) left by runs that were killed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    for ns in [n for n in listed if n.startswith(PREFIX)]:
        creator = ns.removeprefix(PREFIX).split("-")[0]
        if creator.isdigit() and not Path(f"/proc/{creator}").exists():
            _remove_namespace(ns)
    for stale in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-n*"):  # node run directories (tmpdir)
        if not Path(f"/proc/{stale.name.removeprefix(PREFIX).split('-')[0]}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _remove_namespace(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _enter(ns: str) -> None:
    """Moves the calling thread (only it) into network namespace `ns`."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    finally:
        os.close(fd)


class EmulatedCluster:
    """`nodes` node namespaces (node1..nodeN at SUBNET.11..), a gateway namespace at SUBNET.1."""

    def __init__(self, nodes: int, logs: Path, node_flags: list[str], tls_flags: list[str]):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hub, self.gateway_ns = f"{self.tag}-hub", f"{self.tag}-gw"
        self.node_ns = [f"{self.tag}-n{i}" for i in range(1, nodes + 1)]
        self.logs = logs
        self.node_flags, self.tls_flags = node_flags, tls_flags
        self.node_processes: dict[int, subprocess.Popen] = {}
        self.gateways: dict[int, subprocess.Popen] = {}  # by HTTP port
        self.client = ThreadPoolExecutor(16, initializer=_enter, initargs=(self.gateway_ns,))

    @staticmethod
    def name(i: int) -> str:
        return f"node{i + 1}"

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    # ------------------------------------------------------------ network

    def build(self) -> None:
        sweep()
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for ns, port, address in [(self.gateway_ns, "gw", f"{SUBNET}.1")] + [
            (ns, f"n{i}", self.address(i)) for i, ns in enumerate(self.node_ns)
        ]:
            _ip("netns", "add", ns)
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        hosts = Path(f"/etc/netns/{self.gateway_ns}/hosts")
        hosts.parent.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{self.address(i)} {self.name(i)}" for i in range(len(self.node_ns))]
        hosts.write_text("\n".join(lines) + "\n")

    def link(self, i: int, up: bool) -> None:
        """Cuts (or restores) node i's cable: its processes live on, unreachable."""
        _ip("-n", self.hub, "link", "set", f"n{i}", "up" if up else "down")

    # ------------------------------------------------------------ processes

    def start_node(self, i: int) -> None:
        argv = [
            str(BIN / "pulseinfer"), "node", "--listen", f"0.0.0.0:{NODE_PORT}", "--node-name", self.name(i),
            "--metrics-listen", f"0.0.0.0:{STATUS_PORT}", *self.tls_flags, *self.node_flags,
        ]  # fmt: skip
        # a PID namespace of its own (its launcher is pid 1: killing it kills the node), a private /dev/shm, and a
        # private TMPDIR for its run directory (a tmpfs over the node's own directory, seen empty from outside)
        private = 'mount -t tmpfs -o size=16g tmpfs /dev/shm && mount -t tmpfs -o size=512m tmpfs "$TMPDIR" && exec "$@"'
        command = ["ip", "netns", "exec", self.node_ns[i], "unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
        log = open(self.logs / f"{self.name(i)}.log", "ab")  # noqa: SIM115 - the process holds it
        environment = os.environ | {"TMPDIR": str(self.tmpdir(i))}
        self.node_processes[i] = subprocess.Popen([*command, "sh", "-c", private, "sh", *argv], stdout=log, stderr=log, env=environment)

    def tmpdir(self, i: int) -> Path:
        """Short: unix socket paths in it must stay under 108 bytes."""
        path = Path(tempfile.gettempdir()) / f"{self.tag}-n{i}"
        path.mkdir(exist_ok=True)
        return path

    def start_gateway(self, route: str, port: int = HTTP_PORT) -> None:
        """A gateway replica serving HTTP on `port` (gRPC on port + 1) in the gateway's namespace."""
        nodes = ",".join(f"{self.name(i)}:{NODE_PORT}" for i in range(len(self.node_ns)))
        argv = [
            str(BIN / "pulseinfer"), "gateway", "--nodes", nodes, "--route", route, "--http-port", str(port),
            "--grpc-port", str(port + 1), *self.tls_flags,
        ]  # fmt: skip
        log = open(self.logs / f"gateway-{port}.log", "ab")  # noqa: SIM115
        self.gateways[port] = subprocess.Popen(["ip", "netns", "exec", self.gateway_ns, *argv], stdout=log, stderr=log)

    def stop_gateway(self, port: int = HTTP_PORT) -> None:
        gateway = self.gateways.pop(port)
        gateway.terminate()
        try:
            gateway.wait(timeout=15)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()

    def node_pid(self, i: int) -> int:
        """The node's launcher as the host sees it: pid 1 of its PID namespace, unshare's child."""
        unshare = self.node_processes[i].pid
        children = Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()
        return int(children[0])

    def kill_node(self, i: int) -> None:
        """kill -9 of the node's launcher: the kernel kills every process of its PID namespace."""
        os.kill(self.node_pid(i), signal.SIGKILL)
        self.node_processes.pop(i).wait(timeout=30)

    def close(self) -> None:
        self.client.shutdown(wait=False, cancel_futures=True)
        for port in list(self.gateways):
            self.stop_gateway(port)
        for process in self.node_processes.values():
            process.kill()  # unshare --kill-child: the node's namespace dies with it
            process.wait()
        for ns in [self.gateway_ns, *self.node_ns, self.hub]:
            _remove_namespace(ns)
        for i in range(len(self.node_ns)):
            shutil.rmtree(self.tmpdir(i), ignore_errors=True)

    # ------------------------------------------------------------ the client side, from the gateway's namespace

    def python(self, code: str, *args: str) -> str:
        """Runs Python code in a process of the gateway's namespace (gRPC dials from threads of its own,
        which a thread's setns does not move); returns its stdout."""
        command = ["ip", "netns", "exec", self.gateway_ns, sys.executable, "-c", code, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    def run(self, fn: Callable[..., T], *args) -> T:
        return self.client.submit(fn, *args).result()

    def http(self, url: str, body: dict | None = None, timeout_s: float = 10.0) -> tuple[int, dict | str]:
        """A request from the gateway's namespace (its own 127.0.0.1, or a node's status port)."""

        def call() -> tuple[int, dict | str]:
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    raw = response.read().decode()
                    status = response.status
            except urllib.error.HTTPError as e:
                raw, status = e.read().decode(), e.code
            try:
                return status, json.loads(raw)
            except ValueError:
                return status, raw

        return self.run(call)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not within {timeout_s:.0f} s; logs in {self.logs}")
            processes = [(f"gateway {port}", p) for port, p in self.gateways.items()]
            for name, process in processes + [(self.name(i), p) for i, p in self.node_processes.items()]:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}; logs in {self.logs}")
            time.sleep(0.5)

    def node_states(self, port: int = HTTP_PORT) -> dict[str, str]:
        """Each node's state as a gateway's /health reports it, by node name."""
        try:
            _, body = self.http(f"http://127.0.0.1:{port}/health", timeout_s=5)
        except OSError:
            return {}
        if not isinstance(body, dict):
            return {}
        return {address.split(":")[0]: node["state"] for address, node in body.get("nodes", {}).items()}

    def node_metrics(self, i: int) -> dict[str, float]:
        """Node i's /metrics samples, summed over labels."""
        _, text = self.http(f"http://{self.address(i)}:{STATUS_PORT}/metrics")
        samples: dict[str, float] = {}
        for line in str(text).splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                samples[key] = samples.get(key, 0.0) + float(value)
        return samples
