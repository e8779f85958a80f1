"""docker-compose.yml: valid against the compose-spec schema (no engine runs here), every
service command parses with that service's own flags, the internal services are reachable
only through unix sockets in a shared volume, the CUDA IPC peers share IPC and PID namespaces,
and the API key is a secret of the gateway's. The Dockerfile: the image can compile Triton's launcher."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pulseinfer.common.flags import parse_config
from pulseinfer.gateway.server import GatewayConfig
from pulseinfer.gpu_worker.server import WorkerServiceConfig
from pulseinfer.kv_store.client import io_address
from pulseinfer.kv_store.server import KVStoreConfig
from pulseinfer.scheduler.core import SchedulerConfig

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICE_CONFIGS = {"kv_store": KVStoreConfig, "scheduler": SchedulerConfig, "gpu_worker": WorkerServiceConfig, "gateway": GatewayConfig}
INTERNAL = ("kv_store", "scheduler", "gpu_worker")
RUN_DIR = "/run/pulseinfer"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_spec_schema():
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_four_services_share_one_image_and_host_ipc(compose):
    services = compose["services"]
    assert set(services) == set(SERVICE_CONFIGS)
    for name, service in services.items():
        assert service["image"] == "pulseinfer:latest" and service["ipc"] == "host", name
        assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}, name
        assert service["healthcheck"]["start_period"], name
        assert service["command"][:3] == ["python", "-m", f"pulseinfer.{name}"]
    assert services["gateway"]["ports"] == ["8000:8000", "50051:50051"]
    for name in ("gpu_worker", "kv_store"):  # the kv_store's I/O engine opens the worker's cache with CUDA IPC: the same GPU
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"], name


def test_the_cuda_ipc_peers_share_one_pid_namespace_and_no_other_service_joins_it(compose):
    """Legacy CUDA IPC across containers fails in different PID namespaces ("invalid device context")."""
    services = compose["services"]
    assert services["kv_store"]["pid"] == services["gpu_worker"]["pid"] == "host"
    assert "pid" not in services["scheduler"] and "pid" not in services["gateway"]


def _run_commands(dockerfile: str) -> list[list[str]]:
    """Each RUN instruction (continuations joined) as its &&-separated shell commands, split into words."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    runs = [line.removeprefix("RUN ") for line in joined.splitlines() if line.startswith("RUN ")]
    return [shlex.split(command) for run in runs for command in run.split("&&")]


def test_the_image_has_a_c_compiler_for_tritons_launcher_and_no_apt_lists():
    """Triton builds its CUDA launcher with gcc on the first launch of a kernel: without a compiler
    in the image every kernel fails. The headers: libc6-dev (gcc only recommends it) and the image's
    own Python.h (python:*-slim keeps /usr/local/include; Debian's python3-dev is another Python's)."""
    dockerfile = DOCKERFILE.read_text()
    assert "\nFROM python:3.11-slim\n" in dockerfile
    commands = _run_commands(dockerfile)
    installs = [c for c in commands if c[:3] == ["apt-get", "install", "-y"]]
    assert len(installs) == 1, installs
    (install,) = installs
    assert "--no-install-recommends" in install and {"gcc", "libc6-dev"} <= set(install)
    assert not [word for word in install if word.startswith("python3")]
    first = commands.index(install)
    assert commands[first - 1] == ["apt-get", "update"]  # in the same layer: never a stale package list
    assert commands[first + 1] == ["rm", "-rf", "/var/lib/apt/lists/*"]


def test_each_command_parses_with_its_service_flags(compose):
    for name, service in compose["services"].items():
        config = parse_config(SERVICE_CONFIGS[name], name, "", service["command"][3:])  # an unknown flag exits non-zero
        assert isinstance(config, SERVICE_CONFIGS[name])


def _configs(compose: dict) -> dict:
    return {name: parse_config(SERVICE_CONFIGS[name], name, "", service["command"][3:]) for name, service in compose["services"].items()}


def test_internal_services_have_no_network_and_talk_over_unix_sockets_in_a_shared_volume(compose):
    services = compose["services"]
    assert "run" in compose["volumes"]
    for name, service in services.items():
        assert f"run:{RUN_DIR}" in service["volumes"], name
    for name in INTERNAL:
        service = services[name]
        assert service["network_mode"] == "none", name
        assert not {"ports", "expose", "networks"} & set(service), name
        words = [*service["command"], *service["healthcheck"]["test"]]
        assert not [w for w in words if "0.0.0.0" in w or "tcp://" in w or "127.0.0.1" in w or ":50" in w], name
    assert [name for name, service in services.items() if "ports" in service or "expose" in service] == ["gateway"]
    configs = _configs(compose)
    kv, scheduler, worker, gateway = (configs[name] for name in ("kv_store", "scheduler", "gpu_worker", "gateway"))
    assert kv.bind == scheduler.kv_store == worker.kv_store == f"ipc://{RUN_DIR}/kv_store"
    assert io_address(kv.bind) == f"ipc://{RUN_DIR}/kv_store.io"  # the kv_store's I/O engine, in the same volume
    assert scheduler.workers_bind == worker.scheduler == f"ipc://{RUN_DIR}/workers"
    assert scheduler.grpc_bind == gateway.nodes == f"unix://{RUN_DIR}/scheduler.sock"


def test_healthchecks_probe_the_addresses_the_services_listen_on(compose):
    configs = _configs(compose)
    probes = {name: service["healthcheck"]["test"] for name, service in compose["services"].items()}
    for test in probes.values():
        assert test[:4] == ["CMD", "python", "-m", "pulseinfer.probe"]
    assert probes["kv_store"][4:] == ["kv_store", configs["kv_store"].bind]
    assert probes["scheduler"][4:] == ["grpc", configs["scheduler"].grpc_bind]
    assert probes["gpu_worker"][4:] == ["workers", configs["scheduler"].grpc_bind, "--worker-id", str(configs["gpu_worker"].worker_id)]
    assert probes["gateway"][4:] == ["http", f"http://127.0.0.1:{configs['gateway'].http_port}/health"]


def test_the_api_key_is_a_secret_file_of_the_gateway_alone(compose):
    services = compose["services"]
    (secret,) = services["gateway"]["secrets"]
    assert compose["secrets"][secret]["file"]
    assert _configs(compose)["gateway"].api_key_file == f"/run/secrets/{secret}"
    assert [name for name, service in services.items() if "secrets" in service] == ["gateway"]
    for name, service in services.items():
        assert "PULSEINFER_API_KEY" not in service.get("environment", {}), name
        assert not [w for w in service["command"] if w.startswith("--api-key") and w != "--api-key-file"], name
