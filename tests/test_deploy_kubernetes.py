"""deploy/kubernetes/ is what a platform team applies (K01-K02): every manifest is valid against the Kubernetes
schemas (kubernetes-validate ships them, so this runs offline), the pieces agree with each other and with the
serving example, and the prewarm script itself runs (on a tiny real pipeline) and fails visibly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hwr_tools.synthetic_hub import save_hub_snapshot
from hwr_tools.synthetic_pipelines import save_tiny_pipeline

from ._serve_support import SERVE_EXAMPLE

REPOSITORY = Path(__file__).resolve().parents[1]
DEPLOY = REPOSITORY / "deploy" / "kubernetes"
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
        "Service",
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


def _container(kind: str, name: str | None = None) -> dict[str, Any]:
    pod = _pod(kind)
    found = [item for item in pod["containers"] if name is None or item["name"] == name]
    assert len(found) == 1
    return found[0]


def _host_path(pod: dict[str, Any], mount_path: str, container: dict[str, Any]) -> str:
    [mount] = [item for item in container["volumeMounts"] if item["mountPath"] == mount_path]
    [volume] = [item for item in pod["volumes"] if item["name"] == mount["name"]]
    path: str = volume["hostPath"]["path"]
    return path


def _environment(kind: str, container: dict[str, Any]) -> dict[str, str]:
    """What the container sees: the ConfigMap (envFrom), then its own env entries (which win)."""
    config = _by_kind()["ConfigMap"]["data"]
    seen: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            seen.update(config)
    for entry in container.get("env", []):
        if "value" in entry:
            seen[entry["name"]] = entry["value"]
        else:
            seen[entry["name"]] = config[entry["valueFrom"]["configMapKeyRef"]["key"]]
    return seen


def _memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * units[unit]


def test_workers_and_prewarm_share_one_private_node_local_domain() -> None:
    """K02, S19: the prewarm pods and the workers mount the same host directory under /dev/shm as HWR_ROOT's
    parent; the domain-root init container makes it 0700 and owned by the uid both run as, before prewarm runs."""
    config = _by_kind()["ConfigMap"]["data"]
    root = config["HWR_ROOT"]
    daemon, workers = _pod("DaemonSet"), _pod("Deployment")
    worker, prewarm = _container("Deployment"), _container("DaemonSet", "prewarm")
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


def test_only_the_prewarm_pod_writes_the_domain_and_its_limit_holds_the_artifact() -> None:
    """K02: tmpfs pages are charged to the memory cgroup of the writer, so only the prewarm container writes the
    domain (workers have no remote, no local build, no post-load publication, no credentials) and its memory limit
    exceeds a worker's: it holds the artifact; a worker only maps it. Its HWR_* come from the ConfigMap, its
    credentials from the Secret."""
    kinds = _by_kind()
    config_name = kinds["ConfigMap"]["metadata"]["name"]
    secret_name = kinds["Secret"]["metadata"]["name"]
    worker, prewarm = _container("Deployment"), _container("DaemonSet", "prewarm")
    seen = _environment("Deployment", worker)
    assert seen["HWR_REMOTE"] == "" and seen["HWR_REMOTE_PUBLISH"] == "0"
    assert seen["HWR_ALLOW_LOCAL_BUILD"] == "false" and seen["HWR_ALLOW_POST_LOAD_PUBLISH"] == "false"
    assert {"configMapRef": {"name": config_name}} in worker["envFrom"]
    assert all("secretRef" not in source for source in worker["envFrom"])
    assert {"configMapRef": {"name": config_name}} in prewarm["envFrom"]
    assert {"secretRef": {"name": secret_name}} in prewarm["envFrom"]
    assert kinds["ConfigMap"]["data"]["HWR_REMOTE"].startswith(("s3://", "gs://", "file:///"))
    for container in (worker, prewarm):
        assert "AWS_SECRET_ACCESS_KEY" not in str(container.get("env", []))
    prewarm_limit = _memory_bytes(prewarm["resources"]["limits"]["memory"])
    assert prewarm_limit == _memory_bytes(prewarm["resources"]["requests"]["memory"])  # never overcommitted
    assert prewarm_limit >= 36 * 2**30  # FLUX.1-dev's BF16 artifacts (about 34 GiB) and a working set
    for namespaced in ("ConfigMap", "Secret", "DaemonSet", "Deployment", "Service"):
        assert kinds[namespaced]["metadata"]["namespace"] == kinds["Namespace"]["metadata"]["name"]


def test_workers_serve_on_a_service_with_probes_and_a_scrapable_metrics_port() -> None:
    """K02: the worker listens on 0.0.0.0 at the port it declares, which the Service targets; its readiness probe
    is the serving example's /ready (503 until a worker loaded) and its liveness probe /live; the metrics port is
    HWR_METRICS_PORT on 0.0.0.0, a declared container port and the prometheus.io/* scrape annotations."""
    kinds = _by_kind()
    template = kinds["Deployment"]["spec"]["template"]
    worker = _container("Deployment")
    seen = _environment("Deployment", worker)
    ports = {item["name"]: item["containerPort"] for item in worker["ports"]}
    assert seen["HWR_SERVE_HOST"] == "0.0.0.0" and int(seen["HWR_SERVE_PORT"]) == ports["http"]
    assert seen["HWR_SERVE_MODEL"] == seen["HWR_PREWARM_REPO"]
    assert seen["HWR_SERVE_REVISION"] == seen["HWR_PREWARM_REVISION"]
    app = (SERVE_EXAMPLE / "serve_app.py").read_text()
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/live"), ("startupProbe", "/live")):
        assert worker[probe]["httpGet"] == {"path": path, "port": "http"}
        assert f'@app.get("{path}")' in app
    service = kinds["Service"]["spec"]
    assert template["metadata"]["labels"] | service["selector"] == template["metadata"]["labels"]
    assert [item["targetPort"] for item in service["ports"]] == ["http"]
    assert seen["HWR_METRICS_ADDR"] == "0.0.0.0" and int(seen["HWR_METRICS_PORT"]) == ports["metrics"]
    annotations = template["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == seen["HWR_METRICS_PORT"]
    )


def _prewarm_script() -> str:
    command = _container("DaemonSet", "prewarm")["command"]
    assert command[:2] == ["sh", "-c"]
    script: str = command[2]
    return script


def test_the_prewarm_script_fails_visibly() -> None:
    """K02: no command masks a failure (no `|| echo`, `|| true`, `|| :`); the script runs under `set -eu`."""
    script = _prewarm_script()
    assert script.lstrip().startswith("set -eu")
    for _name, document in _documents():
        text = yaml.safe_dump(document)
        assert not re.search(r"\|\|\s*(echo|true|:)", text), _name


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A tiny real Flux pipeline as a snapshot in a Hugging Face cache: (cache, repo id, commit)."""
    base = tmp_path_factory.mktemp("k8s-prewarm")
    folder = save_tiny_pipeline(base / "flux", "flux", seed=9)
    repo, commit = "hwr-test/tiny-flux-k8s", "1" * 40
    save_hub_snapshot(base / "hub", repo, folder, revision=commit)
    return base / "hub", repo, commit


def _run_prewarm(tmp_path: Path, hub: tuple[Path, str, str], **overrides: str) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's own script, once (HWR_PREWARM_EVERY_S=0), with the ConfigMap's settings on this machine."""
    cache, repo, commit = hub
    config = _by_kind()["ConfigMap"]["data"]
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("HWR_", "HF_"))}
    environment.update(config)
    environment.update(
        HWR_ROOT=str(tmp_path / "domain"),
        HWR_REMOTE="",
        HF_HUB_CACHE=str(cache),
        HWR_PREWARM_REPO=repo,
        HWR_PREWARM_REVISION=commit,
        HWR_PREWARM_EVERY_S="0",
        TMPDIR=str(tmp_path),
        COLUMNS="250",  # one table row per component
        PATH=os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")]),
    )
    environment.update(overrides)
    return subprocess.run(
        ["sh", "-c", _prewarm_script()], env=environment, capture_output=True, text=True, timeout=600, check=False
    )


def test_the_prewarm_script_builds_every_served_component_and_another_node_pulls_them(
    tmp_path: Path, hub: tuple[Path, str, str]
) -> None:
    """K02: without a remote the DaemonSet's script runs `hwr prewarm` of the whole pipeline: it exits 0, marks the
    node warm for the readiness probe, and leaves one artifact per served component, the very components the
    ConfigMap's HWR_PREWARM_COMPONENTS lists (Flux: transformer, both text encoders, VAE). Pushed to a remote, they
    are what the script on a node without the checkpoint pulls by name: every listed component, nothing built."""
    built = tmp_path / "builder"
    built.mkdir()
    done = _run_prewarm(built, hub)
    assert done.returncode == 0, done.stderr
    assert (built / "hwr-warm").is_file()
    artifacts = sorted(path.name for path in (built / "domain" / "artifacts").iterdir())
    listed = _by_kind()["ConfigMap"]["data"]["HWR_PREWARM_COMPONENTS"].split()
    assert len(artifacts) == len(listed) == 4
    for component in listed:
        assert re.search(rf"^\W*{component}\W.*local_production", done.stdout, re.MULTILINE), component
    remote = (tmp_path / "remote").as_uri()
    (tmp_path / "remote").mkdir()
    pushed = subprocess.run(
        [
            sys.executable,
            "-m",
            "host_weight_runtime.cli",
            "push",
            "--all",
            "--to",
            remote,
            "--root",
            str(built / "domain"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert pushed.returncode == 0, pushed.stderr
    node = tmp_path / "node"
    node.mkdir()
    done = _run_prewarm(node, hub, HWR_REMOTE=remote, HF_HUB_CACHE=str(tmp_path / "no-checkpoint-here"))
    assert done.returncode == 0, done.stderr
    assert "a pull failed" not in done.stderr and (node / "hwr-warm").is_file()
    assert sorted(path.name for path in (node / "domain" / "artifacts").iterdir()) == artifacts


def test_a_failed_prewarm_exits_non_zero(tmp_path: Path, hub: tuple[Path, str, str]) -> None:
    """K02: a revision the node's cache lacks (the pull by name failing first when a remote is configured) makes the
    script exit non-zero, so the pod restarts visibly; it never reports the node warm (a marker an earlier
    container left is removed first)."""
    missing = "2" * 40
    (tmp_path / "hwr-warm").touch()  # left by an earlier container of the pod: /tmp outlives a restart
    done = _run_prewarm(tmp_path, hub, HWR_PREWARM_REVISION=missing)
    assert done.returncode != 0 and missing in done.stderr
    remote = tmp_path / "remote"
    remote.mkdir()
    done = _run_prewarm(tmp_path, hub, HWR_PREWARM_REVISION=missing, HWR_REMOTE=remote.as_uri(), HWR_REMOTE_PUBLISH="0")
    assert done.returncode != 0 and "a pull failed" in done.stderr
    assert not (tmp_path / "hwr-warm").exists()


_FENCE = re.compile(r"^([ \t]*)```ya?ml[ \t]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def manifest_blocks(markdown: str) -> list[dict[str, Any]]:
    """Every Kubernetes object (a document with apiVersion and kind) in the YAML code blocks of `markdown`."""
    found = []
    for match in _FENCE.finditer(markdown):
        for document in yaml.safe_load_all(textwrap.dedent(match.group(2))):
            if isinstance(document, dict) and "apiVersion" in document and "kind" in document:
                found.append(document)
    return found


def test_every_manifest_the_docs_show_validates() -> None:
    """K01: every Kubernetes manifest shown in a YAML block of README.md or docs/**/*.md validates strictly, as the
    files in deploy/kubernetes/ do; a block with a misspelled field (even indented in a list item) is caught."""
    pages = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").rglob("*.md"))]
    shown = [(page, block) for page in pages for block in manifest_blocks(page.read_text(encoding="utf-8"))]
    assert any(page.name == "kubernetes.md" for page, _ in shown)  # the guide shows at least one
    for page, block in shown:
        try:
            kubernetes_validate.validate(block, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{page.relative_to(REPOSITORY)}: {block['kind']} {block.get('metadata', {})}: {exc}")
    typo = "1. Apply:\n\n   ```yaml\n   apiVersion: v1\n   kind: ConfigMap\n   metadata:\n     name: x\n   datas: {}\n   ```\n"
    [broken] = manifest_blocks(typo)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
