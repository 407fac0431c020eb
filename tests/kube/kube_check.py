"""Starts the deploy/ overlays' workloads with `podman kube play` from the images
scripts/build-images made, and drives them from the host as a user would (scripts/check-kube).

  single-node  ddctl serve: gRPC health probes, a Generate stream, the OpenAI client, /metrics,
               SIGTERM drain of a running stream.
  cluster      etcd (3 members), two router replicas, two workers, the pool: the same, plus a
               worker killed mid-stream (the request resumes on the other), a router replica
               killed under load (every stream reconnects through the other), the pool killed
               mid-stream (the requests' KV is rebuilt) and a worker's SIGTERM drain.

Every check prints PASS or FAIL with its figures; the exit status is the number of failures."""
import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import pods as podlib

TAG = os.environ.get("DD_IMAGE_TAG", "latest")
PROMPT = "Write one sentence about the river that flows past the old mill."
failures = []
KEEP = False  # --keep: leave the pods for podman logs (set by main)


def podman(*args, check=True, timeout=120):
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {r.stderr.strip()}")
    return r


def kill(pod):
    """SIGKILL to every container of the pod, returning once they have exited (a `pod start` issued
    while podman still cleans up after the kill has been seen to be killed in turn)."""
    podman("pod", "kill", pod.name)
    names = podman("ps", "-a", "--filter", f"pod={pod.name}", "--format", "{{.Names}}").stdout.split()
    podman("wait", *names, timeout=60)


def report(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def health(port, service="", timeout=5):
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = health_pb2.HealthCheckRequest(service=service)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2_grpc.HealthStub(ch).Check(req, timeout=timeout).status)
    except grpc.RpcError as e:
        return e.code().name


def wait_probes(pod, limit_s=300):
    """The pod's startup probe, then its readiness probe, as kubelet would run them."""
    t0 = time.monotonic()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe not in pod.probes:
            continue
        port, service = pod.probes[probe]
        status = ""
        while time.monotonic() - t0 < limit_s:
            status = health(port, service)
            if status == "SERVING":
                break
            time.sleep(0.5)
        report(f"{pod.name} {probe}", status == "SERVING",
               f"grpc.health.v1 '{service}' on its port: {status} after {time.monotonic() - t0:.1f} s")


def play(pod, configmaps, workdir):
    f = workdir / f"{pod.name}.yaml"
    f.write_text(yaml.safe_dump_all([*configmaps, pod.doc]))
    podman("kube", "play", "--replace", str(f), timeout=300)


def ddctl(workdir, *args, stream=False):
    """ddctl from its image, with the check's files at /check (read-only), on the host network."""
    cmd = ["podman", "run", "--rm", "-i", "--network=host", "--read-only", "-v", f"{workdir}/secrets:/check:ro",
           f"localhost/dualdecoder/ddctl:{TAG}", *args]
    if stream:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def generate_args(router_ports, n, *extra):
    """`router_ports`: one port, or several replicas' (ddctl fails over between them)."""
    ports = router_ports if isinstance(router_ports, (list, tuple)) else [router_ports]
    return ["generate", "--server", ",".join(f"127.0.0.1:{p}" for p in ports), "--prompt", PROMPT,
            "--max_new_tokens", str(n), "--ignore_eos", "--api_key_file=/check/client/tenant_key", *extra]


class Stream:
    """A streaming Generate through ddctl --events, read on a thread."""

    def __init__(self, workdir, router_port, n):
        self.p = ddctl(workdir, *generate_args(router_port, n, "--events"), stream=True)
        self.tokens, self.summary, self.got_first = [], None, threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "token_ids" in msg:
                self.tokens += msg["token_ids"]
                if len(self.tokens) >= 2:
                    self.got_first.set()
            else:
                self.summary = msg
        self.got_first.set()

    def finish(self, timeout=300):
        self.p.wait(timeout=timeout)
        self.thread.join(timeout=10)
        return self.p.returncode, self.p.stderr.read()


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as f:
        return f.read().decode()


def check_api(workdir, router, http, name):
    r = ddctl(workdir, *generate_args(router, 16, "--json"))
    ok = r.returncode == 0
    out = json.loads(r.stdout) if ok else {}
    report(f"{name}: Generate stream", ok and len(out.get("tokens", [])) == 16,
           f"{len(out.get('tokens', []))} tokens, text {out.get('text', '')[:60]!r}" if ok else r.stderr.strip())
    from openai import OpenAI
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=(workdir / "tenant_key").read_text().strip())
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "Name a colour."}])
        report(f"{name}: OpenAI client", chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0,
               f"model {model}, {chat.usage.completion_tokens} tokens: {chat.choices[0].message.content!r}")
    except Exception as e:  # noqa: BLE001 (reported as a failure)
        report(f"{name}: OpenAI client", False, repr(e))
    return out.get("tokens", [])


def check_metrics(pods_by_name, wanted):
    for pod_name, metric in wanted:
        pod = pods_by_name[pod_name]
        try:
            page = scrape(pod.host_port("metrics"))
            report(f"{pod_name} /metrics", metric in page, f"{len(page)} bytes, {metric} {'present' if metric in page else 'missing'}")
        except OSError as e:
            report(f"{pod_name} /metrics", False, repr(e))


def metric_sum(port, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in scrape(port).splitlines() if l.startswith(name + " ")
               or l.startswith(name + "{"))


def serving_worker(workers):
    """The worker pod whose batch holds a request now (dd_batch_size > 0)."""
    for w in workers:
        try:
            for line in scrape(w.host_port("metrics")).splitlines():
                if line.startswith("dd_batch_size") and float(line.rsplit(" ", 1)[1]) > 0:
                    return w
        except OSError:
            continue
    return None


def etcd_healthy(pod):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{pod.host_port('metrics')}/health", timeout=5) as f:
            return json.loads(f.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def wait_etcd(members, limit_s=120):
    """The members' readiness probe (GET /health), as kubelet would run it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and not all(etcd_healthy(m) for m in members):
        time.sleep(0.5)
    up = [m.name for m in members if etcd_healthy(m)]
    report("cluster: etcd", len(up) == len(members), f"{len(up)} of {len(members)} members healthy after "
           f"{time.monotonic() - t0:.1f} s")


def make_secrets(workdir):
    tenant, operator, cluster, pool = (secrets.token_hex(20) for _ in range(4))
    key_file = workdir / "tenant_key"  # the OpenAI client's copy, the check's own (not the pods')
    key_file.write_text(tenant + "\n")
    key_file.chmod(0o600)
    keys = json.dumps([{"tenant": "team-a", "key": tenant}]).encode()
    return {
        "client": {"tenant_key": tenant.encode()},  # the API key ddctl shows (not a manifest's secret)
        "dd-api-keys": {"api_keys.json": keys, "operator_key": operator.encode()},
        "dd-cluster-secret": {"secret": cluster.encode()},
        "dd-pool-tenants": {"tenants.json": json.dumps([{"name": "workers", "token": pool, "quota": "1GiB"}]).encode()},
        "dd-worker-pool-token": {"token": pool.encode()},
    }


def describe(docs):
    print("played:", ", ".join(sorted({f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] in podlib.PLAYED})))
    for kind, names in sorted(podlib.not_played(docs).items()):
        print(f"not played ({kind}): {', '.join(names)}")


def single_node(workdir):
    docs = podlib.render("single-node")
    describe(docs)
    pods = podlib.plan(docs, TAG, workdir, make_secrets(workdir))
    configmaps = [d for d in docs if d["kind"] == "ConfigMap"]
    (serve,) = pods
    try:
        play(serve, configmaps, workdir)
        wait_probes(serve)
        ref = check_api(workdir, serve.host_port("grpc"), serve.host_port("http"), "single-node")
        check_metrics({serve.name: serve}, [(serve.name, "dd_batch_size"), (serve.name, "dd_router_inflight")])
        s = Stream(workdir, serve.host_port("grpc"), 256)
        s.got_first.wait(120)
        t0, at_stop = time.monotonic(), len(s.tokens)
        podman("pod", "stop", "-t", "45", serve.name, timeout=120)
        code, err = s.finish()
        report("single-node: SIGTERM drain", code == 0 and len(s.tokens) == 256 and at_stop < 256 and s.tokens[:16] == ref,
               f"SIGTERM after {at_stop} of 256 tokens; the stream finished with {len(s.tokens)} (status {code}), "
               f"the pod exited {time.monotonic() - t0:.1f} s after the signal" + (f": {err.strip()}" if code else ""))
    finally:
        if not KEEP:
            podman("pod", "rm", "-f", serve.name, check=False)


def cluster(workdir):
    docs = podlib.render("cluster")
    describe(docs)
    pods = podlib.plan(docs, TAG, workdir, make_secrets(workdir))
    configmaps = [d for d in docs if d["kind"] == "ConfigMap"]
    by = {p.name: p for p in pods}
    router, router_b, pool = by["dd-router-0"], by["dd-router-1"], by["dd-kv-pool-0"]
    members = [p for p in pods if p.name.startswith("dd-etcd-")]
    workers = [p for p in pods if p.name.startswith("dd-decode-worker-")]
    try:
        for p in [*members, pool, router, router_b, *workers]:
            play(p, configmaps, workdir)
        wait_etcd(members)
        for p in [pool, router, router_b, *workers]:
            wait_probes(p)
        for r in (router, router_b):  # each replica lists both workers from etcd
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and metric_sum(r.host_port("metrics"), "dd_worker_up") < len(workers):
                time.sleep(0.5)
            up = metric_sum(r.host_port("metrics"), "dd_worker_up")
            report(f"{r.name}: workers from etcd", up == len(workers), f"{up:.0f} of {len(workers)} workers up")
        pools = metric_sum(router.host_port("metrics"), "dd_registry_pools")  # workers found it there too
        report("cluster: the pool registered in etcd", pools == 1, f"{pools:.0f} pools registered")
        ref = check_api(workdir, router.host_port("grpc"), router.host_port("http"), "cluster")
        check_metrics(by, [(router.name, "dd_worker_up"), (pool.name, "dd_pool_bytes"),
                           *((w.name, "dd_batch_size") for w in workers)])
        # Streams long enough (several seconds) that the kill and the SIGTERM land mid-stream.
        n_ref = 256
        full = ddctl(workdir, *generate_args(router.host_port("grpc"), n_ref, "--json"))
        want = json.loads(full.stdout)["tokens"] if full.returncode == 0 else []

        # A worker killed mid-stream: the router resumes the request on the other worker.
        s = Stream(workdir, router.host_port("grpc"), n_ref)
        s.got_first.wait(120)
        victim = serving_worker(workers)
        if victim:
            kill(victim)
        code, err = s.finish()
        resumes = metric_sum(router.host_port("metrics"), "dd_router_resumes_total")
        report("cluster: worker killed mid-stream", victim is not None and code == 0 and s.tokens == want and resumes >= 1,
               f"killed {victim.name if victim else 'none'} mid-stream; stream status {code}, "
               f"{len(s.tokens)} tokens, equal to an undisturbed run: {s.tokens == want}; router resumes {resumes:.0f}"
               + (f": {err.strip()}" if code else ""))
        if victim:  # kubelet restarts a killed pod's containers (restartPolicy Always); podman leaves it stopped
            podman("pod", "start", victim.name)
        for w in workers:
            wait_probes(w)

        # A router replica killed under load: every client reconnects through the other replica
        # and resumes its stream (as a client would through the Service) with no token lost.
        ports = [router.host_port("grpc"), router_b.host_port("grpc")]
        streams = [Stream(workdir, ports, n_ref) for _ in range(4)]
        for s in streams:
            s.got_first.wait(120)
        at_kill = [len(s.tokens) for s in streams]
        kill(router)
        results = [s.finish() for s in streams]
        reconnects = metric_sum(router_b.host_port("metrics"), "dd_router_reconnects_total")
        report("cluster: router replica killed under load", all(c == 0 for c, _ in results)
               and all(s.tokens == want for s in streams) and all(k < n_ref for k in at_kill) and reconnects == len(streams),
               f"{router.name} SIGKILLed after {at_kill} of {n_ref} tokens; streams {[c for c, _ in results]}, "
               f"as undisturbed: {[s.tokens == want for s in streams]}; reconnects through {router_b.name}: "
               f"{reconnects:.0f}" + "".join(f": {e.strip()}" for c, e in results if c))
        podman("pod", "start", router.name)  # as kubelet restarts it
        wait_probes(router)

        # The pool killed mid-stream: workers notice at their next lease renewal (a third of
        # --lease_ttl_ms, 10 s), wait for the restarted pool and rebuild the requests' KV. The
        # streams are long enough to outlast that.
        n = 1200
        streams = [Stream(workdir, router.host_port("grpc"), n) for _ in range(2)]
        for s in streams:
            s.got_first.wait(120)
        at_kill = [len(s.tokens) for s in streams]
        kill(pool)
        podman("pod", "start", pool.name)  # as kubelet restarts it, at the same address
        results = [s.finish() for s in streams]
        rebuilt = sum(metric_sum(w.host_port("metrics"), "dd_requests_rebuilt_total") for w in workers)
        report("cluster: pool killed mid-stream", all(c == 0 for c, _ in results) and rebuilt >= 2
               and all(len(s.tokens) == n and s.tokens[:n_ref] == want for s in streams) and all(k < n for k in at_kill)
               and streams[0].tokens == streams[1].tokens,
               f"pool SIGKILLed and restarted after {at_kill} of {n} tokens; requests rebuilt by the workers "
               f"{rebuilt:.0f}; streams {[c for c, _ in results]} with {[len(s.tokens) for s in streams]} tokens, "
               f"the first {n_ref} as undisturbed: {[s.tokens[:n_ref] == want for s in streams]}, the two alike: "
               f"{streams[0].tokens == streams[1].tokens}"
               + "".join(f": {e.strip()}" for c, e in results if c))

        # SIGTERM: the serving worker drains its running request before it exits.
        resumes = metric_sum(router.host_port("metrics"), "dd_router_resumes_total")  # since its restart
        s = Stream(workdir, router.host_port("grpc"), n_ref)
        s.got_first.wait(120)
        victim = serving_worker(workers)
        t0, at_stop = time.monotonic(), len(s.tokens)
        if victim:
            podman("pod", "stop", "-t", "45", victim.name, timeout=120)
        code, err = s.finish()
        resumed = metric_sum(router.host_port("metrics"), "dd_router_resumes_total") - resumes
        report("cluster: worker SIGTERM drain", victim is not None and code == 0 and s.tokens == want and at_stop < n_ref
               and resumed == 0,
               f"SIGTERM to {victim.name if victim else 'none'} after {at_stop} of {n_ref} tokens; it exited "
               f"{time.monotonic() - t0:.1f} s later; stream status {code}, {len(s.tokens)} tokens, as undisturbed: "
               f"{s.tokens == want}, resumed elsewhere: {resumed:.0f}" + (f": {err.strip()}" if code else ""))
    finally:
        for p in pods if not KEEP else []:
            podman("pod", "rm", "-f", p.name, check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overlays", nargs="*", default=["single-node", "cluster"])
    ap.add_argument("--keep", action="store_true", help="keep the pods and the check's directory (podman logs)")
    a = ap.parse_args()
    global KEEP
    KEEP = a.keep
    print("changed for one host with podman:\n  " + "\n  ".join(podlib.CHANGES))
    workdir = Path(tempfile.mkdtemp(prefix="dd-check-kube-"))
    os.chmod(workdir, 0o755)
    t0 = time.monotonic()
    for overlay in a.overlays:
        print(f"== {overlay}", flush=True)
        (workdir / overlay).mkdir()
        {"single-node": single_node, "cluster": cluster}[overlay](workdir / overlay)
    print(f"check-kube: {len(failures)} failed in {time.monotonic() - t0:.0f} s" + (f": {', '.join(failures)}" if failures else ""))
    if not a.keep:
        subprocess.run(["rm", "-rf", str(workdir)])
    return min(len(failures), 100)


if __name__ == "__main__":
    sys.exit(main())
