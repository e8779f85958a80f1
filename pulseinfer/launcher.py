"""`pulseinfer serve`: the whole cluster on one machine, one OS process per service; `pulseinfer
node`: the same less the gateway, one host of several (docs/deployment.md, several nodes), its scheduler's gRPC on
--listen for gateways elsewhere and its status (pulseinfer/node_status.py) on --metrics-listen.

Starts kv_store, scheduler, N workers and the gateway in that order, each waiting for the
one before to be ready; restarts a child that dies; on SIGINT/SIGTERM stops them all. Every
child gets PR_SET_PDEATHSIG, so none outlives the launcher even if it is killed with -9.
Internal channels are ipc:// and unix:// sockets in a private run directory. The API key
(--api-key-file, else $PULSEINFER_API_KEY) reaches the gateway in its environment, never on
a command line, and no other child gets it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pulseinfer import probe
from pulseinfer.common.api_key import API_KEY_ENV, resolve_api_key
from pulseinfer.common.flags import to_flags
from pulseinfer.common.proc import PARENT_ENV, setup_logging
from pulseinfer.common.tls import TlsConfig
from pulseinfer.gateway.server import GatewayConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.server import WorkerServiceConfig
from pulseinfer.gpu_worker.sparse import check_mode
from pulseinfer.kv_store.segments import hold, remove_unheld, sweep
from pulseinfer.kv_store.server import KVStoreConfig
from pulseinfer.node_status import NodeStatus
from pulseinfer.scheduler.batcher import BatcherConfig
from pulseinfer.scheduler.core import SchedulerConfig

log = logging.getLogger("launcher")
RESTART_LIMIT = 5  # restarts of one child within RESTART_WINDOW_S before the launcher gives up
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 10.0
RUN_DIR_PREFIX = "pulseinfer-run-"


@dataclass(frozen=True)
class NodeConfig:
    """One host's services: kv_store, scheduler and workers (`pulseinfer node`; `pulseinfer serve` adds the gateway)."""

    model: str | None = None
    load_format: str = "auto"  # auto | dummy: seeded random weights of the model's geometry
    workers: int = 1
    host_kv_tokens: int = KVStoreConfig.host_kv_tokens
    worker_timeout_s: float = SchedulerConfig.worker_timeout_s
    kv_store_timeout_s: float = WorkerServiceConfig.kv_store_timeout_s  # a worker's wait for a kv_store answer
    startup_timeout_s: float = 300.0
    overlap: str = SchedulerConfig.overlap  # overlapped scheduling: each worker's next plan queued while it runs a step
    # a benchmark tool (`pulseinfer bench control-plane`): > 0 gives every worker a forward of this fixed
    # time in place of the model (gpu_worker/simulated.py)
    simulate_step_ms: float = WorkerServiceConfig.simulate_step_ms
    listen: str = "127.0.0.1:50052"  # the scheduler's gRPC for gateways: mutual TLS (--tls-*) unless loopback or --insecure
    node_name: str = ""  # in Stats and metrics labels; default: the host name
    metrics_listen: str = "127.0.0.1:9400"  # plain HTTP: GET /metrics, GET /health, POST /drain
    tls: TlsConfig = field(default_factory=TlsConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)

    def __post_init__(self) -> None:
        check_mode(self.worker.mode, self.batcher.offload)
        if not self.simulate_step_ms >= 0:
            raise ValueError(f"--simulate-step-ms must be >= 0 (0: the model's own forward), got {self.simulate_step_ms}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.listen:
            self.tls.check_plaintext(self.listen, "--listen")

    def reported_name(self) -> str:
        return self.node_name or socket.gethostname()


@dataclass(frozen=True)
class ServeConfig(NodeConfig):
    """The whole cluster on one machine: a node and its gateway, which reaches the scheduler on a unix socket."""

    listen: str = ""  # a gRPC address for gateways of other hosts too (as `pulseinfer node --listen`); none by default
    metrics_listen: str = ""  # the gateway serves /metrics and /health
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key_file: str | None = None  # the API key is this file's content; default: $PULSEINFER_API_KEY
    chat_parser: str = GatewayConfig.chat_parser  # how chat outputs divide into reasoning, content and tool calls

    def reported_name(self) -> str:
        return self.node_name  # one machine: worker labels stay plain ids unless a name is given


class Child:
    def __init__(self, name: str, service: str, argv: list[str], env: dict[str, str] | None = None):
        self.name = name
        self.argv = [sys.executable, "-m", f"pulseinfer.{service}", *argv]
        self.env = env or {}  # on top of the launcher's environment, less the API key: secrets go here, never in argv
        self.process: subprocess.Popen | None = None
        self.restarts: list[float] = []

    def environment(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | self.env | {PARENT_ENV: str(os.getpid())}

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.environment())  # no preexec_fn: see proc.die_with_parent

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", self.name, STOP_GRACE_S)
            self.process.kill()
            self.process.wait()


def wait_ready(children: list[Child], ready: Callable[[], object], deadline: float) -> None:
    """Polls `ready` until it stops raising probe.NotReady; fails early if a child exits, or at `deadline`."""
    last = "not started"
    while time.monotonic() < deadline:
        for child in children:
            if (code := child.exited()) is not None:
                raise RuntimeError(f"{child.name} exited with code {code} during startup (its error is above)")
        try:
            ready()
            return
        except probe.NotReady as e:
            last = str(e)
        time.sleep(0.2)
    names = ", ".join(c.name for c in children)
    raise RuntimeError(f"{names} not ready by the startup deadline: {last}")


def start_kv_store(address: str, host_kv_tokens: int, *flags: str, timeout_s: float = 120.0) -> Child:
    """A kv_store process of its own serving at `address`, once it answers (a benchmark's or a
    test's; the cluster starts its kv_store with the other services). Killed if it does not."""
    child = Child("kv_store", "kv_store", ["--bind", address, "--host-kv-tokens", str(host_kv_tokens), *flags])
    child.start()
    try:
        wait_ready([child], lambda: probe.kv_store(address), time.monotonic() + timeout_s)
    except RuntimeError:
        child.process.kill()
        child.process.wait()
        raise
    return child


class Cluster:
    """A node's services (`pulseinfer node`), and with a ServeConfig their gateway (`pulseinfer serve`)."""

    def __init__(self, config: NodeConfig, run_dir: Path, api_key: str | None = None):
        self.config = config
        kv = f"ipc://{run_dir}/kv_store"
        workers = f"ipc://{run_dir}/workers"
        self.scheduler_address = f"unix://{run_dir}/scheduler.sock"
        self.kv_address = kv
        kv_config = KVStoreConfig(
            model=config.model,
            load_format=config.load_format,
            bind=kv,
            block_size=config.worker.block_size,
            host_kv_tokens=config.host_kv_tokens,
            kv_dtype=str(config.worker.torch_dtype()).removeprefix("torch."),
        )
        sched_config = SchedulerConfig(
            grpc_bind=self.scheduler_address,
            workers_bind=workers,
            kv_store=kv,
            worker_timeout_s=config.worker_timeout_s,
            overlap=config.overlap,
            listen=config.listen,
            node_name=config.reported_name(),
            tls=config.tls,
            batcher=config.batcher,
        )
        self.kv_store = Child("kv_store", "kv_store", to_flags(kv_config))
        self.scheduler = Child("scheduler", "scheduler", to_flags(sched_config))
        self.workers = [
            Child(
                f"gpu_worker{i}",
                "gpu_worker",
                to_flags(
                    WorkerServiceConfig(
                        model=config.model,
                        load_format=config.load_format,
                        scheduler=workers,
                        kv_store=kv,
                        worker_id=i,
                        kv_store_timeout_s=config.kv_store_timeout_s,
                        simulate_step_ms=config.simulate_step_ms,
                        worker=config.worker.with_prefix_cache(config.batcher.prefix_cache),
                    )
                ),
            )
            for i in range(config.workers)
        ]
        self.gateway = self._gateway(config, api_key) if isinstance(config, ServeConfig) else None

    def _gateway(self, config: ServeConfig, api_key: str | None) -> Child:
        gateway_config = GatewayConfig(
            model=config.model,
            load_format=config.load_format,
            nodes=self.scheduler_address,
            host=config.host,
            http_port=config.http_port,
            grpc_port=config.grpc_port,
            chat_parser=config.chat_parser,
        )
        return Child("gateway", "gateway", to_flags(gateway_config), env={API_KEY_ENV: api_key} if api_key else None)

    @property
    def children(self) -> list[Child]:
        return [self.kv_store, self.scheduler, *self.workers] + ([self.gateway] if self.gateway else [])

    def start(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        steps: list[tuple[list[Child], Callable[[], object]]] = [
            ([self.kv_store], lambda: probe.kv_store(self.kv_address)),
            ([self.scheduler], lambda: probe.grpc_health(self.scheduler_address)),
            (self.workers, lambda: probe.workers(self.scheduler_address, len(self.workers))),
        ]
        if self.gateway:
            steps.append(([self.gateway], lambda: probe.http(f"http://{self.config.host}:{self.config.http_port}/health")))
        for children, ready in steps:
            for child in children:
                child.start()
            wait_ready(children, ready, deadline)

    def supervise(self) -> None:
        """Restarts children that die, until a signal ends the launcher."""
        while True:
            time.sleep(0.5)
            for child in self.children:
                if (code := child.exited()) is not None:
                    self._restart(child, code)

    def _restart(self, child: Child, code: int) -> None:
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(child.restarts) > RESTART_LIMIT:
            raise RuntimeError(
                f"{child.name} died {len(child.restarts)} times in {RESTART_WINDOW_S:.0f} s (last exit code {code}); giving up"
            )
        log.warning("%s exited with code %d; restarting it", child.name, code)
        child.start()

    def stop(self) -> None:
        for child in reversed(self.children):  # the gateway first: no new requests while the rest stops
            child.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            child.wait_or_kill(deadline)


def serve(config: ServeConfig) -> int:
    api_key = resolve_api_key(config.api_key_file)  # once: a bad --api-key-file fails before any child starts
    where = (
        f"HTTP http://{config.host}:{config.http_port}/v1 (OpenAI API), gRPC {config.host}:{config.grpc_port} (pulseinfer.v1.Generation)"
    )
    return _run(config, api_key, where)


def node(config: NodeConfig) -> int:
    """One host's kv_store, scheduler and workers for gateways elsewhere (`pulseinfer gateway --nodes`)."""
    return _run(config, None, f"node gRPC {config.listen} (pulseinfer.v1.Scheduler)")


def _run(config: NodeConfig, api_key: str | None, where: str) -> int:
    config.worker.torch_device()  # fail here, not in N workers, when --device cuda has no GPU
    setup_logging("launcher")
    run_dir, held = _new_run_dir()
    cluster = Cluster(config, run_dir, api_key)
    status = NodeStatus(config.metrics_listen, cluster.scheduler_address) if config.metrics_listen else None
    previous = {s: signal.signal(s, _raise_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        if status:
            status.start()
        print(f"PulseInfer is serving: {where}, {config.workers} worker(s) on {config.worker.device}", flush=True)
        cluster.supervise()
    except SystemExit:
        log.info("shutting down")
    finally:
        if status:
            status.stop()
        cluster.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        os.close(held)
        sweep()  # what a child killed on the way out (after the grace period) left
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def _new_run_dir() -> tuple[Path, int]:
    """A private run directory for the internal sockets, held (kv_store/segments.py `hold`) while the
    launcher lives. Run directories and segments of launchers that died (kill -9) are removed first."""
    for stale in Path(tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
        remove_unheld(stale, lambda path: shutil.rmtree(path, ignore_errors=True))
    sweep()
    while True:
        run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        fd = os.open(run_dir, os.O_RDONLY)
        if hold(fd):
            return run_dir, fd
        os.close(fd)


def _raise_exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)
