"""The deploy/ overlays as pods that `podman kube play` runs on one host (scripts/check-kube).

Rendered with kustomize, every Deployment, StatefulSet and DaemonSet becomes one Pod per replica
(a DaemonSet: one, for this one node), changed only where one host with podman 4.3 needs it, each
change listed in CHANGES. Everything else is played as written: images, arguments, environment,
the ConfigMap, security contexts, resources, emptyDir and hostPath volumes, restart policy."""
import copy
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

NODE = "node-0"  # every pod runs on the one host: one node

ROOT = Path(__file__).resolve().parents[2]
UID = 65532  # the images' user (deploy/docker/Dockerfile)

CHANGES = [
    "hostNetwork: every pod on the host's network, each listening port moved to a free one "
    "(containerPort declarations dropped: podman refuses them with the host's network)",
    "Service names in arguments (dd-router:50051) replaced by 127.0.0.1 and the backing pod's port, and a "
    "StatefulSet pod's name under its headless Service (dd-etcd-0.dd-etcd:2379) by 127.0.0.1 and that pod's port",
    "a StatefulSet's volumeClaimTemplates as host directories, one per pod and claim",
    "Secret volumes delivered as host directories of the same files (podman 4.3 panics on secret volumes), "
    "secretKeyRef variables as values (it reads env secrets as JSON)",
    "fieldRef status.podIP, metadata.name and spec.nodeName as values (127.0.0.1, the pod's name, one node name "
    "for every pod)",
    "$(VAR) references in arguments expanded from the container's environment and ConfigMap as Kubernetes "
    "does (podman 4.3 leaves those from envFrom unexpanded)",
    "gRPC probes removed from the pods (podman 4.3 runs none) and run from the host instead",
    "the /run/dualdecoder hostPath moved under the check's directory; affinity dropped (one node)",
    "images from local storage (localhost/..., imagePullPolicy Never)",
]
PLAYED = {"Deployment", "StatefulSet", "DaemonSet", "ConfigMap"}


def kubectl():
    found = shutil.which("kubectl")
    if found:
        return found
    candidate = Path(sysconfig.get_path("scripts")) / "kubectl"  # scripts/install-deps, from PyPI
    if candidate.exists():
        return str(candidate)
    sys.exit("check-kube: kubectl not found (scripts/install-deps installs it)")


def render(overlay):
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pod:
    """One pod to play: its YAML, its host ports by container port, and its probes."""

    def __init__(self, name, workload, ordinal):
        self.name, self.workload, self.ordinal = name, workload, ordinal
        self.labels = workload["spec"]["template"]["metadata"].get("labels", {})
        self.ports = {}  # container port -> host port
        self.named = {}  # port name -> container port
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for p in c.get("ports", []):
                self.ports[p["containerPort"]] = free_port()
                if "name" in p:
                    self.named[p["name"]] = p["containerPort"]
        self.probes = {}  # "startupProbe" -> (host port, service)
        self.doc = None

    def host_port(self, port):
        port = self.named.get(port, port)
        return self.ports[int(port)]


def expand(text, env):
    """Kubernetes' $(VAR) references in an argument, from the container's environment."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def plan(docs, tag, workdir, secret_files):
    """The pods of an overlay's workloads; `secret_files` maps secret name -> {key: bytes}."""
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    pods = []
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        n = 1 if d["kind"] == "DaemonSet" else d["spec"].get("replicas", 1)
        pods += [Pod(f"{d['metadata']['name']}-{i}", d, i) for i in range(n)]

    def backend(service, port, pod_name=None):  # a Service's port -> 127.0.0.1:<host port of a pod behind it>
        svc = services[service]
        target = next(p.get("targetPort", p["port"]) for p in svc["spec"]["ports"] if p["port"] == int(port))
        pod = next(p for p in pods if all(p.labels.get(k) == v for k, v in svc["spec"]["selector"].items())
                   and pod_name in (None, p.name))
        return f"127.0.0.1:{pod.host_port(target)}"

    by_name = {p.name for p in pods}

    secrets_dir = workdir / "secrets"
    for name, files in secret_files.items():
        (secrets_dir / name).mkdir(parents=True, exist_ok=True)
        for key, data in files.items():
            f = secrets_dir / name / key
            f.write_bytes(data)
            f.chmod(0o400)
            os.chown(f, UID, UID)
        os.chown(secrets_dir / name, UID, UID)
    run_dir = workdir / "run-dualdecoder"
    run_dir.mkdir(exist_ok=True)
    os.chown(run_dir, UID, UID)

    for pod in pods:
        spec = copy.deepcopy(pod.workload["spec"]["template"]["spec"])
        spec["hostNetwork"] = True
        spec.pop("affinity", None)
        spec["restartPolicy"] = "Always"
        for claim in pod.workload["spec"].get("volumeClaimTemplates", []):
            d = workdir / "claims" / f"{pod.name}-{claim['metadata']['name']}"
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, UID, UID)
            spec.setdefault("volumes", []).append({"name": claim["metadata"]["name"],
                                                   "hostPath": {"path": str(d), "type": "Directory"}})
        for v in spec.get("volumes", []):
            if "secret" in v:
                v["hostPath"] = {"path": str(secrets_dir / v.pop("secret")["secretName"]), "type": "Directory"}
            elif "hostPath" in v and v["hostPath"]["path"] == "/run/dualdecoder":
                v["hostPath"] = {"path": str(run_dir), "type": "Directory"}
        for c in spec["containers"]:
            c.pop("ports", None)  # declarations only; with hostNetwork podman refuses port mappings
            c["image"] = f"localhost/{c['image'].split(':')[0]}:{tag}"
            c["imagePullPolicy"] = "Never"
            env, values = [], {}
            for src in c.get("envFrom", []):
                values.update(configmaps.get(src.get("configMapRef", {}).get("name"), {}))
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "fieldRef" in ref:
                    path = ref["fieldRef"]["fieldPath"]
                    e = {"name": e["name"], "value": {"status.podIP": "127.0.0.1", "metadata.name": pod.name,
                                                       "spec.nodeName": NODE}[path]}
                elif "secretKeyRef" in ref:
                    k = ref["secretKeyRef"]
                    e = {"name": e["name"], "value": secret_files[k["name"]][k["key"]].decode()}
                if "value" in e:
                    values[e["name"]] = e["value"]
                env.append(e)
            if env:
                c["env"] = env
            args = []
            for a in c.get("args", []):
                a = expand(a, values)
                a = re.sub(r"0\.0\.0\.0:(\d+)", lambda m: f"127.0.0.1:{pod.ports[int(m.group(1))]}", a)
                a = re.sub(r"(?<![\w.-])([a-z][a-z0-9-]*)\.([a-z][a-z0-9-]*):(\d+)",
                           lambda m: backend(m.group(2), m.group(3), m.group(1))
                           if m.group(2) in services and m.group(1) in by_name else m.group(0), a)
                a = re.sub(r"(?<![\w.-])([a-z][a-z0-9-]*):(\d+)",
                           lambda m: backend(m.group(1), m.group(2)) if m.group(1) in services else m.group(0), a)
                args.append(a)
            c["args"] = args
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.pop(probe, None)
                if p and "grpc" in p:
                    pod.probes[probe] = (pod.ports[p["grpc"]["port"]], p["grpc"].get("service", ""))
        pod.doc = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": pod.name, "labels": dict(pod.labels)}, "spec": spec}
    return pods


def not_played(docs):
    """The overlay's objects that podman does not run, by kind (checked offline: check-deploy)."""
    kinds = {}
    for d in docs:
        if d["kind"] not in PLAYED:
            kinds.setdefault(d["kind"], []).append(d["metadata"]["name"])
    return kinds
