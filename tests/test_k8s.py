"""The Kubernetes manifests and container images: the base renders without the Prometheus Operator (the
ServiceMonitor is an optional kustomize component carrying the ``release`` label), the pod passes the
"restricted" Pod Security Standard, and the CUDA image installs under constraints.txt.

Rendering uses a small Python equivalent of ``kubectl kustomize`` for what these manifests use
(``resources`` files and directories, ``components``, ``namespace``); where ``kubectl`` exists it is
compared with the real thing."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
COMPONENT = K8S / "components" / "prometheus-operator"


def kustomize(path: Path, extra_components: tuple[Path, ...] = ()) -> list[dict]:
    """The objects ``kubectl kustomize path`` builds, for the subset of kustomize these files use."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "components", "namespace"}
    assert set(k) <= allowed, f"{path}: kustomize features the test renderer lacks: {set(k) - allowed}"
    objs: list[dict] = []
    for r in k.get("resources") or []:
        p = path / r
        objs += kustomize(p) if p.is_dir() else [o for o in yaml.safe_load_all(p.read_text()) if o]
    for c in [*(path / c for c in k.get("components") or []), *extra_components]:
        ck = yaml.safe_load((c / "kustomization.yaml").read_text())
        assert ck["kind"] == "Component", c
        objs += kustomize(c)
    if k.get("namespace"):
        for o in objs:
            if o["kind"] != "Namespace":
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    return objs


def _by_kind(objs):
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def test_base_renders_without_prometheus_operator_crds():
    objs = kustomize(K8S)
    kinds = {o["kind"] for o in objs}
    assert kinds == {"Namespace", "PersistentVolumeClaim", "Deployment", "Service"}
    assert all(o["apiVersion"].split("/")[0] in ("v1", "apps") for o in objs)  # built-in APIs only
    assert all(o["metadata"].get("namespace") == "mapper" for o in objs if o["kind"] != "Namespace")


def test_servicemonitor_component_with_release_label():
    objs = kustomize(K8S, (COMPONENT,))
    sm = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(sm) == 1 and sm[0]["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm[0]["metadata"]["labels"]["release"]  # kube-prometheus-stack selects on it
    assert sm[0]["metadata"]["namespace"] == "mapper"
    svc = next(o for o in objs if o["kind"] == "Service")
    assert sm[0]["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in sm[0]["spec"]["endpoints"]} <= ports


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_python_renderer_matches_kubectl_kustomize(tmp_path):
    def real(path):
        out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [o for o in yaml.safe_load_all(out.stdout) if o]

    def canon(objs):
        return sorted(yaml.safe_dump(o, sort_keys=True) for o in objs)

    assert canon(real(K8S)) == canon(kustomize(K8S))
    # the component through an overlay outside k8s/, as the README shows
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "kustomization.yaml").write_text(
        "resources: [../k8s]\ncomponents: [../k8s/components/prometheus-operator]\n"
    )
    assert canon(real(tmp_path / "mine")) == canon(kustomize(K8S, (COMPONENT,)))


# ------------------------------------------------------------------------ Pod Security Standards
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
    "secret",
}  # fmt: skip


def restricted_violations(pod: dict) -> list[str]:
    """Violations of the "restricted" Pod Security Standard (baseline + restricted controls, Kubernetes
    docs "Pod Security Standards") in a pod spec."""
    v = []
    psc = pod.get("securityContext") or {}
    containers = pod.get("containers", []) + pod.get("initContainers", [])
    for f in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(f):
            v.append(f"{f} is true")
    for vol in pod.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            v.append(f"volume {vol['name']} of type {kinds - RESTRICTED_VOLUMES}")
    if (psc.get("seccompProfile") or {}).get("type") == "Unconfined":
        v.append("pod seccompProfile Unconfined")
    if psc.get("runAsUser") == 0:
        v.append("pod runAsUser 0")
    for c in containers:
        n, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            v.append(f"{n}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            v.append(f"{n}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            v.append(f"{n}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            v.append(f"{n}: adds capabilities {caps['add']}")
        if not (
            sc.get("runAsNonRoot") is True or (psc.get("runAsNonRoot") is True and "runAsNonRoot" not in sc)
        ):
            v.append(f"{n}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            v.append(f"{n}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            v.append(f"{n}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            v.append(f"{n}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            v.append(f"{n}: procMount")
    return v


def _pod():
    dep = next(o for o in kustomize(K8S) if o["kind"] == "Deployment")
    return dep["spec"]["template"]["spec"]


def test_pod_passes_restricted_pss_with_read_only_root():
    pod = _pod()
    assert restricted_violations(pod) == []
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "/data" in writable and "/tmp" in writable
    assert "emptyDir" in vols[writable["/tmp"]]  # tempfiles (Triton builds) need a writable /tmp
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MAPPER_DATA_DIR"] == "/data"


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile None"),
        (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilege"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(drop=[]), "drop ALL"),
        (lambda p: p["containers"][0]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
    ],
)
def test_pss_checker_catches_each_breakage(breakage, message):
    pod = copy.deepcopy(_pod())
    breakage(pod)
    assert any(message in v for v in restricted_violations(pod)), restricted_violations(pod)


# ------------------------------------------------------------------------------------ images
@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_install_under_constraints(dockerfile):
    text = (ROOT / "docker" / dockerfile).read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    installs = re.findall(r"pip install[^&\n]*", joined)
    assert installs and all("-c constraints.txt" in i for i in installs), installs
    assert joined.index("COPY constraints.txt") < joined.index("pip install")
