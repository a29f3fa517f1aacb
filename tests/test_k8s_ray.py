"""``k8s/ray``: the KubeRay RayCluster of ``mapper serve --ray`` renders (with the same small kustomize
equivalent as tests/test_k8s.py), runs the ingress on the head and GPU map workers on the worker pods, mounts
the one shared ReadWriteMany volume at the same path everywhere, probes the ingress, passes the "restricted"
Pod Security Standard, and the optional Prometheus Operator component scrapes Ray's and mapper's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml (test extra) renders the manifests")

from test_k8s import kustomize, restricted_violations  # noqa: E402

RAY = Path(__file__).resolve().parents[1] / "k8s" / "ray"
COMPONENT = RAY / "components" / "prometheus-operator"


def objects(*components):
    return {(o["kind"], o["metadata"]["name"]): o for o in kustomize(RAY, components)}


def test_renders_a_raycluster_with_the_shared_volume_and_a_service():
    objs = objects()
    assert set(objs) == {
        ("Namespace", "mapper"),
        ("PersistentVolumeClaim", "mapper-shared"),
        ("RayCluster", "mapper"),
        ("Service", "mapper"),
    }
    assert all(o["metadata"].get("namespace") == "mapper" for (k, _), o in objs.items() if k != "Namespace")
    pvc = objs[("PersistentVolumeClaim", "mapper-shared")]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every Ray pod mounts it
    rc = objs[("RayCluster", "mapper")]
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    svc = objs[("Service", "mapper")]
    assert svc["spec"]["selector"] == {"ray.io/cluster": "mapper", "ray.io/node-type": "head"}


def _pods(rc):
    head = rc["spec"]["headGroupSpec"]
    workers = rc["spec"]["workerGroupSpecs"]
    return head, workers


def test_head_runs_ray_then_the_ingress_with_probes():
    head, _ = _pods(objects()[("RayCluster", "mapper")])
    assert head["rayStartParams"]["num-cpus"] == "0"  # no map workers on the head
    c = head["template"]["spec"]["containers"][0]
    script = c["args"][0]
    assert script.index("$KUBERAY_GEN_RAY_START_CMD") < script.index("mapper serve --ray auto")
    assert "--data-dir /data" in script and "--host 0.0.0.0" in script
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 8000 and ports["metrics"] == 8080
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e for e in c["env"]}
    assert env["MAPPER_API_TOKENS"]["valueFrom"]["secretKeyRef"]["name"] == "mapper-tokens"  # auth on


def test_workers_take_gpus_and_every_pod_mounts_the_shared_root_at_one_path():
    head, workers = _pods(objects()[("RayCluster", "mapper")])
    assert workers and all(
        int(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        for w in workers
    )
    for spec in [head["template"]["spec"], *(w["template"]["spec"] for w in workers)]:
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        c = spec["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        [(vol, claim)] = claims.items()
        assert claim == "mapper-shared" and mounts[vol] == "/data"
        assert restricted_violations(spec) == []
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert "/tmp" in mounts.values() and "/dev/shm" in mounts.values()  # Ray's session and object store


def test_prometheus_component_scrapes_ray_and_mapper():
    objs = objects(COMPONENT)
    pm = objs[("PodMonitor", "mapper-ray")]
    assert pm["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": "mapper"}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    sm = objs[("ServiceMonitor", "mapper-ingress")]
    svc = objs[("Service", "mapper")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ep = sm["spec"]["endpoints"][0]
    assert ep["path"] == "/metrics" and ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["authorization"]["credentials"]["key"] == "metrics-token"
    assert all(o["metadata"]["labels"]["release"] for o in (pm, sm))
