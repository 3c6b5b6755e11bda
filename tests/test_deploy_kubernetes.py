"""deploy/kubernetes/ is what a platform team applies (K01-K02): every manifest is valid against the Kubernetes
schemas (kubernetes-validate ships them, so this runs offline), and the pieces agree with each other.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((path.name, document))
    return found


def _by_kind() -> dict[str, dict[str, Any]]:
    return {document["kind"]: document for _, document in _documents()}


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    """K01: each document validates strictly (no unknown fields) against the bundled schemas; a broken copy fails."""
    documents = _documents()
    assert {document["kind"] for _, document in documents} >= {
        "Namespace",
        "ConfigMap",
        "Secret",
        "DaemonSet",
        "Deployment",
    }
    for _name, document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    broken = _by_kind()["Deployment"]
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # a typo of volumeMounts
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def _pod(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = _by_kind()[kind]["spec"]["template"]["spec"]
    return spec


def _host_path(pod: dict[str, Any], mount_path: str, container: dict[str, Any]) -> str:
    [mount] = [item for item in container["volumeMounts"] if item["mountPath"] == mount_path]
    [volume] = [item for item in pod["volumes"] if item["name"] == mount["name"]]
    path: str = volume["hostPath"]["path"]
    return path


def test_workers_and_prewarm_share_one_private_node_local_domain() -> None:
    """K02, S19: the prewarm pods and the workers mount the same host directory under /dev/shm as HWR_ROOT's
    parent; the domain-root init container makes it 0700 and owned by the uid both run as."""
    config = _by_kind()["ConfigMap"]["data"]
    root = config["HWR_ROOT"]
    daemon, workers = _pod("DaemonSet"), _pod("Deployment")
    [worker] = workers["containers"]
    [prewarm] = [item for item in daemon["initContainers"] if item["name"] == "prewarm"]
    mount = next(item["mountPath"] for item in worker["volumeMounts"] if root.startswith(item["mountPath"] + "/"))
    shared = _host_path(workers, mount, worker)
    assert shared.startswith("/dev/shm/") and _host_path(daemon, mount, prewarm) == shared
    uid = workers["securityContext"]["runAsUser"]
    assert daemon["securityContext"]["runAsUser"] == uid and workers["securityContext"]["runAsNonRoot"] is True
    [init] = [item for item in daemon["initContainers"] if item["name"] == "domain-root"]
    script = " ".join(init["command"])
    host_mount = init["volumeMounts"][0]["mountPath"]
    folder = host_mount + shared.removeprefix("/dev/shm")
    assert _host_path(daemon, host_mount, init) == "/dev/shm"
    assert f"chmod 0700 {folder}" in script and re.search(rf"chown {uid}:\d+ {re.escape(folder)}", script)
    assert daemon["initContainers"].index(init) < daemon["initContainers"].index(prewarm)


def test_configuration_secrets_and_metrics_are_wired() -> None:
    """K02: every container reads HWR_* from the ConfigMap and credentials from the Secret; the worker's metrics
    port is HWR_METRICS_PORT, declared as a container port and in the Prometheus scrape annotations; the
    prewarm command pulls by name first and falls back to a local prewarm."""
    kinds = _by_kind()
    config_name = kinds["ConfigMap"]["metadata"]["name"]
    secret_name = kinds["Secret"]["metadata"]["name"]
    assert kinds["ConfigMap"]["data"]["HWR_REMOTE"].startswith(("s3://", "gs://", "file:///"))
    containers = _pod("Deployment")["containers"] + _pod("DaemonSet")["containers"]
    containers += [item for item in _pod("DaemonSet")["initContainers"] if item["name"] != "domain-root"]
    for container in containers:
        sources = container["envFrom"]
        assert {"configMapRef": {"name": config_name}} in sources and {"secretRef": {"name": secret_name}} in sources
        assert "AWS_SECRET_ACCESS_KEY" not in str(container.get("env", []))
    port = kinds["ConfigMap"]["data"]["HWR_METRICS_PORT"]
    template = kinds["Deployment"]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == port
    [worker] = template["spec"]["containers"]
    assert [item["containerPort"] for item in worker["ports"]] == [int(port)]
    [prewarm] = [item for item in _pod("DaemonSet")["initContainers"] if item["name"] == "prewarm"]
    words = shlex.split(" ".join(prewarm["command"][2:]))
    assert (
        words[:2] == ["hwr", "pull"]
        and "||" in words
        and words[words.index("||") + 1 : words.index("||") + 3]
        == [
            "hwr",
            "prewarm",
        ]
    )
    for namespaced in ("ConfigMap", "Secret", "DaemonSet", "Deployment"):
        assert kinds[namespaced]["metadata"]["namespace"] == kinds["Namespace"]["metadata"]["name"]
