"""The Kubernetes manifests in k8s/: rendered per overlay, validated, and checked to fit together.

No cluster is needed. Each overlay is rendered by the real kustomize, `kubectl kustomize` (offline;
`make install` installs kubectl when run as root; without root and without it these tests skip, saying
so). Then:
- RayJob / RayCluster are validated against the vendored KubeRay CRD schemas (k8s/schemas), strictly;
  built-in kinds, and the pod templates inside the Ray resources, with kubernetes-validate (offline);
- the ConfigMap's elastictrain config loads with elastictrain's own loader; the RayJob entrypoint is a
  real CLI command with real options; volumes, claims, ConfigMaps, Secrets, Services and ports that
  are referenced exist; the worker group's replica range equals the config's scaling range;
- security defaults hold: non-root, nothing privileged, requests and limits, Ray token auth, nothing
  exposed outside the cluster, secrets only from Secret objects.
Every check returns a list of problems, and the fault-injection tests show each one can fail.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["cpu-demo", "gpu", "cpu-demo-cluster", "gpu-cluster", "gpu-s3"]
JOB_OVERLAYS = ["cpu-demo", "gpu"]  # each with a standalone-cluster twin, OVERLAY-cluster
S3_OVERLAYS = ["gpu-s3"]  # run folders on an object store: no run volume
# What the driver and every worker need to reach a run folder on S3, each from a Secret.
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # oldest and newest Kubernetes the manifests are checked against

Obj = dict[str, Any]


# ---------------------------------------------------------------- rendering ------------------

# kustomize v5 features the overlays use (patches with targets, replacements). Debian bookworm's own
# kubernetes-client (kubectl 1.20) carries kustomize v2 and cannot render them.
MIN_KUSTOMIZE = (5, 0)


def _load_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@functools.cache
def _kubectl_problem() -> str | None:
    """Why `kubectl kustomize` cannot render k8s/ here, or None when it can."""
    if shutil.which("kubectl") is None:
        return "kubectl is not on PATH (`make install` installs it when run as root)"
    out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60)
    m = re.search(r"Kustomize Version: v(\d+)\.(\d+)", out.stdout)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_KUSTOMIZE:
        found = m.group(0) if m else (out.stdout + out.stderr).strip()[:200]
        return f"kubectl's kustomize is too old to render k8s/ ({found}); kustomize v5 or newer is needed"
    return None


def require_kubectl() -> None:
    """Skip where we cannot install kubectl (not root); where we can, its absence is a failure."""
    problem = _kubectl_problem()
    if problem is None:
        return
    if os.geteuid() != 0:
        pytest.skip(f"{problem}; not root, so `make install` could not install it")
    pytest.fail(f"{problem}; run `make install` (it installs kubectl as root)")


@functools.cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    """`kubectl kustomize` of one overlay: the objects `kubectl apply -k` would send."""
    require_kubectl()
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"kubectl kustomize k8s/overlays/{overlay} failed: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(overlay: str) -> list[Obj]:
    return copy.deepcopy(list(rendered(overlay)))


def by_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


# ---------------------------------------------------------------- walking pods -----------------


def cluster_specs(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for o in objs:
        if o["kind"] == "RayJob":
            yield f"RayJob/{o['metadata']['name']}", o["spec"]["rayClusterSpec"]
        elif o["kind"] == "RayCluster":
            yield f"RayCluster/{o['metadata']['name']}", o["spec"]


def pod_templates(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    """(where, pod template) for every pod the objects make: Deployments, Ray head/workers, submitter."""
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield name, o["spec"]["template"]
        if o["kind"] == "RayJob" and "submitterPodTemplate" in o["spec"]:
            yield f"{name} submitter", o["spec"]["submitterPodTemplate"]
    for where, spec in cluster_specs(objs):
        yield f"{where} head", spec["headGroupSpec"]["template"]
        for group in spec.get("workerGroupSpecs", []):
            yield f"{where} worker group {group['groupName']}", group["template"]


def containers(template: Obj) -> list[Obj]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def head_and_workers(spec: Obj) -> tuple[Obj, list[Obj]]:
    return spec["headGroupSpec"], spec.get("workerGroupSpecs", [])


def mount_of(template: Obj, volume_pred: Any) -> list[tuple[str, Obj]]:
    """(mountPath, volume) of each mount in the first container whose volume satisfies volume_pred."""
    vols = {v["name"]: v for v in template["spec"].get("volumes", [])}
    return [
        (m["mountPath"], vols[m["name"]])
        for m in template["spec"]["containers"][0].get("volumeMounts", [])
        if m["name"] in vols and volume_pred(vols[m["name"]])
    ]


# ---------------------------------------------------------------- checks (each returns problems) --


def _strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation: no unknown fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    # The C loader when PyYAML has it: the two CRDs are 2.3 MB of YAML.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((K8S / "schemas" / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def check_schemas(objs: list[Obj], k8s_version: str) -> list[str]:
    problems = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("RayJob", "RayCluster"):
            if o["apiVersion"] != "ray.io/v1":
                problems.append(f"{name}: apiVersion {o['apiVersion']}; expected ray.io/v1")
            for err in crd_validator(o["kind"]).iter_errors(o):
                problems.append(f"{name} at {'/'.join(map(str, err.absolute_path))}: {err.message}")
        else:
            try:
                kubernetes_validate.validate(o, k8s_version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{name}: {e.message} at {'/'.join(map(str, e.path))}")
    # The CRD schemas hold a copy of the pod template schema; check the templates against the real one.
    for where, tpl in pod_templates(objs):
        if where.split("/")[0] in ("RayJob", "RayCluster"):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}
            try:
                kubernetes_validate.validate(wrapped, k8s_version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{where} pod template: {e.message} at {'/'.join(map(str, e.path))}")
    return problems


def check_volumes(objs: list[Obj]) -> list[str]:
    problems = []
    for where, tpl in pod_templates(objs):
        vols = [v["name"] for v in tpl["spec"].get("volumes", [])]
        if len(vols) != len(set(vols)):
            problems.append(f"{where}: duplicate volume names {vols}")
        used = set()
        for c in containers(tpl):
            for m in c.get("volumeMounts", []):
                used.add(m["name"])
                if m["name"] not in vols:
                    problems.append(
                        f"{where} container {c['name']}: mounts volume {m['name']!r}, not defined"
                    )
        for v in set(vols) - used:
            problems.append(f"{where}: volume {v!r} is mounted by no container")
    return problems


def documented_secrets() -> dict[str, set[str]]:
    """Secrets the README has the user create: name -> keys (`kubectl create secret generic ...`)."""
    text = (K8S / "README.md").read_text().replace("\\\n", " ")
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.search(r"kubectl(?: -n \S+)? create secret generic (\S+)(.*)", line)
        if m:
            found.setdefault(m.group(1), set()).update(re.findall(r"--from-literal=([\w.-]+)=", m.group(2)))
    return found


def _secret_refs(objs: list[Obj]) -> Iterator[tuple[str, str, str | None]]:
    """(where, secret name, key or None) for every Secret the objects use."""
    for where, tpl in pod_templates(objs):
        for v in tpl["spec"].get("volumes", []):
            if "secret" in v:
                yield where, v["secret"]["secretName"], None
        for c in containers(tpl):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    yield f"{where} env {e['name']}", ref["name"], ref["key"]
            for e in c.get("envFrom", []):
                if "secretRef" in e:
                    yield where, e["secretRef"]["name"], None
    for where, spec in cluster_specs(objs):
        auth = spec.get("authOptions", {})
        if auth.get("secretName"):
            # KubeRay reads the token from the Secret's auth_token key.
            yield f"{where} authOptions", auth["secretName"], "auth_token"


def check_references(objs: list[Obj]) -> list[str]:
    problems = []
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    config_maps = {o["metadata"]["name"]: o for o in by_kind(objs, "ConfigMap")}
    for where, tpl in pod_templates(objs):
        for v in tpl["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                if ("PersistentVolumeClaim", claim) not in names:
                    problems.append(f"{where}: volume {v['name']} claims PVC {claim!r}, not defined")
            if "configMap" in v and v["configMap"]["name"] not in config_maps:
                problems.append(f"{where}: volume {v['name']} uses ConfigMap {v['configMap']['name']!r}")
            if "hostPath" in v:
                problems.append(f"{where}: hostPath volume {v['name']} (not allowed)")
    secrets = {o["metadata"]["name"]: o for o in by_kind(objs, "Secret")}
    documented = documented_secrets()
    for where, name, key in _secret_refs(objs):
        if name in secrets:
            if key and key not in {**secrets[name].get("data", {}), **secrets[name].get("stringData", {})}:
                problems.append(f"{where}: Secret {name} has no key {key!r}")
        elif name not in documented:
            problems.append(f"{where}: Secret {name!r} is neither defined nor created in k8s/README.md")
        elif key and key not in documented[name]:
            problems.append(f"{where}: k8s/README.md creates Secret {name} without key {key!r}")
    return problems


def _pods_selected(objs: list[Obj], selector: dict[str, str]) -> list[tuple[str, Obj]]:
    return [
        (w, t)
        for w, t in pod_templates(objs)
        if all(t.get("metadata", {}).get("labels", {}).get(k) == v for k, v in selector.items())
    ]


def _port_exists(templates: list[tuple[str, Obj]], port: int | str) -> bool:
    return any(
        port in (p.get("name"), p["containerPort"])
        for _, t in templates
        for c in containers(t)
        for p in c.get("ports", [])
    )


def check_services_and_policies(objs: list[Obj]) -> list[str]:
    problems = []
    for svc in by_kind(objs, "Service"):
        name = svc["metadata"]["name"]
        pods = _pods_selected(objs, svc["spec"].get("selector", {}))
        if not pods:
            problems.append(f"Service/{name}: its selector matches no pod template")
        for p in svc["spec"]["ports"]:
            if not _port_exists(pods, p.get("targetPort", p["port"])):
                problems.append(f"Service/{name}: targetPort {p.get('targetPort')} is no container port")
    for pol in by_kind(objs, "NetworkPolicy"):
        name = pol["metadata"]["name"]
        pods = _pods_selected(objs, pol["spec"]["podSelector"].get("matchLabels", {}))
        if not pods:
            problems.append(f"NetworkPolicy/{name}: its podSelector matches no pod template")
        for rule in pol["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                if not _port_exists(pods, p["port"]):
                    problems.append(f"NetworkPolicy/{name}: port {p['port']} is no port of the pods")
    return problems


def _quantity(q: str | int) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def check_security(objs: list[Obj]) -> list[str]:
    problems = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Service" and o["spec"].get("type", "ClusterIP") != "ClusterIP":
            problems.append(f"{name}: type {o['spec']['type']}; only ClusterIP (cluster-internal)")
        if o["kind"] in ("Ingress", "Route", "Gateway", "HTTPRoute"):
            problems.append(f"{name}: exposes the cluster outside")
        if o["kind"] == "ConfigMap":
            for key, text in o.get("data", {}).items():
                if re.search(r"(?im)^\s*[\w.-]*(password|token|secret)[\w.-]*\s*[:=]\s*\S", text):
                    problems.append(f"{name} key {key}: holds a secret; use a Secret object")
    for where, spec in cluster_specs(objs):
        head = spec["headGroupSpec"]
        if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
            problems.append(f"{where}: the head service must be ClusterIP with no ingress")
        auth = spec.get("authOptions", {})
        if auth.get("mode") != "token" or not auth.get("secretName"):
            problems.append(
                f"{where}: Ray token auth off (authOptions {auth}); expected mode token + secretName"
            )
        if spec.get("enableInTreeAutoscaling"):
            problems.extend(_container_security(f"{where} autoscaler", spec.get("autoscalerOptions", {})))
    for where, tpl in pod_templates(objs):
        pod = tpl["spec"]
        ctx = pod.get("securityContext", {})
        if ctx.get("runAsNonRoot") is not True or ctx.get("runAsUser", 0) == 0:
            problems.append(
                f"{where}: pod securityContext must set runAsNonRoot: true and a non-zero runAsUser"
            )
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                problems.append(f"{where}: {key} (not allowed)")
        for c in containers(tpl):
            problems.extend(_container_security(f"{where} container {c['name']}", c))
            if any("hostPort" in p for p in c.get("ports", [])):
                problems.append(f"{where} container {c['name']}: hostPort (not allowed)")
            for e in c.get("env", []):
                if re.search(r"PASSWORD|TOKEN|SECRET", e["name"]) and "value" in e:
                    problems.append(f"{where} env {e['name']}: a literal secret; use secretKeyRef")
    return problems


def _container_security(where: str, c: Obj) -> list[str]:
    problems = []
    sc = c.get("securityContext", {})
    if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: must set allowPrivilegeEscalation: false and not be privileged")
    if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get("add"):
        problems.append(f"{where}: must drop ALL capabilities and add none")
    res = c.get("resources", {})
    for part in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in res.get(part, {}):
                problems.append(f"{where}: no {part}.{r}")
    for r, limit in res.get("limits", {}).items():
        if r in res.get("requests", {}) and r == "cpu" and _quantity(res["requests"][r]) > _quantity(limit):
            problems.append(f"{where}: requests.{r} above limits.{r}")
    return problems


def embedded_config(objs: list[Obj], tmp: Path) -> tuple[Any, Path]:
    """The elastictrain config the RayJob's entrypoint reads, loaded with elastictrain's own loader."""
    from elastictrain.config import load_config

    (job,) = by_kind(objs, "RayJob")
    path = entrypoint_config_path(job)
    cm_name, key = config_source(job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"], path)
    (cm,) = [c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"] == cm_name]
    local = tmp / key
    local.write_text(cm["data"][key])
    raw = yaml.safe_load(cm["data"][key])
    overrides = []
    ds = raw.get("deepspeed", {})
    if "nvme" in (ds.get("offload_optimizer"), ds.get("offload_param")):
        # The node-local path exists only in the pods (checked against their volumes below).
        (tmp / "nvme").mkdir(exist_ok=True)
        overrides.append(f"deepspeed.nvme_path={tmp / 'nvme'}")
    return load_config(local, overrides), local


def entrypoint_config_path(job: Obj) -> str:
    argv = shlex.split(job["spec"]["entrypoint"])
    for flag in ("-c", "--config"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    raise AssertionError(f"entrypoint {job['spec']['entrypoint']!r} names no config file (-c)")


def config_source(head_template: Obj, path: str) -> tuple[str, str]:
    """(ConfigMap name, key) that the head pod's file at `path` comes from."""
    for mount_path, vol in mount_of(head_template, lambda v: "configMap" in v):
        if path.startswith(mount_path.rstrip("/") + "/"):
            return vol["configMap"]["name"], path[len(mount_path.rstrip("/")) + 1 :]
    raise AssertionError(f"{path} is not inside a ConfigMap volume of the head pod")


def check_entrypoint(job: Obj) -> list[str]:
    from typer.main import get_command

    from elastictrain.cli import app

    argv = shlex.split(job["spec"]["entrypoint"])
    if argv[:1] != ["elastictrain"]:
        return [f"entrypoint {argv}: expected the elastictrain CLI"]
    group = get_command(app)
    command = group.commands.get(argv[1]) if len(argv) > 1 else None  # type: ignore[attr-defined]
    if command is None:
        return [f"entrypoint {argv}: {argv[1:2]} is no elastictrain command"]
    try:
        command.make_context(argv[1], argv[2:])
    except Exception as e:  # noqa: BLE001 - typer's (vendored) click usage errors
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        return [f"entrypoint {argv}: {message}"]
    return []


def check_job(job: Obj) -> list[str]:
    s = job["spec"]
    problems = check_entrypoint(job)
    if s.get("backoffLimit", 0) < 1:
        problems.append("RayJob: backoffLimit must be >= 1 so a failed submission is retried (and resumes)")
    if s.get("shutdownAfterJobFinishes") is not True:
        problems.append("RayJob: shutdownAfterJobFinishes must be true")
    if "clusterSelector" in s or "rayClusterSpec" not in s:
        problems.append("RayJob: must create its own cluster (rayClusterSpec, no clusterSelector)")
    return problems


def check_config_fits_cluster(cfg: Any, spec: Obj, objs: list[Obj]) -> list[str]:
    """The elastictrain config against the Ray cluster spec, volumes and services it runs on."""
    problems = []
    s = cfg.scaling
    head, groups = head_and_workers(spec)
    if head.get("rayStartParams", {}).get("num-cpus") != "0":
        problems.append('head: rayStartParams num-cpus must be "0" (no training worker on the head)')
    if len(groups) != 1:
        return problems + [f"expected one worker group, got {len(groups)}"]
    (g,) = groups
    # Spares hold pods of their own: the group may grow to max_workers + spare_workers.
    pods = s.max_workers + s.spare_workers
    if (g.get("minReplicas"), g.get("maxReplicas")) != (s.min_workers, pods):
        problems.append(
            f"worker group {g['groupName']}: minReplicas/maxReplicas {g.get('minReplicas')}/"
            f"{g.get('maxReplicas')}; expected scaling.min_workers {s.min_workers} / "
            f"scaling.max_workers + spare_workers {pods}"
        )
    if not g.get("minReplicas", 0) <= g.get("replicas", 0) <= g.get("maxReplicas", 0):
        problems.append(f"worker group {g['groupName']}: replicas outside [minReplicas, maxReplicas]")
    if not spec.get("enableInTreeAutoscaling"):
        problems.append("enableInTreeAutoscaling must be true (elastictrain grows through the autoscaler)")
    params = g.get("rayStartParams", {})
    if _quantity(params.get("num-cpus", -1)) != s.cpus_per_worker:
        problems.append(f"worker num-cpus {params.get('num-cpus')}; expected scaling.cpus_per_worker")
    limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
    gpus = float(limits.get("nvidia.com/gpu", 0))
    if s.use_gpu and not (gpus == s.gpus_per_worker == 1 and float(params.get("num-gpus", gpus)) == 1):
        problems.append(f"worker pods have {gpus} GPUs; expected 1 (one worker per pod and GPU)")
    if not s.use_gpu and gpus:
        problems.append("worker pods ask for GPUs but scaling.use_gpu is false")
    if _quantity(limits["cpu"]) < s.cpus_per_worker:
        problems.append(f"worker CPU limit {limits['cpu']} below scaling.cpus_per_worker {s.cpus_per_worker}")
    # run.dir on the shared volume, at the same path in the driver (head) and every worker; or on an
    # object store that the driver and every worker reach with credentials from a Secret.
    for where, tpl in [("head", head["template"]), ("workers", g["template"])]:
        pvcs = mount_of(tpl, lambda v: "persistentVolumeClaim" in v)
        if cfg.run.dir.startswith("s3://"):
            env = {e["name"]: e for e in tpl["spec"]["containers"][0].get("env", [])}
            for name in S3_CREDENTIALS:
                if "secretKeyRef" not in env.get(name, {}).get("valueFrom", {}):
                    problems.append(f"{where}: run.dir {cfg.run.dir} needs {name} from a Secret")
        elif not any(cfg.run.dir.startswith(p.rstrip("/") + "/") for p, _ in pvcs):
            problems.append(f"{where}: run.dir {cfg.run.dir} is on no PersistentVolumeClaim mount")
        for _, vol in pvcs:
            claim = vol["persistentVolumeClaim"]["claimName"]
            (pvc,) = [p for p in by_kind(objs, "PersistentVolumeClaim") if p["metadata"]["name"] == claim]
            single_node = pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and g["maxReplicas"] <= 3
            if "ReadWriteMany" not in pvc["spec"]["accessModes"] and not single_node:
                problems.append(f"PVC {claim} (run folders) must be ReadWriteMany")
        if cfg.deepspeed.nvme_path:
            local = mount_of(tpl, lambda v: "emptyDir" in v or "ephemeral" in v)
            if not any(p == cfg.deepspeed.nvme_path.rstrip("/") for p, _ in local):
                problems.append(
                    f"{where}: deepspeed.nvme_path {cfg.deepspeed.nvme_path} is no node-local mount"
                )
    # tracking.uri names the MLflow Service, a port it has, and a Host header MLflow accepts.
    m = re.fullmatch(r"http://([\w.-]+):(\d+)/?", cfg.tracking.uri or "")
    if not m:
        return problems + [f"tracking.uri {cfg.tracking.uri!r}: expected http://SERVICE:PORT"]
    host, port = m.group(1), int(m.group(2))
    svcs = [o for o in by_kind(objs, "Service") if o["metadata"]["name"] == host.split(".")[0]]
    if not svcs or port not in [p["port"] for p in svcs[0]["spec"]["ports"]]:
        return problems + [f"tracking.uri {cfg.tracking.uri}: no Service {host} with port {port}"]
    for _, tpl in _pods_selected(objs, svcs[0]["spec"]["selector"]):
        args = " ".join(tpl["spec"]["containers"][0].get("args", []))
        allowed = re.search(r"--allowed-hosts[= ](\S+)", args)
        if allowed and not any(fnmatch.fnmatch(f"{host}:{port}", a) for a in allowed.group(1).split(",")):
            problems.append(f"MLflow --allowed-hosts does not accept Host {host}:{port}")
    return problems


# ---------------------------------------------------------------- the tests --------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_what_each_layout_needs(overlay: str) -> None:
    objs = objects(overlay)
    kinds = sorted(o["kind"] for o in objs)
    ray = "RayCluster" if overlay.endswith("-cluster") else "RayJob"
    claims = 1 if overlay in S3_OVERLAYS else 2  # MLflow's, and the run folders' unless on S3
    assert kinds == sorted(
        [ray, "ConfigMap", "ConfigMap", "Deployment", "NetworkPolicy", "NetworkPolicy"]
        + ["PersistentVolumeClaim"] * claims
        + ["Service"]
    )
    assert {o["metadata"].get("namespace") for o in objs} == {"elastictrain"}


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_are_valid(overlay: str, k8s_version: str) -> None:
    assert check_schemas(objects(overlay), k8s_version) == []


def test_namespace_manifest_is_valid_and_enforces_restricted_pods() -> None:
    (ns,) = _load_docs(K8S / "namespace.yaml")
    kubernetes_validate.validate(ns, K8S_VERSIONS[-1], strict=True)
    assert ns["metadata"]["name"] == "elastictrain"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_volumes_services_and_security(overlay: str) -> None:
    objs = objects(overlay)
    assert check_volumes(objs) == []
    assert check_references(objs) == []
    assert check_services_and_policies(objs) == []
    assert check_security(objs) == []


@pytest.mark.parametrize("overlay", JOB_OVERLAYS + S3_OVERLAYS)
def test_job_runs_the_cli_with_the_embedded_config(overlay: str, tmp_path: Path) -> None:
    objs = objects(overlay)
    (job,) = by_kind(objs, "RayJob")
    assert check_job(job) == []
    cfg, _ = embedded_config(objs, tmp_path)
    raw = yaml.safe_load((K8S / "overlays" / overlay / "elastictrain.yaml").read_text())
    cfg = _with_pod_paths(cfg, raw)
    assert check_config_fits_cluster(cfg, job["spec"]["rayClusterSpec"], objs) == []


def _with_pod_paths(cfg: Any, raw: Obj) -> Any:
    # embedded_config pointed nvme_path at a local folder; the cluster checks need the pods' path.
    cfg.deepspeed.nvme_path = raw.get("deepspeed", {}).get("nvme_path")
    return cfg


@pytest.mark.parametrize("overlay", JOB_OVERLAYS)
def test_standalone_cluster_equals_the_jobs_cluster(overlay: str) -> None:
    (job,) = by_kind(objects(overlay), "RayJob")
    (cluster,) = by_kind(objects(f"{overlay}-cluster"), "RayCluster")
    assert cluster["spec"] == job["spec"]["rayClusterSpec"]
    assert cluster["metadata"]["name"] == "elastictrain"


def test_layouts_differ_where_they_should() -> None:
    (cpu,) = by_kind(objects("cpu-demo"), "RayJob")
    (gpu,) = by_kind(objects("gpu"), "RayJob")
    cpu_w = cpu["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpu_w = gpu["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert "nvidia.com/gpu" not in cpu_w["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    images = {c["image"] for _, t in pod_templates(objects("gpu")) for c in containers(t)}
    assert images == {"elastictrain:0.1.0-gpu"}
    (runs,) = [
        p
        for p in by_kind(objects("gpu"), "PersistentVolumeClaim")
        if p["metadata"]["name"] == "elastictrain-runs"
    ]
    assert runs["spec"]["accessModes"] == ["ReadWriteMany"]
    # The demo's JSON patches address volumes by index: they must have hit the volumes meant.
    head_vols = {
        v["name"]: v for v in cpu["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    }
    worker_vols = {v["name"]: v for v in cpu_w["template"]["spec"]["volumes"]}
    assert head_vols["shm"]["emptyDir"]["sizeLimit"] == "512Mi"
    assert (worker_vols["nvme"]["emptyDir"]["sizeLimit"], worker_vols["shm"]["emptyDir"]["sizeLimit"]) == (
        "10Gi",
        "512Mi",
    )


def test_the_s3_layout_has_no_run_volume_and_gives_every_pod_the_bucket_credentials() -> None:
    objs = objects("gpu-s3")
    assert "elastictrain-runs" not in {p["metadata"]["name"] for p in by_kind(objs, "PersistentVolumeClaim")}
    cfg = yaml.safe_load(
        [c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"] == "elastictrain-config"][0]["data"][
            "config.yaml"
        ]
    )
    assert cfg["run"]["dir"].startswith("s3://")
    # The JSON patches remove volumes by index: they must have removed `runs` and nothing else.
    (gpu,) = by_kind(objects("gpu"), "RayJob")
    (s3,) = by_kind(objs, "RayJob")
    for where, tpl in pod_templates([s3]):
        (before,) = [t for w, t in pod_templates([gpu]) if w.split(" ", 1)[1:] == where.split(" ", 1)[1:]]
        names = [v["name"] for v in tpl["spec"].get("volumes", [])]
        assert names == [v["name"] for v in before["spec"].get("volumes", []) if v["name"] != "runs"], where
        if "submitter" in where:
            continue  # it only submits the job: no run folder, no credentials
        env = {e["name"]: e for e in tpl["spec"]["containers"][0]["env"]}
        for name in (*S3_CREDENTIALS, "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "elastictrain-s3", (where, name)
    # The base config with only run.dir changed: the layouts train the same model the same way.
    gpu_cfg = yaml.safe_load((K8S / "overlays" / "gpu" / "elastictrain.yaml").read_text())
    assert {**cfg, "run": {**cfg["run"], "dir": gpu_cfg["run"]["dir"]}} == gpu_cfg


def test_dockerfile_matches_the_manifests() -> None:
    text = (ROOT / "Dockerfile").read_text()
    (job,) = by_kind(objects("gpu"), "RayJob")
    ray_version = job["spec"]["rayClusterSpec"]["rayVersion"]
    assert re.search(r"pip install [^\n]*\btorch==2\.13\.0\b", text), "torch must be pinned to 2.13.0"
    assert f'"ray[train]=={ray_version}"' in text, f"the image's Ray must be the manifests' {ray_version}"
    assert re.search(r"apt-get install[^\n]*\blibaio-dev\b", text), "libaio-dev (NVMe offload) missing"
    assert "mlflow[auth]" in text, "the MLflow Deployment runs the basic-auth app"
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image must end as a non-root USER"
    uid = int(users[-1].split(":")[0])
    for _, tpl in pod_templates(objects("gpu")):
        assert tpl["spec"]["securityContext"]["runAsUser"] == uid
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "src" not in ignored


def test_readme_covers_every_layout_and_the_token_flow() -> None:
    text = (K8S / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"k8s/overlays/{overlay}" in text
    for needle in ("helm install", "kubectl apply -k", "RAY_AUTH_TOKEN", "ray job submit", "port-forward"):
        assert needle in text
    assert set(documented_secrets()) == {
        "elastictrain-ray-auth",
        "elastictrain-mlflow-auth",
        "elastictrain-s3",
    }


# ---------------------------------------------------------------- the checks can fail ----------


def _job(objs: list[Obj]) -> Obj:
    (job,) = by_kind(objs, "RayJob")
    return job


def _worker(objs: list[Obj]) -> Obj:
    return _job(objs)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def test_faults_are_caught(tmp_path: Path) -> None:
    base = objects("gpu")
    raw = yaml.safe_load((K8S / "overlays" / "gpu" / "elastictrain.yaml").read_text())
    cfg = _with_pod_paths(embedded_config(base, tmp_path)[0], raw)

    def fits(objs: list[Obj]) -> list[str]:
        return check_config_fits_cluster(cfg, _job(objs)["spec"]["rayClusterSpec"], objs)

    objs = copy.deepcopy(base)
    _worker(objs)["maxReplicas"] = 9
    assert any("maxReplicas" in p for p in fits(objs))

    objs = copy.deepcopy(base)
    _worker(objs)["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "2"
    assert any("GPUs" in p for p in fits(objs))

    objs = copy.deepcopy(base)
    _worker(objs)["template"]["spec"]["volumes"] = [
        v for v in _worker(objs)["template"]["spec"]["volumes"] if v["name"] != "nvme"
    ]
    assert any("not defined" in p for p in check_volumes(objs))

    objs = copy.deepcopy(base)
    _worker(objs)["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = True
    assert any("privileged" in p for p in check_security(objs))

    objs = copy.deepcopy(base)
    del _job(objs)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "resources"
    ]["limits"]
    assert any("no limits.cpu" in p for p in check_security(objs))

    objs = copy.deepcopy(base)
    by_kind(objs, "Service")[0]["spec"]["type"] = "NodePort"
    assert any("NodePort" in p for p in check_security(objs))

    objs = copy.deepcopy(base)
    _job(objs)["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "disabled"
    assert any("token auth off" in p for p in check_security(objs))

    objs = copy.deepcopy(base)
    [c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"] == "elastictrain-config"][0]["data"][
        "extra"
    ] = "password: hunter2\n"
    assert any("holds a secret" in p for p in check_security(objs))

    objs = copy.deepcopy(base)
    _job(objs)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"][1][
        "valueFrom"
    ]["secretKeyRef"]["name"] = "nowhere"
    assert any("nowhere" in p for p in check_references(objs))

    objs = copy.deepcopy(base)
    by_kind(objs, "Service")[0]["spec"]["ports"][0]["targetPort"] = "metrics"
    assert any("targetPort" in p for p in check_services_and_policies(objs))

    objs = copy.deepcopy(base)
    _job(objs)["spec"]["entrypoint"] = "elastictrain train -c /etc/elastictrain/config.yaml --workers 3"
    assert any("--workers" in p for p in check_job(_job(objs)))
    _job(objs)["spec"]["entrypoint"] = "elastictrain fit -c /etc/elastictrain/config.yaml"
    assert any("no elastictrain command" in p for p in check_job(_job(objs)))

    objs = copy.deepcopy(base)
    _worker(objs)["rayStartParams"]["num-cpu"] = "4"  # a typo is still a string map entry: schema-valid
    _job(objs)["spec"]["rayClusterSpec"]["headGroupSpec"]["serviceTyp"] = "ClusterIP"
    assert any("serviceTyp" in p for p in check_schemas(objs, K8S_VERSIONS[-1]))

    objs = copy.deepcopy(base)
    _worker(objs)["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPat"] = "/x"
    assert any("mountPat" in p for p in check_schemas(objs, K8S_VERSIONS[-1]))

    s3 = objects("gpu-s3")
    s3_cfg = _with_pod_paths(embedded_config(s3, tmp_path)[0], raw)
    assert check_config_fits_cluster(s3_cfg, _job(s3)["spec"]["rayClusterSpec"], s3) == []
    env = _worker(s3)["template"]["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "AWS_SECRET_ACCESS_KEY"]
    problems = check_config_fits_cluster(s3_cfg, _job(s3)["spec"]["rayClusterSpec"], s3)
    assert problems == [f"workers: run.dir {s3_cfg.run.dir} needs AWS_SECRET_ACCESS_KEY from a Secret"]


# ---------------------------------------------------------------- the MLflow server, for real --


@pytest.mark.integration
def test_mlflow_deployment_command_serves_with_basic_auth(tmp_path: Path) -> None:
    """The Deployment's own command, args and env (paths moved to tmp, host to loopback) start a server
    that refuses anonymous and foreign-Host requests and accepts the driver's credentials."""
    pytest.importorskip("flask_wtf", reason="mlflow[auth] (Flask-WTF) is not installed")
    import base64
    import os
    import socket
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = int(sock.getsockname()[1])
    objs = objects("gpu")
    (dep,) = by_kind(objs, "Deployment")
    (ini,) = [
        c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"] == "elastictrain-mlflow-auth-config"
    ]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    store, port, password = tmp_path / "store", free, "a-password-of-24-chars!!"
    store.mkdir()
    (tmp_path / "basic_auth.ini").write_text(ini["data"]["basic_auth.ini"].replace("/mlflow/", f"{store}/"))
    args = [a.replace("/mlflow/", f"{store}/") for a in container["args"]]
    args = [f"--port={port}" if a.startswith("--port=") else a for a in args]
    args = ["--host=127.0.0.1" if a.startswith("--host=") else a for a in args]
    env_names = {e["name"] for e in container["env"]}
    assert {
        "MLFLOW_AUTH_ADMIN_USERNAME",
        "MLFLOW_AUTH_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
    } <= env_names
    env = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "basic_auth.ini"),
        "MLFLOW_AUTH_ADMIN_USERNAME": "admin",
        "MLFLOW_AUTH_ADMIN_PASSWORD": password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "k" * 32,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    assert container["command"] == ["mlflow", "server"]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )

    def status(path: str, host: str, auth: str | None = None) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Host": host})
        if auth:
            req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if status("/health", "elastictrain-mlflow:5000") == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        query = "/api/2.0/mlflow/experiments/search?max_results=1"
        assert status(query, "elastictrain-mlflow:5000") == 401
        assert status(query, "elastictrain-mlflow:5000", f"admin:{password}") == 200
        assert (
            status(query, "elastictrain-mlflow.elastictrain.svc.cluster.local:5000", f"admin:{password}")
            == 200
        )
        assert status(query, "attacker.example:5000", f"admin:{password}") == 403
        assert status(query, "elastictrain-mlflow:5000", "admin:not-the-password") == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
