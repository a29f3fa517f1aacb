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
    assert kinds == {"Namespace", "PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy"}
    assert all(o["apiVersion"].split("/")[0] in ("v1", "apps", "networking.k8s.io") for o in objs)  # built-in
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


# ------------------------------------------------------------------ namespace, image, network, alerts
def test_namespace_enforces_restricted_pss():
    ns = next(o for o in kustomize(K8S) if o["kind"] == "Namespace")
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce-version"] == "latest"


def test_image_is_a_registry_reference_with_a_tag():
    (c,) = _pod()["containers"]
    m = re.fullmatch(
        r"(?P<registry>[a-z0-9.-]+\.[a-z]+)/(?P<repo>[a-z0-9/_.-]+):(?P<tag>[A-Za-z0-9_.-]+)", c["image"]
    )
    assert m, c["image"]
    assert m["tag"] not in ("latest", "cuda")
    # the tag placeholder and how to set it are documented next to it and in docker/README.md
    text = (K8S / "deployment.yaml").read_text()
    assert "kustomize edit set image" in text
    assert c["image"].rsplit(":", 1)[0] in (ROOT / "docker" / "README.md").read_text()


def test_no_annotation_scraping_and_metrics_token_documented():
    dep = next(o for o in kustomize(K8S) if o["kind"] == "Deployment")
    for meta in (dep["metadata"], dep["spec"]["template"]["metadata"]):
        assert not any(k.startswith("prometheus.io/") for k in (meta.get("annotations") or {}))
    scrape = yaml.safe_load((K8S / "prometheus-scrape-config.yaml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["authorization"]["type"] == "Bearer"  # every scrape of /metrics carries the token
    assert not any("annotation" in s for r in job["relabel_configs"] for s in r.get("source_labels", []))
    # the ServiceMonitor reads a key the example Secret has, and says that the key is required for it
    objs = kustomize(K8S, (COMPONENT,))
    sm = next(o for o in objs if o["kind"] == "ServiceMonitor")
    key = sm["spec"]["endpoints"][0]["authorization"]["credentials"]["key"]
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert secret["stringData"][key]
    assert "requires it" in (COMPONENT / "servicemonitor.yaml").read_text()
    env = {e["name"]: e for e in _pod()["containers"][0]["env"]}
    assert env["MAPPER_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == key


def test_networkpolicy_admits_only_the_api_port():
    objs = kustomize(K8S)
    (np_,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert (
        np_["spec"]["podSelector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )
    assert set(np_["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    port = dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    for rule in np_["spec"]["ingress"]:
        assert [p["port"] for p in rule["ports"]] == [port]


def test_ingress_example_has_tls_for_its_host():
    ing = yaml.safe_load((K8S / "ingress.example.yaml").read_text())
    assert ing["kind"] == "Ingress" and ing["apiVersion"] == "networking.k8s.io/v1"
    hosts = {r["host"] for r in ing["spec"]["rules"]}
    assert (
        hosts <= {h for t in ing["spec"]["tls"] for h in t["hosts"]} and ing["spec"]["tls"][0]["secretName"]
    )
    svc = next(o for o in kustomize(K8S) if o["kind"] == "Service")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}


# series named in the rules that a fresh service does not export yet (none)
PENDING_SERIES: set[str] = set()


def exported_series(text: str) -> dict[str, set[str]]:
    """Series names (and their label names) a /metrics page exports, counters' ``_total`` and histograms'
    ``_bucket``/``_sum``/``_count`` included, from the HELP/TYPE lines and the samples."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        names = {fam.name}
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        if fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        for n in names:
            out.setdefault(n, set())
        for smp in fam.samples:
            out.setdefault(smp.name, set()).update(smp.labels)
    return out


def test_prometheus_rule_series_exist_in_metrics(tmp_path):
    from test_service_helpers import client, frame_bytes

    from mapper import wire

    objs = kustomize(K8S, (COMPONENT,))
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"]
    with client(tmp_path) as c:
        mid = c.post("/v1/maps", json={"name": "k8s", "voxel_size_m": 0.25, "layers": ["tsdf"]}).json()["id"]
        r = c.post(f"/v1/maps/{mid}/frames", content=frame_bytes(0), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 200
        text = c.get("/metrics").text
    series = exported_series(text)
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "MapperWalRecordsQuarantined",
        "MapperMapFailed",
        "MapperStorageDamage",
        "MapperRefusingFrames",
        "MapperAckLatencyHigh",
    } <= set(alerts)
    used = set()
    for name, expr in alerts.items():
        for ident in re.findall(r"\b(mapper_[a-z0-9_]+)", expr):
            used.add(ident)
            if ident in PENDING_SERIES and ident not in series:
                continue
            assert ident in series, f"{name}: {ident} is not exported at /metrics"
        # the labels it groups by are labels of the series (where samples exist to say so)
        for labels in re.findall(r"by \(([^)]*)\)", expr):
            for lab in (x.strip() for x in labels.split(",")):
                owners = [series[i] for i in re.findall(r"\b(mapper_[a-z0-9_]+)", expr) if series.get(i)]
                assert all(lab in o for o in owners), (name, lab)
    assert "mapper_wal_quarantined_records_total" in used and "mapper_ack_seconds_bucket" in used
    assert {"mapper_map_failed", "mapper_storage_damage_total"} <= used


def test_rule_checker_catches_a_misspelt_series():
    series = exported_series("# HELP mapper_ack_seconds x\n# TYPE mapper_ack_seconds histogram\n")
    assert "mapper_ack_seconds_bucket" in series and "mapper_ack_second_bucket" not in series
    series = exported_series("# HELP mapper_x x\n# TYPE mapper_x counter\n")
    assert "mapper_x_total" in series and "mapper_x_bucket" not in series


def test_cpu_image_has_the_foxglove_extra():
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert re.search(r"pip install[^\n]*\.\[[^\]]*foxglove", text), text


def test_ray_base_has_the_same_namespace_label_image_and_no_annotations():
    objs = kustomize(K8S / "ray")
    ns = next(o for o in objs if o["kind"] == "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    rc = next(o for o in objs if o["kind"] == "RayCluster")
    groups = [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
    for g in groups:
        meta = g["template"].get("metadata") or {}
        assert not any(k.startswith("prometheus.io/") for k in (meta.get("annotations") or {}))
        for c in g["template"]["spec"]["containers"]:
            assert re.fullmatch(r"[a-z0-9.-]+\.[a-z]+/[a-z0-9/_.-]+:[A-Za-z0-9_.-]+", c["image"]), c["image"]
