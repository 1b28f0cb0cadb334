#!/usr/bin/env python3
"""Tidepool on a real Kubernetes cluster (kube-local): the chart's tests.

usage: k8s_test.py smoke|full [--report FILE]

smoke: install (3 nodes, 1 etcd member, the build-cache gateway),
       tidectl put/get through the coordinator Service, a blob through the
       gateway's HTTP cache, `helm test`, uninstall, no pod left.
full:  install (3 nodes, 3 etcd members) and time to Ready; `helm test`;
       scale 3 -> 5 under a write load (replicas move onto the new pods, no
       failed write); scale 5 -> 3 under a write load (every shard keeps a
       quorum of running replicas at every poll, zero lost acknowledged
       writes); `helm upgrade` to another image tag under a write load
       (rolling restart, the longest write gap); a node pod force-deleted
       (returns on its PVC, catches up); the leading coordinator pod killed
       (the other takes over); etcd's volumes lost under a write load
       (the map restored from a node pod); lost again with the
       coordinator pods restarted meanwhile (they found a new cluster,
       which lists the nodes it refuses; the map restored); every
       acknowledged write read back; uninstall leaves no pods (PVCs stay).

Needs root, the images (`make image`), and kube-local (KUBE_LOCAL, else
../shared/kube-local/kube-local next to the repository). Figures are printed
and written as Markdown to --report (default target/k8s-report.md).
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tidepool"
# A namespace per run: deleting one waits out its pods' grace periods.
NS = f"tp-{int(time.time()) % 1000000}"
REL = "tp"
VERSION = os.environ.get("VERSION", "0.1.0")
IMAGE = "localhost/tidepool"
ETCD_IMAGE = "localhost/tidepool-etcd"
REPORT = []


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def figure(name, value):
    log(f"FIGURE {name}: {value}")
    REPORT.append((name, value))


def kube_local():
    candidates = [os.environ.get("KUBE_LOCAL")] if os.environ.get("KUBE_LOCAL") else []
    candidates += [ROOT.parent / "shared/kube-local/kube-local", Path("/work/shared/kube-local/kube-local")]
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    sys.exit("kube-local not found: set KUBE_LOCAL to its path")


KL = kube_local()


def run(*args, check=True, capture=True, timeout=900, input=None):
    r = subprocess.run(args, capture_output=capture, text=True, timeout=timeout, input=input)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def kubectl(*args, **kw):
    return run("kubectl", "-n", NS, *args, **kw)


def load_env():
    for line in run(KL, "env").stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            value = value.strip('"').replace("$PATH", os.environ["PATH"])
            os.environ[key] = value


def available_volumes():
    pvs = json.loads(run("kubectl", "get", "pv", "-o", "json").stdout)["items"]
    return sum(1 for pv in pvs if pv.get("status", {}).get("phase") == "Available")


KL_RUN = Path(os.environ.get("KUBE_LOCAL_HOME", Path.home() / ".cache/kube-local")) / "run"
KL_PARTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
            "containerd", "kubelet", "kube-proxy", "coredns")


def pid_runs(name):
    """Whether kube-local's pid file for `name` names a live process of that
    program (a pid file can outlive its process and the pid be reused)."""
    try:
        pid = int((KL_RUN / f"{name}.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except (OSError, ValueError):
        return False
    return os.path.basename(cmdline.decode(errors="replace")) == name


def clear_stale_state():
    """Removes what a kube-local that is not running left behind: pid files
    of dead (or reused) pids, and containerd's socket file. A stale socket
    file makes `kube-local up` believe containerd is listening before it is
    (it waits for the file to exist), and its first `ctr` call then fails
    with "connection refused"."""
    if pid_runs("kube-apiserver"):
        return
    for name in KL_PARTS:
        if (KL_RUN / f"{name}.pid").exists() and not pid_runs(name):
            (KL_RUN / f"{name}.pid").unlink()
    if not pid_runs("containerd"):
        (KL_RUN / "containerd" / "containerd.sock").unlink(missing_ok=True)


def kube_local_up():
    """`kube-local up`, once more after a `down` when it fails; the logs of
    its parts are printed when it fails twice."""
    for attempt in (1, 2):
        clear_stale_state()
        if run(KL, "up", capture=False, timeout=3600, check=False).returncode == 0:
            return
        log(f"kube-local up failed (attempt {attempt})")
        for name in KL_PARTS:
            logfile = KL_RUN / f"{name}.log"
            if logfile.exists():
                tail = logfile.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {logfile} (last lines)\n" + "\n".join(tail), flush=True)
        run(KL, "down", capture=False, timeout=600, check=False)
    raise RuntimeError("kube-local up failed twice")


def cluster_up(volumes):
    """kube-local up; restarted afresh when fewer than `volumes` of its
    (retained, single-use) PersistentVolumes are left."""
    started = time.time()
    kube_local_up()
    load_env()
    # Releases an earlier, failed run left behind.
    for ns in json.loads(run("kubectl", "get", "namespaces", "-o", "json").stdout)["items"]:
        name = ns["metadata"]["name"]
        if name.startswith("tp-") and name != NS and ns["status"].get("phase") == "Active":
            log(f"removing the release an earlier run left in {name}")
            run("helm", "uninstall", REL, "-n", name, "--wait", "--timeout", "5m", check=False, capture=False)
            run("kubectl", "delete", "namespace", name, "--wait=false", check=False)
    if available_volumes() < volumes:
        log(f"fewer than {volumes} free volumes left: restarting kube-local afresh")
        run(KL, "down", capture=False, timeout=600)
        # kube-local's `down` leaves the containers' processes running,
        # orphaned (still dialling, still resolving names against the next
        # cluster's DNS); these images' binaries live in /usr/local/bin.
        run("pkill", "-9", "-f", "^/usr/local/bin/(tidepool|tidectl|etcd) ", check=False)
        kube_local_up()
        load_env()
    # Docker (which kube-local starts for image builds) sets the FORWARD
    # policy to DROP; with bridge netfilter on, that drops pod-to-pod
    # traffic on kube-local's bridge. DOCKER-USER is where Docker lets
    # admins accept traffic.
    for flag in ("-s", "-d"):
        rule = ["DOCKER-USER", flag, "10.244.0.0/16", "-j", "ACCEPT"]
        if run("iptables", "-C", *rule, check=False).returncode != 0:
            run("iptables", "-I", *rule)
    figure("kube-local up", f"{time.time() - started:.0f} s")
    run(KL, "load", f"{IMAGE}:{VERSION}", f"{ETCD_IMAGE}:{VERSION}", capture=False)


def install(nodes, etcd, extra=()):
    run("kubectl", "create", "namespace", NS, check=False)
    started = time.time()
    run("helm", "install", REL, str(CHART), "-n", NS,
        "--set", f"fullnameOverride={REL}",
        "--set", "image.pullPolicy=Never", "--set", "etcd.image.pullPolicy=Never",
        # kube-local's volumes are host directories, which ignore fsGroup.
        "--set", "volumePermissions.enabled=true",
        "--set", f"nodes.replicas={nodes}", "--set", f"etcd.replicas={etcd}",
        "--set", "cluster.shards=8", "--set", "nodes.persistence.size=4Gi",
        "--set", "nodes.terminationGracePeriodSeconds=600",
        # Five node pods, three etcd members and two coordinators on 2 CPUs.
        "--set", "nodes.resources.requests.cpu=100m",
        *extra, "--wait", "--timeout", "10m", capture=False)
    took = time.time() - started
    figure(f"helm install --wait ({nodes} nodes, {etcd} etcd), every pod Ready", f"{took:.0f} s")


def token():
    out = kubectl("get", "secret", f"{REL}-admin-token", "-o", "jsonpath={.data.token}").stdout
    import base64
    return base64.b64decode(out).decode()


def tidectl(*args, pod=None, check=True, timeout=300):
    """tidectl in a pod, the token on its standard input (as the README
    says: never in the arguments, which the API server's audit log shows)."""
    pod = pod or f"{REL}-node-0"
    container = ["-c", "node"] if "node" in pod else []
    return kubectl("exec", "-i", pod, *container, "--", "tidectl", "--token-file", "/dev/stdin", *args,
                   check=check, timeout=timeout, input=token())


def host_tidepool():
    """The tidepool binary `make image` built on this machine (the image's)."""
    built = [p for p in (ROOT / "target" / "release" / "tidepool", ROOT / "target" / "debug" / "tidepool")
             if p.exists()]
    if not built:
        raise RuntimeError("no tidepool binary under target/ (make image builds one)")
    return str(max(built, key=lambda p: p.stat().st_mtime))


def secret_cert_days(name):
    """Days left on the certificate `client.pem` of Secret `name`."""
    import base64
    import tempfile
    data = json.loads(kubectl("get", "secret", name, "-o", "json").stdout)["data"]
    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as pem:
        pem.write(base64.b64decode(data["client.pem"]))
        pem.flush()
        end = run("openssl", "x509", "-noout", "-enddate", "-in", pem.name).stdout.strip()
    # notAfter=Dec  6 06:50:14 2027 GMT
    stamp = end.split("=", 1)[1]
    import datetime
    at = datetime.datetime.strptime(stamp, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=datetime.timezone.utc)
    return (at - datetime.datetime.now(datetime.timezone.utc)).days


def client_certificate_renewed():
    """A client Secret's certificate near its end (here: issued for 5 days
    from the cluster's CA, as one a year old would be) is issued again by
    the next `helm upgrade` (the setup Job), for the chart's validity."""
    import base64
    import tempfile
    name = f"{REL}-client-admin"
    ca = json.loads(kubectl("get", "secret", f"{REL}-ca", "-o", "json").stdout)["data"]
    with tempfile.TemporaryDirectory() as d:
        for key in ("ca.pem", "ca-key.pem"):
            Path(d, key).write_bytes(base64.b64decode(ca[key]))
        run(host_tidepool(), "certs", "issue", "--dir", d, "--out", "client", "--days", "5", "client", "admin")
        patch = {"data": {key: base64.b64encode(Path(d, key).read_bytes()).decode()
                          for key in ("client.pem", "client-key.pem")}}
    kubectl("patch", "secret", name, "--type", "merge", "-p", json.dumps(patch))
    before = secret_cert_days(name)
    if before > 5:
        raise AssertionError(f"the short certificate was not put in place: {before} days left")
    started = time.time()
    run("helm", "upgrade", REL, str(CHART), "-n", NS, "--reuse-values", "--wait", "--timeout", "10m",
        capture=False)
    after = secret_cert_days(name)
    if after < 300:
        raise AssertionError(f"helm upgrade left the client certificate with {after} days")
    figure("a client Secret's certificate 5 days from its end, then helm upgrade",
           f"renewed: {before} -> {after} days left ({time.time() - started:.0f} s)")


def etcd_members_fixed(installed):
    """An upgrade asking for another etcd member count is refused before it
    changes anything (etcd names its members once)."""
    other = 3 if installed == 1 else 1
    r = run("helm", "upgrade", REL, str(CHART), "-n", NS, "--reuse-values",
            "--set", f"etcd.replicas={other}", check=False)
    if r.returncode == 0 or "etcd.replicas cannot change" not in (r.stderr + r.stdout):
        raise AssertionError(f"helm upgrade to {other} etcd members was not refused: {r.stdout}\n{r.stderr}")
    sts = json.loads(kubectl("get", "statefulset", f"{REL}-etcd", "-o", "json").stdout)
    if sts["spec"]["replicas"] != installed:
        raise AssertionError(f"etcd StatefulSet changed to {sts['spec']['replicas']} members")
    figure(f"helm upgrade asking {other} etcd members on a release with {installed}", "refused, nothing changed")


def status():
    return json.loads(tidectl("--json", "cluster", "status").stdout)


def pods(component):
    out = kubectl("get", "pods", "-l", f"app.kubernetes.io/component={component}", "-o", "json").stdout
    return json.loads(out)["items"]


def running_pod_names():
    names = set()
    for p in pods("node"):
        statuses = p.get("status", {}).get("containerStatuses", [])
        if any(s.get("name") == "node" and "running" in s.get("state", {}) for s in statuses):
            names.add(p["metadata"]["name"])
    return names


def ready(pod):
    """Whether every container of `pod` is ready. A pod not yet scheduled
    (its volume unbound) has no container status: not ready."""
    statuses = pod.get("status", {}).get("containerStatuses")
    return bool(statuses) and all(s.get("ready") for s in statuses)


def wait(what, predicate, timeout=600, every=2):
    deadline = time.time() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception as e:  # a poll that failed is retried
            last = e
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(every)


LOAD_POD = f"""
apiVersion: v1
kind: Pod
metadata:
  name: load
  namespace: {NS}
spec:
  automountServiceAccountToken: false
  securityContext: {{runAsUser: 10001, runAsGroup: 10001, fsGroup: 10001}}
  containers:
    - name: load
      image: {IMAGE}:{VERSION}
      imagePullPolicy: Never
      command: [/bin/sleep, infinity]
      env:
        - {{name: TIDEPOOL_COORDINATOR, value: "https://{REL}-coordinator.{NS}.svc.cluster.local:7400"}}
        - {{name: TIDEPOOL_TLS_DIR, value: /etc/tidepool/client}}
        - {{name: TIDEPOOL_TOKEN_FILE, value: /etc/tidepool/token/token}}
      securityContext:
        runAsNonRoot: true
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities: {{drop: [ALL]}}
      volumeMounts:
        - {{name: client, mountPath: /etc/tidepool/client, readOnly: true}}
        - {{name: token, mountPath: /etc/tidepool/token, readOnly: true}}
        - {{name: work, mountPath: /work}}
  volumes:
    - {{name: client, secret: {{secretName: {REL}-client-admin, defaultMode: 0440}}}}
    - {{name: token, secret: {{secretName: {REL}-admin-token, defaultMode: 0440}}}}
    - {{name: work, emptyDir: {{}}}}
"""


class Load:
    """`tidectl load` in the load pod until stopped; records acknowledged keys."""

    def __init__(self, name):
        self.name = name
        self.slug = slug(name)
        self.result = None
        kubectl("exec", "load", "--", "rm", "-f", "/work/stop")
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        time.sleep(3)

    def _run(self):
        self.result = kubectl("exec", "load", "--", "tidectl", "--json", "--timeout", "30", "load", "load",
                              "--seconds", "0", "--stop-file", "/work/stop", "--writers", "4",
                              "--size", "4096", "--prefix", self.slug, "--record", f"/work/{self.slug}.rec",
                              check=False, timeout=3600)

    def stop(self):
        kubectl("exec", "load", "--", "touch", "/work/stop")
        self.thread.join()
        r = self.result
        lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
        if not lines:
            raise RuntimeError(f"load {self.name} printed no result:\n{r.stdout}\n{r.stderr}")
        summary = json.loads(lines[-1])
        failures = [l for l in r.stderr.splitlines() if "failed" in l]
        for l in failures[:10]:
            log(f"  load {self.name}: {l}")
        figure(f"{self.name}: writes acknowledged / failed", f"{summary['acknowledged']} / {summary['failed']} "
               f"({summary['puts_per_second']:.0f} puts/s)")
        figure(f"{self.name}: longest write gap (no writer acknowledged)", f"{summary['longest_gap_ms']} ms")
        figure(f"{self.name}: slowest acknowledged write (one caller's wait)", f"{summary['slowest_put_ms']} ms")
        if summary["failed"]:
            raise RuntimeError(f"{self.name}: {summary['failed']} writes failed")
        return summary


def slug(name):
    return "".join(c if c.isalnum() else "-" for c in name)


def verify(name):
    r = kubectl("exec", "load", "--", "tidectl", "--json", "verify", "load", f"/work/{slug(name)}.rec",
                check=False, timeout=1800)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"verify {name} failed:\n{r.stdout}\n{r.stderr}")
    summary = json.loads(lines[-1])
    figure(f"{name}: acknowledged writes read back intact", f"{summary['checked'] - summary['bad']} of {summary['checked']}")
    if summary["bad"]:
        raise RuntimeError(f"{name}: {summary['bad']} acknowledged writes lost")


def pod_of(address):
    # https://<pod>.<headless>...:7401
    return address.split("//", 1)[1].split(".", 1)[0]


def replicas_per_pod(st):
    by_id = {n["id"]: pod_of(n["address"]) for n in st["nodes"]}
    count = {}
    for s in st["shards"]:
        for r in s["replicas"]:
            count[by_id[r]] = count.get(by_id[r], 0) + 1
    return count


def helm_test():
    started = time.time()
    run("helm", "test", "-n", NS, REL, "--timeout", "5m", capture=False)
    figure("helm test (put, get, compare, delete through the Service)", f"passed in {time.time() - started:.0f} s")


def put_get():
    tidectl("namespace", "create", "smoke", check=False)
    tidectl("put", "smoke", "hello", "/etc/hostname")
    got = tidectl("get", "smoke", "hello").stdout
    expected = kubectl("exec", f"{REL}-node-0", "-c", "node", "--", "cat", "/etc/hostname").stdout
    if got != expected:
        raise RuntimeError(f"get returned {got!r}, put {expected!r}")
    figure("tidectl put/get through the coordinator Service", "ok")


def uninstall():
    kubectl("delete", "pod", "load", "--ignore-not-found", "--grace-period=1")
    started = time.time()
    run("helm", "uninstall", REL, "-n", NS, "--wait", "--timeout", "10m", capture=False)
    wait("no pods", lambda: not json.loads(kubectl("get", "pods", "-o", "json").stdout)["items"], timeout=300)
    left = json.loads(kubectl("get", "pods", "-o", "json").stdout)["items"]
    pvcs = json.loads(kubectl("get", "pvc", "-o", "json").stdout)["items"]
    figure("helm uninstall: pods left", f"{len(left)} (after {time.time() - started:.0f} s); PVCs kept: {len(pvcs)}")
    if left:
        raise RuntimeError(f"pods left after uninstall: {[p['metadata']['name'] for p in left]}")
    run("kubectl", "delete", "namespace", NS, "--wait=false", capture=False)


def gateway_http():
    """The build-cache gateway's HTTP cache through its Service (from this
    host, whose kube-proxy rules route ClusterIPs): a verified PUT of a CAS
    blob, the GET of it, a PUT whose bytes do not match its name refused,
    and a request without a token refused."""
    import hashlib
    import urllib.error
    import urllib.request
    ip = kubectl("get", "service", f"{REL}-gateway", "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
    body = os.urandom(100_000)
    digest = hashlib.sha256(body).hexdigest()
    url = f"http://{ip}:7481/cas/{digest}"
    auth = {"Authorization": f"Bearer {token()}"}

    def call(method, url, data=None, headers=auth):
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    started = time.time()
    assert call("PUT", url, body)[0] == 200
    status_code, got = call("GET", url)
    assert status_code == 200 and got == body, status_code
    wrong = hashlib.sha256(b"something else").hexdigest()
    assert call("PUT", f"http://{ip}:7481/cas/{wrong}", body)[0] == 400
    assert call("GET", url, headers={})[0] == 401
    figure("gateway: HTTP cache PUT/GET through its Service (verified, tokens required)",
           f"ok in {time.time() - started:.1f} s")


def quantity_bytes(text):
    """A Kubernetes memory quantity ("4Gi", "512Mi", "1G", "1048576") in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def memory_budget():
    # Each node derives its memory budget (all its replicas' indexes and
    # value caches) from its container's memory limit: half of it.
    pod = pods("node")[0]
    name = pod["metadata"]["name"]
    limit = quantity_bytes(pod["spec"]["containers"][0]["resources"]["limits"]["memory"])
    text = kubectl("get", "--raw", f"/api/v1/namespaces/{NS}/pods/{name}:9401/proxy/metrics").stdout

    def gauge(metric):
        for line in text.splitlines():
            if line.startswith(metric + "{") or line.startswith(metric + " "):
                return int(float(line.rsplit(" ", 1)[1]))
        raise AssertionError(f"{metric} not in {name}'s metrics")

    budget = gauge("tidepool_node_index_memory_limit_bytes") + gauge("tidepool_node_cache_limit_bytes")
    figure("node memory budget (half its container's memory limit)", f"{budget >> 20} MiB of {limit >> 20} MiB")
    if budget != limit // 2:
        raise AssertionError(f"{name}: memory budget {budget} bytes, container limit {limit} bytes")


# etcdctl inside an etcd member's pod, as helm/README.md tells operators to
# run it: the member's own certificate (it is a client certificate too: the
# members authenticate to each other with it) against its local endpoint.
ETCDCTL = ("etcdctl", "--endpoints=https://localhost:2379", "--cacert=/etc/tidepool/ca/ca.pem",
           "--cert=/tls/tls.pem", "--key=/tls/tls-key.pem")


def etcd_maintenance():
    """The etcd image's etcdctl, as helm/README.md's "etcd maintenance"
    runs it: the member healthy, a snapshot saved, checked and copied out of
    the pod, holding the cluster map's key; a defrag; no alarm raised."""
    import tempfile
    pod = f"{REL}-etcd-0"
    started = time.time()

    def etcdctl(*args):
        return kubectl("exec", pod, "-c", "etcd", "--", *ETCDCTL, *args).stdout

    health = json.loads(etcdctl("endpoint", "health", "--write-out=json"))
    if not all(member["health"] for member in health):
        raise RuntimeError(f"etcd not healthy: {health}")
    etcdctl("snapshot", "save", "/var/lib/etcd/snapshot.db")
    info = json.loads(kubectl("exec", pod, "-c", "etcd", "--", "etcdctl", "snapshot", "status",
                              "/var/lib/etcd/snapshot.db", "--write-out=json").stdout)
    keys = etcdctl("get", "--prefix", "--keys-only", "/").split()
    if info["totalKey"] < 1 or not any(key.endswith("/map") for key in keys):
        raise RuntimeError(f"snapshot {info}, keys {keys}: no cluster map")
    saved = int(kubectl("exec", pod, "-c", "etcd", "--", "stat", "-c", "%s", "/var/lib/etcd/snapshot.db").stdout)
    with tempfile.TemporaryDirectory() as out:
        kubectl("cp", "-c", "etcd", f"{NS}/{pod}:/var/lib/etcd/snapshot.db", f"{out}/snapshot.db")
        copied = os.path.getsize(f"{out}/snapshot.db")
    # The file is the database plus its SHA-256 (32 bytes).
    if copied != saved or saved < info["totalSize"]:
        raise RuntimeError(f"copied {copied} bytes of a {saved}-byte snapshot ({info})")
    kubectl("exec", pod, "-c", "etcd", "--", "rm", "/var/lib/etcd/snapshot.db")
    etcdctl("defrag")
    alarms = etcdctl("alarm", "list").strip()
    if alarms:
        raise RuntimeError(f"etcd alarms raised: {alarms}")
    figure("etcd maintenance with the image's etcdctl (health, snapshot saved, checked, copied out, defrag, alarms)",
           f"ok in {time.time() - started:.1f} s: {info['totalKey']} keys, {copied} bytes")
    etcd_refuses_other_certificates(pod)


def etcd_refuses_other_certificates(pod):
    """etcd holds the cluster map and the token hashes: a certificate of the
    cluster's CA that is not a coordinator's (here the `admin` client's, as
    an application holds it) is refused, though the CA signed it. Before,
    any such certificate could read and rewrite the map."""
    import base64
    probe = "/var/lib/etcd/probe"
    kubectl("exec", pod, "-c", "etcd", "--", "mkdir", "-p", probe)
    try:
        data = json.loads(kubectl("get", "secret", f"{REL}-client-admin", "-o", "json").stdout)["data"]
        for name in ("client.pem", "client-key.pem"):
            kubectl("exec", "-i", pod, "-c", "etcd", "--", "sh", "-c", f"cat > {probe}/{name}",
                    input=base64.b64decode(data[name]).decode())
        refused = kubectl("exec", pod, "-c", "etcd", "--", "etcdctl", "--endpoints=https://localhost:2379",
                          "--cacert=/etc/tidepool/ca/ca.pem", f"--cert={probe}/client.pem",
                          f"--key={probe}/client-key.pem", "--dial-timeout=3s", "--command-timeout=5s",
                          "get", "--prefix", "--keys-only", "/", check=False)
        if refused.returncode == 0:
            raise AssertionError(f"etcd let a client certificate read the cluster map: {refused.stdout}")
        said = (refused.stderr + refused.stdout).strip()
        # Refused in the handshake (etcdctl then times out dialing), not for
        # a file it could not read.
        if "no such file" in said or not ("deadline exceeded" in said or "certificate" in said):
            raise AssertionError(f"etcdctl failed for another reason than the certificate: {said}")
        errors = [line for line in said.splitlines() if line.startswith("Error:")]
        figure("etcd with the admin client's certificate (the cluster's CA, not a coordinator's)",
               "refused: " + (errors or said.splitlines())[-1][:200])
    finally:
        kubectl("exec", pod, "-c", "etcd", "--", "rm", "-rf", probe, check=False)


def zones_are_hosts():
    """Every node's failure domain is its Kubernetes host (kube-local's
    node has no zone label; with coordinator.kubernetes.zones=false the
    host is read from the pod). Before, zones=false put every node in one
    empty domain."""
    hosts = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods("node")}
    for node in status()["nodes"]:
        pod = pod_of(node["address"])
        assert node["zone"] == f"host:{hosts[pod]}", (node, hosts)
    log(f"every node's zone is its host ({len(hosts)} pods)")


def volume_size_fixed():
    """An upgrade changing a volume's size is refused by the chart, with
    what to do instead (the API server refused it after rendering)."""
    out = run("helm", "upgrade", REL, str(CHART), "-n", NS, "--reuse-values",
              "--set", "nodes.persistence.size=5Gi", check=False)
    assert out.returncode != 0, "a changed volume size was accepted"
    assert "nodes.persistence.size cannot change" in out.stdout + out.stderr, out.stderr
    log("an upgrade changing nodes.persistence.size is refused")


def smoke():
    cluster_up(4)
    install(3, 1, ("--set", "gateway.enabled=true", "--set", "gateway.replicas=1",
                   "--set", "coordinator.kubernetes.zones=false"))
    put_get()
    zones_are_hosts()
    volume_size_fixed()
    etcd_maintenance()
    etcd_members_fixed(1)
    client_certificate_renewed()
    memory_budget()
    gateway_http()
    helm_test()
    uninstall()


def scale(replicas, load_name, watch_quorum=False):
    load = Load(load_name)
    started = time.time()
    kubectl("scale", "statefulset", f"{REL}-node", f"--replicas={replicas}")
    worst = [99]

    def settled():
        st = status()
        per_pod = replicas_per_pod(st)
        running = running_pod_names()
        if watch_quorum:
            by_id = {n["id"]: pod_of(n["address"]) for n in st["nodes"]}
            for s in st["shards"]:
                live = sum(1 for r in s["replicas"] if by_id[r] in running)
                worst[0] = min(worst[0], live)
                if live < len(s["replicas"]) // 2 + 1:
                    raise AssertionError(f"shard {s['id']} has {live} of {len(s['replicas'])} replicas running")
        wanted = {f"{REL}-node-{i}" for i in range(replicas)}
        return (not st["moves"] and running == wanted
                and all(per_pod.get(p, 0) > 0 for p in wanted)
                and all(pod in wanted for pod, n in per_pod.items() if n > 0))

    deadline = time.time() + 900
    while True:
        try:
            if settled():
                break
        except AssertionError:
            load.stop()
            raise
        except Exception as e:
            log(f"  poll: {e}")
        if time.time() > deadline:
            raise RuntimeError(f"scale to {replicas} did not settle")
        time.sleep(1)
    took = time.time() - started
    time.sleep(3)
    load.stop()
    st = status()
    figure(f"{load_name}: settled (pods, replicas placed, no move left)", f"{took:.0f} s")
    figure(f"{load_name}: replicas per pod after", json.dumps(dict(sorted(replicas_per_pod(st).items()))))
    if watch_quorum:
        figure(f"{load_name}: fewest running replicas of any shard at any poll", f"{worst[0]} of 3")
    return load_name


def upgrade(load_name):
    tag = f"{VERSION}-upgrade"
    run("docker", "tag", f"{IMAGE}:{VERSION}", f"{IMAGE}:{tag}")
    run(KL, "load", f"{IMAGE}:{tag}", capture=False)
    load = Load(load_name)
    started = time.time()
    run("helm", "upgrade", REL, str(CHART), "-n", NS, "--reuse-values", "--set", f"image.tag={tag}",
        "--wait", "--timeout", "15m", capture=False)
    wait("every node pod on the new image", lambda: all(
        p["spec"]["containers"][0]["image"].endswith(tag) and ready(p)
        for p in pods("node")), timeout=900)
    figure(f"{load_name}: helm upgrade --wait (rolling restart of every pod)", f"{time.time() - started:.0f} s")
    time.sleep(3)
    load.stop()


def force_delete_node(load_name):
    # The pod leading the most shards: its shards must elect new leaders.
    st = status()
    by_id = {n["id"]: pod_of(n["address"]) for n in st["nodes"]}
    leads = {}
    for sh in st["shards"]:
        if sh["leader"]:
            leads[by_id[sh["leader"]]] = leads.get(by_id[sh["leader"]], 0) + 1
    victim = max(sorted(leads), key=lambda p: leads[p]) if leads else f"{REL}-node-1"
    figure(f"{load_name}: victim", f"{victim}, leading {leads.get(victim, 0)} of {len(st['shards'])} shards")
    load = Load(load_name)
    old_uid = kubectl("get", "pod", victim, "-o", "jsonpath={.metadata.uid}").stdout
    started = time.time()
    kubectl("delete", "pod", victim, "--force", "--grace-period=0")
    def back():
        p = json.loads(kubectl("get", "pod", victim, "-o", "json").stdout)
        return p["metadata"]["uid"] != old_uid and ready(p)
    wait(f"{victim} to return Ready", back, timeout=600)
    figure(f"{load_name}: force-deleted pod back Ready on its PVC", f"{time.time() - started:.0f} s")
    time.sleep(5)
    load.stop()


def kill_leader_coordinator(load_name):
    """kill -9 of the leading coordinator's process (kube-local runs the
    containers on this host): no resignation; the other coordinator takes
    over when the leader's etcd lease expires, and kubelet restarts the
    killed container."""
    leader = None
    for _ in range(30):  # the Service answers from either coordinator
        st = status()
        if st["is_leader"]:
            leader = st["coordinator"]
            break
    if leader is None:
        raise RuntimeError("no answer from the leading coordinator")
    load = Load(load_name)
    started = time.time()
    # Other flags (--log-format) come between the subcommand and --id.
    run("pkill", "-9", "-f", f"tidepool coordinator .*--id={leader}( |$)")

    # The map can change again once a coordinator leads (kubelet restarts
    # the killed container meanwhile; whichever wins the election leads).
    wait("a coordinator to lead and change the map",
         lambda: tidectl("namespace", "create", "after-failover", check=False, timeout=60).returncode == 0,
         timeout=300, every=0.5)
    figure(f"{load_name}: leading coordinator killed (kill -9): the map changes again after",
           f"{time.time() - started:.1f} s")
    wait("the killed coordinator back", lambda: all(ready(p) for p in pods("coordinator")),
         timeout=300)
    load.stop()


def lose_etcd_volumes(restart_coordinators=False):
    """Scales etcd's StatefulSet to 0, deletes its PVCs (and, if asked, the
    coordinator pods, which restart while etcd is away) and scales it back:
    the members start on new, empty volumes."""
    members = len(pods("etcd"))
    kubectl("scale", "statefulset", f"{REL}-etcd", "--replicas=0")
    wait("the etcd pods gone", lambda: not pods("etcd"), timeout=300)
    kubectl("delete", "pvc", "-l", "app.kubernetes.io/component=etcd", "--wait=true", timeout=300)
    if restart_coordinators:
        kubectl("delete", "pod", "-l", "app.kubernetes.io/component=coordinator", "--wait=true", timeout=300)
    kubectl("scale", "statefulset", f"{REL}-etcd", f"--replicas={members}")
    wait("etcd back, empty", lambda: len(pods("etcd")) == members and all(ready(p) for p in pods("etcd")),
         timeout=600)
    return members


def etcd_lost(load_name):
    """etcd's data lost with the coordinators running: every member's pod
    deleted with its volume, the StatefulSet makes them again, empty. The
    coordinators keep serving the map they hold and change nothing (the
    store is behind it); the load's writes go on (the data path needs no
    coordinator); `tidectl cluster restore-map --from-node` from a node pod
    puts the newest map the nodes hold back, and the map changes again."""
    before = status()
    ours, version = before["cluster_id"], before["map_version"]
    load = Load(load_name)
    started = time.time()
    members = lose_etcd_volumes()
    figure(f"{load_name}: etcd's {members} members back on new, empty volumes", f"after {time.time() - started:.0f} s")
    wait("the coordinators to refuse changes until the map is restored",
         lambda: "restore-map" in tidectl("namespace", "create", "on-no-map", check=False, timeout=60).stderr,
         timeout=300, every=2)
    address = next(n["address"] for n in before["nodes"] if pod_of(n["address"]) == f"{REL}-node-0")
    restored = json.loads(tidectl("--json", "cluster", "restore-map", "--from-node", address).stdout)
    if restored["cluster_id"] != ours or restored["map_version"] <= version:
        raise RuntimeError(f"restored {restored}; the cluster was {ours} at v{version}")
    figure(f"{load_name}: map restored from the nodes",
           f"v{restored['map_version']} from {pod_of(restored['from_node'])} (the store held v{restored['previous_version']})")
    wait("a namespace created after the restore",
         lambda: tidectl("namespace", "create", "after-etcd-lost", check=False, timeout=60).returncode == 0,
         timeout=300, every=1)
    figure(f"{load_name}: etcd's volumes lost to the map changing again", f"{time.time() - started:.0f} s")
    load.stop()


def etcd_lost_coordinators_restarted(load_name):
    """etcd's data lost and the coordinators restarted before it is back
    (as when the pods are rescheduled with a storage failure): they find an
    empty store and found a new cluster, which the nodes refuse
    (`WRONG_CLUSTER`) while they serve their data; the new cluster's status
    lists the nodes it refused, with their cluster and addresses; the map
    restored from a node pod makes the cluster whole again."""
    before = status()
    ours, version = before["cluster_id"], before["map_version"]
    load = Load(load_name)
    started = time.time()
    lose_etcd_volumes(restart_coordinators=True)
    # The nodes that run call the coordinators (those a scale-down drained
    # do not); the Service answers from either coordinator, and each lists
    # the calls it received.
    up_before = {n["id"] for n in before["nodes"] if n["state"] == "up"}
    seen = {}

    def founded_and_refusing():
        st = status()
        if st["cluster_id"] != ours and {r["id"] for r in st["refused_nodes"]} >= up_before:
            seen["status"] = st
            return True
        return False

    wait("a new cluster founded that lists every running node as refused", founded_and_refusing,
         timeout=300, every=2)
    founded = seen["status"]
    if founded["nodes"] or any(r["cluster_id"] != ours for r in founded["refused_nodes"]):
        raise RuntimeError(f"the new cluster took a node, or lists another cluster: {founded}")
    wait("cluster status to print the restore command",
         lambda: "restore-map --from-node https://" in tidectl("cluster", "status").stdout, timeout=60, every=1)
    figure(f"{load_name}: coordinators restarted on the empty etcd: new cluster, nodes refused",
           f"{len(founded['refused_nodes'])} nodes listed after {time.time() - started:.0f} s")
    address = next(r["address"] for r in founded["refused_nodes"] if pod_of(r["address"]) == f"{REL}-node-0")
    restored = json.loads(tidectl("--json", "cluster", "restore-map", "--from-node", address).stdout)
    if restored["cluster_id"] != ours or restored["map_version"] <= version:
        raise RuntimeError(f"restored {restored}; the cluster was {ours} at v{version}")
    figure(f"{load_name}: map restored from the nodes",
           f"v{restored['map_version']} over cluster {restored['previous_cluster_id'][:8]}... v{restored['previous_version']}")
    wait("the nodes up before up in their cluster again, none refused", lambda: (lambda st: (
        st["cluster_id"] == ours and not st["refused_nodes"]
        and {n["id"] for n in st["nodes"] if n["state"] == "up"} >= up_before))(status()),
        timeout=300, every=2)
    wait("a namespace created after the restore",
         lambda: tidectl("namespace", "create", "after-restart-on-empty-etcd", check=False, timeout=60).returncode == 0,
         timeout=300, every=1)
    figure(f"{load_name}: etcd's volumes lost and coordinators restarted, to the map changing again",
           f"{time.time() - started:.0f} s")
    load.stop()


def full():
    # Volumes are single-use: 3 etcd members and up to 5 node pods, then two
    # sets of 3 new etcd volumes (steps etcd_lost and
    # etcd_lost_coordinators_restarted). With 8, a kube-local that smoke
    # runs had used left too few for the second set of etcd volumes.
    cluster_up(14)
    install(3, 3)
    helm_test()
    put_get()
    zones_are_hosts()
    kubectl("apply", "-f", "-", input=LOAD_POD)
    kubectl("wait", "--for=condition=Ready", "pod/load", "--timeout=120s")
    tidectl("namespace", "create", "load")
    loads = []
    loads.append(scale(5, "scale 3->5"))
    loads.append(scale(3, "scale 5->3", watch_quorum=True))
    upgrade("upgrade")
    loads.append("upgrade")
    force_delete_node("force-delete")
    loads.append("force-delete")
    kill_leader_coordinator("coordinator kill")
    loads.append("coordinator kill")
    etcd_lost("etcd lost")
    loads.append("etcd lost")
    etcd_lost_coordinators_restarted("etcd lost, coordinators restarted")
    loads.append("etcd lost, coordinators restarted")
    for name in loads:
        verify(name)
    uninstall()


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "smoke"
    report = Path(sys.argv[sys.argv.index("--report") + 1]) if "--report" in sys.argv else ROOT / "target" / f"k8s-{mode}.md"
    started = time.time()
    ok = False
    try:
        {"smoke": smoke, "full": full}[mode]()
        ok = True
    finally:
        figure("total", f"{time.time() - started:.0f} s, {'passed' if ok else 'FAILED'}")
        report.parent.mkdir(parents=True, exist_ok=True)
        with open(report, "w") as f:
            f.write(f"# k8s_test.py {mode} ({time.strftime('%Y-%m-%d %H:%M')})\n\n| what | figure |\n|---|---|\n")
            for name, value in REPORT:
                f.write(f"| {name} | {value} |\n")
        log(f"report: {report}")
        if not ok:
            subprocess.run(["kubectl", "-n", NS, "get", "pods", "-o", "wide"], check=False)


if __name__ == "__main__":
    main()
