"""docker-compose.yml: valid against the compose-spec schema (no engine runs here), and every
service command parses with that service's own flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.server import GatewayConfig
from gpu_worker.server import WorkerServiceConfig
from kv_store.server import KVStoreConfig
from pulseinfer.flags import parse_config
from scheduler.core import SchedulerConfig

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
SERVICE_CONFIGS = {"kv_store": KVStoreConfig, "scheduler": SchedulerConfig, "gpu_worker": WorkerServiceConfig, "gateway": GatewayConfig}


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
        assert service["command"][:3] == ["python", "-m", name]
    assert services["gateway"]["ports"] == ["8000:8000", "50051:50051"]
    for name in ("gpu_worker", "kv_store"):  # the kv_store's I/O engine opens the worker's cache with CUDA IPC: the same GPU
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"], name


def test_each_command_parses_with_its_service_flags(compose):
    for name, service in compose["services"].items():
        config = parse_config(SERVICE_CONFIGS[name], name, "", service["command"][3:])  # an unknown flag exits non-zero
        assert isinstance(config, SERVICE_CONFIGS[name])
