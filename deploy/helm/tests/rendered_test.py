#!/usr/bin/env python3
"""Assertions on the chart's rendered manifests (what kubeconform-style schema
checks cannot see): wiring between the components, probes, drain, security.

Usage: rendered_test.py DIR, where DIR holds default.yaml (values.yaml, GPU,
vLLM workers), cpu.yaml (values-cpu.yaml), external.yaml (ci/external-values.yaml),
features.yaml (ci/features-values.yaml), vllm.yaml (ci/vllm-values.yaml) and
native.yaml (ci/native-values.yaml), each the output of
`helm template inferscale deploy/helm/inferscale -n inferscale` with those
values (scripts/check_deploy.sh makes them). Needs PyYAML.

The custom resources the chart renders (ServiceMonitor, ScaledObject,
cert-manager's Certificate and Issuer) have no schema that kubernetes-validate
can check offline; scripts/check_deploy.sh sets them aside before it runs, and
their structure and wiring are checked here (CUSTOM_RESOURCES).
"""

from __future__ import annotations

import json
import os
import re
import sys
import unittest
from pathlib import Path

import yaml

DIR = Path(os.environ.get("RENDERED_DIR", sys.argv[1] if len(sys.argv) > 1 else "."))
CHART = Path(__file__).resolve().parents[1] / "inferscale"
RELEASE = "inferscale"
NS = "inferscale"
DOMAIN = "cluster.local"

# Custom resources: kind -> apiVersion. Everything else must be a built-in
# kind, which kubernetes-validate checks against its schema.
CUSTOM_RESOURCES = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "Certificate": "cert-manager.io/v1",
    "Issuer": "cert-manager.io/v1",
}
BUILTIN_KINDS = {
    "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Ingress", "NetworkPolicy", "PodDisruptionBudget",
    "Secret", "Service", "ServiceAccount", "StatefulSet",
}
TLS_ROOT = "/etc/inferscale/tls/"
# Variables the binary refuses since the listen addresses were split.
RETIRED_ENV = {"INFERSCALE_LISTEN", "INFERSCALE_HTTP_LISTEN"}


def load(name: str) -> list[dict]:
    with (DIR / name).open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def find(docs, kind, name=None):
    out = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return out


def one(docs, kind, name):
    found = find(docs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def env_of(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def containers(docs, init=True):
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec.get("containers", []) + (spec.get("initContainers", []) if init else []):
                yield d, spec, c


def pod(docs, kind, name):
    return one(docs, kind, name)["spec"]["template"]["spec"]


def mounts_of(container) -> dict:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def volumes_of(pod_spec) -> dict:
    return {v["name"]: v for v in pod_spec.get("volumes", [])}


def wildcard_covers(pattern: str, host: str) -> bool:
    """A DNS SAN (possibly *.x) names host, as TLS clients match it."""
    if pattern.startswith("*."):
        first, _, rest = host.partition(".")
        return bool(first) and rest == pattern[2:]
    return pattern == host


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class Rendered(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.default = load("default.yaml")
        cls.cpu = load("cpu.yaml")
        cls.external = load("external.yaml")
        cls.features = load("features.yaml")
        cls.vllm = load("vllm.yaml")
        cls.native = load("native.yaml")
        cls.all = {
            "default": cls.default, "cpu": cls.cpu, "external": cls.external, "features": cls.features,
            "vllm": cls.vllm, "native": cls.native,
        }

    def test_every_object_is_namespaced_and_labelled(self):
        for variant, docs in self.all.items():
            for d in docs:
                with self.subTest(variant=variant, obj=f"{d['kind']}/{d['metadata']['name']}"):
                    self.assertEqual(d["metadata"].get("namespace"), NS)
                    labels = d["metadata"]["labels"]
                    self.assertEqual(labels["app.kubernetes.io/instance"], RELEASE)
                    self.assertEqual(labels["app.kubernetes.io/managed-by"], "Helm")

    def test_security_context_everywhere(self):
        for variant, docs in self.all.items():
            for d, spec, c in containers(docs):
                with self.subTest(variant=variant, container=f"{d['metadata']['name']}/{c['name']}"):
                    psc, csc = spec["securityContext"], c["securityContext"]
                    self.assertTrue(psc["runAsNonRoot"])
                    self.assertGreaterEqual(psc["runAsUser"], 10000)
                    self.assertEqual(psc["seccompProfile"]["type"], "RuntimeDefault")
                    self.assertFalse(csc["allowPrivilegeEscalation"])
                    self.assertTrue(csc["readOnlyRootFilesystem"])
                    self.assertEqual(csc["capabilities"]["drop"], ["ALL"])
                    self.assertFalse(spec["automountServiceAccountToken"])
                    self.assertIn("limits", c["resources"])
                    self.assertIn("requests", c["resources"])
            # Probes: the long-running containers (init containers have none).
            for d, spec, c in containers(docs, init=False):
                with self.subTest(variant=variant, container=f"{d['metadata']['name']}/{c['name']}"):
                    self.assertIn("readinessProbe", c)
                    self.assertIn("livenessProbe", c)

    def test_router(self):
        dep = one(self.default, "Deployment", f"{RELEASE}-router")
        self.assertNotIn("replicas", dep["spec"], "the HPA owns the replica count")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        env = env_of(c)
        self.assertEqual(c["args"][0], "router")
        self.assertEqual(env["INFERSCALE_API_LISTEN"], "0.0.0.0:8080")
        self.assertEqual(env["INFERSCALE_ETCD"], f"{RELEASE}-etcd.{NS}.svc.cluster.local:2379")
        self.assertTrue(env["INFERSCALE_API_KEYS_FILE"].startswith("/etc/inferscale/api-keys/"))
        self.assertEqual(c["readinessProbe"]["httpGet"]["path"], "/readyz")
        self.assertEqual(c["livenessProbe"]["httpGet"]["path"], "/healthz")
        hpa = one(self.default, "HorizontalPodAutoscaler", f"{RELEASE}-router")
        self.assertEqual(hpa["apiVersion"], "autoscaling/v2")
        self.assertEqual(hpa["spec"]["scaleTargetRef"]["name"], dep["metadata"]["name"])
        svc = one(self.default, "Service", f"{RELEASE}-router")
        self.assertEqual(svc["spec"]["ports"][0]["targetPort"], "http")
        # The dev values pin a replica count and drop the HPA.
        self.assertEqual(one(self.cpu, "Deployment", f"{RELEASE}-router")["spec"]["replicas"], 1)
        self.assertEqual(find(self.cpu, "HorizontalPodAutoscaler"), [])
        ext = one(self.external, "Service", f"{RELEASE}-router")
        self.assertEqual(ext["spec"]["type"], "LoadBalancer")
        self.assertEqual(ext["spec"]["loadBalancerSourceRanges"], ["10.0.0.0/8"])

    def test_api_keys(self):
        secret = one(self.default, "Secret", f"{RELEASE}-api-keys")
        import base64

        lines = base64.b64decode(secret["data"]["keys.txt"]).decode().split()
        self.assertEqual(len(lines), 1)
        self.assertRegex(lines[0], r"^default:sk-[A-Za-z0-9]{40}$")
        # An existing Secret: none rendered, the router mounts that one.
        self.assertEqual(find(self.external, "Secret"), [])
        vols = one(self.external, "Deployment", f"{RELEASE}-router")["spec"]["template"]["spec"]["volumes"]
        self.assertIn("inferscale-api-keys", [v.get("secret", {}).get("secretName") for v in vols])

    def test_worker(self):
        # Our engine on the GPU: its own HTTP port for probes and metrics.
        sts = one(self.native, "StatefulSet", f"{RELEASE}-worker")
        spec = sts["spec"]
        headless = one(self.native, "Service", spec["serviceName"])
        self.assertEqual(headless["spec"]["clusterIP"], "None")
        self.assertTrue(headless["spec"]["publishNotReadyAddresses"])
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        env = env_of(c)
        self.assertEqual(c["args"][0], "worker")
        self.assertEqual(env["INFERSCALE_BACKEND"], "cuda")
        self.assertEqual(env["INFERSCALE_NAME"], "$(POD_NAME)")
        self.assertEqual(env["INFERSCALE_GRPC_LISTEN"], "0.0.0.0:50051")
        self.assertEqual(env["INFERSCALE_ADVERTISE"], f"$(POD_NAME).{spec['serviceName']}.{NS}.svc.cluster.local:50051")
        self.assertEqual(env["INFERSCALE_WORKER_HTTP_LISTEN"], "0.0.0.0:9090")
        self.assertEqual(env["INFERSCALE_MEMORY"], "/data/memory")
        self.assertEqual(env["INFERSCALE_HOME"], "/data/cache")
        # The node name tells workers which GPUs share a host (NCCL moves);
        # the host's IPC namespace only when asked for.
        node = [e for e in c["env"] if e["name"] == "NODE_NAME"]
        self.assertEqual(node, [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}])
        self.assertNotIn("hostIPC", pod)
        self.assertEqual(c["readinessProbe"]["httpGet"], {"path": "/readyz", "port": "http"})
        self.assertEqual(c["livenessProbe"]["httpGet"], {"path": "/healthz", "port": "http"})
        self.assertIn({"name": "http", "containerPort": 9090, "protocol": "TCP"}, c["ports"])
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertEqual(pod["nodeSelector"], {"nvidia.com/gpu.present": "true"})
        # Graceful drain, within the grace period.
        hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        self.assertIn('inferscale cluster drain "$POD_NAME"', hook)
        wait = int(hook.split("--wait-s")[1].split()[0])
        self.assertLess(wait, pod["terminationGracePeriodSeconds"])
        # The shard store is a PVC mounted at /data.
        claim = spec["volumeClaimTemplates"][0]
        self.assertEqual(claim["metadata"]["name"], "data")
        self.assertIn({"name": "data", "mountPath": "/data"}, c["volumeMounts"])
        pdb = one(self.native, "PodDisruptionBudget", f"{RELEASE}-worker")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], spec["selector"]["matchLabels"])
        self.assertEqual(env["INFERSCALE_ENGINE"], "native")
        self.assertNotIn("initContainers", pod)

    def test_vllm_is_the_gpu_default(self):
        # The peer benchmark's winner at 100 users (docs/deploy.md, "Engines").
        sts = one(self.default, "StatefulSet", f"{RELEASE}-worker")
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = env_of(c)
        self.assertEqual(env["INFERSCALE_ENGINE"], "vllm")
        self.assertEqual(env["INFERSCALE_BACKEND"], "cuda")
        self.assertTrue(c["image"].startswith("inferscale-worker-vllm:"), c["image"])
        args = c["args"]
        self.assertIn("--vllm-arg=--gpu-memory-utilization=0.8", args)
        self.assertFalse([a for a in args if a.startswith("--vllm-arg=--max-model-len")], args)
        self.assertIn("export-hf", [i["name"] for i in pod["initContainers"]])
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertEqual(pod["nodeSelector"], {"nvidia.com/gpu.present": "true"})
        # Drain and the shard volume as with our engine.
        hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        self.assertIn('inferscale cluster drain "$POD_NAME"', hook)
        self.assertIn({"name": "data", "mountPath": "/data"}, c["volumeMounts"])
        # The CPU values run our engine (vLLM needs CUDA).
        cpu = one(self.cpu, "StatefulSet", f"{RELEASE}-worker")["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(env_of(cpu)["INFERSCALE_ENGINE"], "native")

    def test_vllm_worker(self):
        sts = one(self.vllm, "StatefulSet", f"{RELEASE}-worker")
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = env_of(c)
        self.assertTrue(c["image"].startswith("inferscale-worker-vllm:0.1.0"), c["image"])
        self.assertEqual(env["INFERSCALE_ENGINE"], "vllm")
        self.assertEqual(env["INFERSCALE_BACKEND"], "cuda")
        # The binary refuses --http-listen with vLLM: neither the variable nor the port.
        self.assertNotIn("INFERSCALE_WORKER_HTTP_LISTEN", env)
        self.assertEqual([p["name"] for p in c["ports"]], ["grpc"])
        self.assertNotIn("prometheus.io/scrape", sts["spec"]["template"]["metadata"].get("annotations", {}))
        headless = one(self.vllm, "Service", sts["spec"]["serviceName"])
        self.assertEqual([p["name"] for p in headless["spec"]["ports"]], ["grpc"])
        self.assertFalse([m for m in find(self.vllm, "ServiceMonitor") if m["metadata"]["name"].endswith("-worker")])
        # vLLM's arguments, and the HF directory it loads.
        args = c["args"]
        self.assertEqual(args[0], "worker")
        hf = args[args.index("--vllm-model") + 1]
        self.assertIn("--vllm-arg=--gpu-memory-utilization=0.85", args)
        self.assertIn("--vllm-arg=--max-model-len=8192", args)
        self.assertIn("--vllm-arg=--enable-prefix-caching", args)
        self.assertEqual(args[args.index("--vllm-start-timeout-s") + 1], "900")
        # worker.model exported there first, into the shard volume, once.
        init = {i["name"]: i for i in pod["initContainers"]}
        export = init["export-hf"]
        self.assertEqual(export["image"], c["image"])
        self.assertEqual(env_of(export)["HF_DIR"], hf)
        self.assertTrue(hf.startswith("/data/hf/"), hf)
        self.assertEqual(env_of(export)["INFERSCALE_MODEL"], env["INFERSCALE_MODEL"])
        self.assertIn('test -f "$HF_DIR/config.json" ||', export["command"][-1])
        self.assertIn({"name": "data", "mountPath": "/data"}, export["volumeMounts"])
        self.assertNotIn("nvidia.com/gpu", export["resources"].get("limits", {}))
        # Probes without an HTTP port of ours: the gRPC port, vLLM's /health.
        for probe in ("startupProbe", "livenessProbe"):
            self.assertEqual(c[probe]["tcpSocket"], {"port": "grpc"})
        self.assertIn("127.0.0.1:8000/health", " ".join(c["readinessProbe"]["exec"]["command"]))
        # vLLM needs shared memory and room for its compile caches.
        self.assertIn({"name": "shm", "mountPath": "/dev/shm"}, c["volumeMounts"])
        tmp = volumes_of(pod)["tmp"]
        self.assertEqual(tmp["emptyDir"]["sizeLimit"], "16Gi")
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)

    def test_cpu_worker_has_no_gpu(self):
        sts = one(self.cpu, "StatefulSet", f"{RELEASE}-worker")
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        self.assertEqual(env_of(c)["INFERSCALE_BACKEND"], "cpu")
        self.assertEqual(env_of(c)["INFERSCALE_MODEL"], "smollm2")
        self.assertNotIn("nvidia.com/gpu", c["resources"]["limits"])
        self.assertNotIn("nodeSelector", pod)
        self.assertNotIn("tolerations", pod)

    def test_etcd_cluster(self):
        for variant, members in (("default", 3), ("cpu", 1)):
            with self.subTest(variant=variant):
                docs = self.all[variant]
                sts = one(docs, "StatefulSet", f"{RELEASE}-etcd")
                self.assertEqual(sts["spec"]["replicas"], members)
                self.assertEqual(sts["spec"]["podManagementPolicy"], "Parallel")
                args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
                initial = next(a for a in args if a.startswith("--initial-cluster="))[len("--initial-cluster="):]
                peers = initial.split(",")
                self.assertEqual(len(peers), members)
                # Peers speak TLS in production, plain HTTP on the dev values.
                scheme = "https" if variant == "default" else "http"
                for i, peer in enumerate(peers):
                    self.assertEqual(
                        peer,
                        f"{RELEASE}-etcd-{i}={scheme}://{RELEASE}-etcd-{i}.{RELEASE}-etcd-headless.{NS}.svc.cluster.local:2380",
                    )
                self.assertIn("--name=$(POD_NAME)", args)
                self.assertTrue(one(docs, "Service", f"{RELEASE}-etcd-headless")["spec"]["publishNotReadyAddresses"])
                self.assertEqual(sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"], "data")
        # External etcd: none rendered, both processes use the given endpoints.
        self.assertEqual(find(self.external, "StatefulSet", f"{RELEASE}-etcd"), [])
        router = one(self.external, "Deployment", f"{RELEASE}-router")["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(env_of(router)["INFERSCALE_ETCD"].count(","), 2)

    def test_network_policies(self):
        pols = {p["metadata"]["name"]: p for p in find(self.default, "NetworkPolicy")}
        self.assertEqual(set(pols), {f"{RELEASE}-{c}" for c in ("router", "worker", "etcd", "jaeger")})

        def component(peer):
            return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")

        def sources(policy, port):
            for rule in policy["spec"]["ingress"]:
                if any(p["port"] == port for p in rule["ports"]):
                    return {component(p) for p in rule.get("from", [])} or {"anyone"}
            return set()

        self.assertEqual(sources(pols[f"{RELEASE}-router"], "http"), {"anyone"})
        self.assertEqual(sources(pols[f"{RELEASE}-worker"], "grpc"), {"router", "worker"})
        self.assertEqual(sources(pols[f"{RELEASE}-etcd"], "client"), {"router", "worker", "etcd"})
        self.assertEqual(sources(pols[f"{RELEASE}-etcd"], "peer"), {"etcd"})
        self.assertEqual(sources(pols[f"{RELEASE}-jaeger"], "otlp-grpc"), {"router", "worker"})
        # Our engine's metrics port, admitted where it exists.
        native = {p["metadata"]["name"]: p for p in find(self.native, "NetworkPolicy")}
        self.assertEqual(sources(native[f"{RELEASE}-worker"], "http"), {"anyone"})
        self.assertEqual(sources(pols[f"{RELEASE}-worker"], "http"), set())
        # Every named port a policy admits exists on the pods it selects,
        # with either engine.
        for variant in ("default", "native", "vllm", "features", "external"):
            docs = self.all[variant]
            for p in find(docs, "NetworkPolicy"):
                workload = next(
                    d for d in docs
                    if d["kind"] in ("Deployment", "StatefulSet")
                    and d["spec"]["selector"]["matchLabels"] == p["spec"]["podSelector"]["matchLabels"]
                )
                names = {port["name"] for c in workload["spec"]["template"]["spec"]["containers"] for port in c["ports"]}
                for rule in p["spec"]["ingress"]:
                    for port in rule["ports"]:
                        with self.subTest(variant=variant, policy=p["metadata"]["name"]):
                            self.assertIn(port["port"], names)

    def test_tracing(self):
        jaeger_svc = one(self.default, "Service", f"{RELEASE}-jaeger")
        self.assertIn(4317, [p["port"] for p in jaeger_svc["spec"]["ports"]])
        for kind, name in (("Deployment", f"{RELEASE}-router"), ("StatefulSet", f"{RELEASE}-worker")):
            c = one(self.default, kind, name)["spec"]["template"]["spec"]["containers"][0]
            env = env_of(c)
            self.assertEqual(env["OTEL_EXPORTER_OTLP_ENDPOINT"], f"http://{RELEASE}-jaeger.{NS}.svc.cluster.local:4317")
            self.assertEqual(env["OTEL_EXPORTER_OTLP_PROTOCOL"], "grpc")
            self.assertTrue(env["OTEL_SERVICE_NAME"].startswith("inferscale-"))
            c = one(self.external, kind, name)["spec"]["template"]["spec"]["containers"][0]
            env = env_of(c)
            self.assertEqual(env["OTEL_EXPORTER_OTLP_ENDPOINT"], "http://otel-collector.observability.svc.cluster.local:4318")
            self.assertEqual(env["OTEL_EXPORTER_OTLP_PROTOCOL"], "http/protobuf")
        self.assertEqual(find(self.external, "Deployment", f"{RELEASE}-jaeger"), [])
        config = yaml.safe_load(one(self.default, "ConfigMap", f"{RELEASE}-jaeger")["data"]["config.yaml"])
        self.assertEqual(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"], "0.0.0.0:4317")

    def test_air_gapped_models(self):
        pod = one(self.external, "StatefulSet", f"{RELEASE}-worker")["spec"]["template"]["spec"]
        c = pod["containers"][0]
        self.assertIn({"name": "models", "mountPath": "/models", "readOnly": True}, c["volumeMounts"])
        # models.source=volume: the PVC, read-only, is the worker's INFERSCALE_HOME.
        self.assertEqual(volumes_of(pod)["models"]["persistentVolumeClaim"], {"claimName": "inferscale-models", "readOnly": True})
        self.assertEqual(env_of(c)["INFERSCALE_HOME"], "/models")
        # Nothing fetched: the one init container (vLLM, the default engine)
        # exports the volume's model as an HF directory into the shard volume.
        (export,) = pod["initContainers"]
        self.assertEqual(export["name"], "export-hf")
        self.assertEqual(env_of(export)["INFERSCALE_MODEL"], "/models/Llama-3.1-8B-Instruct")
        self.assertIn({"name": "models", "mountPath": "/models", "readOnly": True}, export["volumeMounts"])
        self.assertEqual(env_of(c)["INFERSCALE_MODEL"], "/models/Llama-3.1-8B-Instruct")
        self.assertEqual(c["args"][1:3], ["--embedder", "/models/all-minilm-l6-v2"])
        self.assertTrue(c["image"].startswith("registry.example.com/inferscale/inferscale-worker-vllm:"))
        self.assertEqual(pod["imagePullSecrets"], [{"name": "regcred"}])

    # ------------------------------------------------------------ TLS

    def tls_files_are_mounted(self, docs, variant):
        """Every TLS or etcd-auth path in an environment is a file of a Secret
        mounted read-only at its directory, and each TLS Secret has the three
        keys of cert-manager's layout."""
        for d, spec, c in containers(docs):
            vols = volumes_of(spec)
            for name, value in env_of(c).items():
                if not (isinstance(value, str) and value.startswith(("/etc/inferscale/tls/", "/etc/inferscale/etcd-auth/"))):
                    continue
                with self.subTest(variant=variant, container=f"{d['metadata']['name']}/{c['name']}", env=name):
                    directory, _, file = value.rpartition("/")
                    mount = mounts_of(c).get(directory)
                    self.assertIsNotNone(mount, f"{directory} is not mounted")
                    self.assertTrue(mount.get("readOnly"))
                    secret = vols[mount["name"]]["secret"]
                    self.assertIn(file, [i["path"] for i in secret["items"]])
                    if directory.startswith(TLS_ROOT):
                        self.assertEqual(sorted(i["key"] for i in secret["items"]), ["ca.crt", "tls.crt", "tls.key"])

    def tls_env(self, container, role_dir):
        env = env_of(container)
        return {k: env.get(k) for k in ("INFERSCALE_TLS_CERT", "INFERSCALE_TLS_KEY", "INFERSCALE_TLS_CA")}, {
            "INFERSCALE_TLS_CERT": f"{TLS_ROOT}{role_dir}/tls.crt",
            "INFERSCALE_TLS_KEY": f"{TLS_ROOT}{role_dir}/tls.key",
            "INFERSCALE_TLS_CA": f"{TLS_ROOT}{role_dir}/ca.crt",
        }

    def etcd_tls_env(self, container):
        env = env_of(container)
        return {k: env.get(k) for k in ("INFERSCALE_ETCD_CA", "INFERSCALE_ETCD_CERT", "INFERSCALE_ETCD_KEY")}

    ETCD_CLIENT_ENV = {
        "INFERSCALE_ETCD_CA": f"{TLS_ROOT}etcd-client/ca.crt",
        "INFERSCALE_ETCD_CERT": f"{TLS_ROOT}etcd-client/tls.crt",
        "INFERSCALE_ETCD_KEY": f"{TLS_ROOT}etcd-client/tls.key",
    }

    def secret_of(self, pod_spec, container, directory):
        return volumes_of(pod_spec)[mounts_of(container)[directory]["name"]]["secret"]["secretName"]

    def test_tls_everywhere_by_default(self):
        docs = self.default
        router_pod = pod(docs, "Deployment", f"{RELEASE}-router")
        worker_pod = pod(docs, "StatefulSet", f"{RELEASE}-worker")
        router, worker = router_pod["containers"][0], worker_pod["containers"][0]
        # Each process that talks to workers has its own identity and the CA,
        # and its etcd client certificate.
        got, want = self.tls_env(router, "router")
        self.assertEqual(got, want)
        got, want = self.tls_env(worker, "worker")
        self.assertEqual(got, want)
        for c in (router, worker):
            self.assertEqual(self.etcd_tls_env(c), self.ETCD_CLIENT_ENV)
            self.assertNotIn("INFERSCALE_INSECURE_PLAINTEXT", env_of(c))
        self.tls_files_are_mounted(docs, "default")
        self.tls_files_are_mounted(self.features, "features")
        # The Secrets are the cert-manager Certificates', one per role.
        certs = {c["spec"]["secretName"]: c for c in find(docs, "Certificate")}
        self.assertEqual(self.secret_of(router_pod, router, f"{TLS_ROOT}router"), f"{RELEASE}-router-tls")
        self.assertEqual(self.secret_of(worker_pod, worker, f"{TLS_ROOT}worker"), f"{RELEASE}-worker-tls")
        for p, c in ((router_pod, router), (worker_pod, worker)):
            self.assertEqual(self.secret_of(p, c, f"{TLS_ROOT}etcd-client"), f"{RELEASE}-etcd-client-tls")
        for name in ("worker", "router", "etcd-server", "etcd-client"):
            self.assertIn(f"{RELEASE}-{name}-tls", certs)

        # The worker certificate names the address each worker advertises,
        # and serves as server and client certificate.
        wcert = certs[f"{RELEASE}-worker-tls"]["spec"]
        advertised = env_of(worker)["INFERSCALE_ADVERTISE"].rsplit(":", 1)[0]
        for ordinal in range(4):
            host = advertised.replace("$(POD_NAME)", f"{RELEASE}-worker-{ordinal}")
            self.assertTrue(any(wildcard_covers(n, host) for n in wcert["dnsNames"]), host)
        self.assertLessEqual({"server auth", "client auth"}, set(wcert["usages"]))
        self.assertIn("client auth", certs[f"{RELEASE}-router-tls"]["spec"]["usages"])
        self.assertIn("client auth", certs[f"{RELEASE}-etcd-client-tls"]["spec"]["usages"])
        for c in certs.values():
            if not c["spec"].get("isCA"):  # the keys the processes read
                self.assertEqual(c["spec"]["privateKey"]["encoding"], "PKCS8")

        # etcd serves clients and peers over TLS with client certificates
        # required; its certificate names the client Service and every member.
        sts = one(docs, "StatefulSet", f"{RELEASE}-etcd")
        etcd_pod = sts["spec"]["template"]["spec"]
        etcd = etcd_pod["containers"][0]
        args = dict(a[2:].split("=", 1) for a in etcd["args"])
        for flag in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
            self.assertTrue(args[flag].startswith("https://"), flag)
        server_dir = f"{TLS_ROOT}etcd-server"
        self.assertEqual(args["client-cert-auth"], "true")
        self.assertEqual(args["peer-client-cert-auth"], "true")
        for flag, file in (("cert-file", "tls.crt"), ("key-file", "tls.key"), ("trusted-ca-file", "ca.crt"),
                           ("peer-cert-file", "tls.crt"), ("peer-key-file", "tls.key"), ("peer-trusted-ca-file", "ca.crt")):
            self.assertEqual(args[flag], f"{server_dir}/{file}")
        self.assertTrue(mounts_of(etcd)[server_dir]["readOnly"])
        self.assertEqual(self.secret_of(etcd_pod, etcd, server_dir), f"{RELEASE}-etcd-server-tls")
        ecert = certs[f"{RELEASE}-etcd-server-tls"]["spec"]
        self.assertLessEqual({"server auth", "client auth"}, set(ecert["usages"]))
        client_host = env_of(router)["INFERSCALE_ETCD"].rsplit(":", 1)[0]
        hosts = [client_host] + [
            args["advertise-client-urls"].split("://")[1].rsplit(":", 1)[0].replace("$(POD_NAME)", f"{RELEASE}-etcd-{i}")
            for i in range(sts["spec"]["replicas"])
        ]
        for host in hosts:
            self.assertTrue(any(wildcard_covers(n, host) for n in ecert["dnsNames"]), host)
        # Probes and metrics stay on the plain-HTTP metrics port (the kubelet
        # has no client certificate).
        self.assertEqual(args["listen-metrics-urls"], "http://0.0.0.0:2381")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            self.assertEqual(etcd[probe]["httpGet"]["port"], "metrics")

    def test_own_ca_or_given_issuer(self):
        # Default: a private CA of the release (self-signed Issuer -> CA
        # Certificate -> CA Issuer) signs the rest.
        issuers = {i["metadata"]["name"]: i["spec"] for i in find(self.default, "Issuer")}
        self.assertEqual(issuers[f"{RELEASE}-selfsigned"], {"selfSigned": {}})
        self.assertEqual(issuers[f"{RELEASE}-ca"], {"ca": {"secretName": f"{RELEASE}-ca"}})
        ca = one(self.default, "Certificate", f"{RELEASE}-ca")["spec"]
        self.assertTrue(ca["isCA"])
        self.assertEqual(ca["issuerRef"]["name"], f"{RELEASE}-selfsigned")
        self.assertEqual(ca["privateKey"]["rotationPolicy"], "Never")
        for c in find(self.default, "Certificate"):
            if c["metadata"]["name"] != f"{RELEASE}-ca":
                self.assertEqual(c["spec"]["issuerRef"], {"name": f"{RELEASE}-ca", "kind": "Issuer", "group": "cert-manager.io"})
        # A ClusterIssuer of the cluster: no CA of our own.
        self.assertEqual(find(self.features, "Issuer"), [])
        certs = find(self.features, "Certificate")
        self.assertEqual(len(certs), 4)
        for c in certs:
            self.assertEqual(c["spec"]["issuerRef"], {"name": "platform-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})

    def test_tls_from_existing_secrets(self):
        docs = self.external
        self.assertEqual(find(docs, "Certificate") + find(docs, "Issuer"), [])
        router_pod = pod(docs, "Deployment", f"{RELEASE}-router")
        worker_pod = pod(docs, "StatefulSet", f"{RELEASE}-worker")
        router, worker = router_pod["containers"][0], worker_pod["containers"][0]
        self.assertEqual(self.secret_of(router_pod, router, f"{TLS_ROOT}router"), "inferscale-router-tls")
        self.assertEqual(self.secret_of(worker_pod, worker, f"{TLS_ROOT}worker"), "inferscale-worker-tls")
        for p, c in ((router_pod, router), (worker_pod, worker)):
            self.assertEqual(self.etcd_tls_env(c), self.ETCD_CLIENT_ENV)
            self.assertEqual(self.secret_of(p, c, f"{TLS_ROOT}etcd-client"), "platform-etcd-client-tls")
            # Password authentication to the external etcd, from a file.
            env = env_of(c)
            self.assertEqual(env["INFERSCALE_ETCD_USER"], "inferscale")
            self.assertEqual(env["INFERSCALE_ETCD_PASSWORD_FILE"], "/etc/inferscale/etcd-auth/password")
            self.assertEqual(self.secret_of(p, c, "/etc/inferscale/etcd-auth"), "inferscale-etcd-auth")
        self.tls_files_are_mounted(docs, "external")

    def test_plaintext_dev_values(self):
        docs = self.cpu
        for _, spec, c in containers(docs):
            env = env_of(c)
            self.assertFalse([k for k in env if k.startswith(("INFERSCALE_TLS_", "INFERSCALE_ETCD_C", "INFERSCALE_ETCD_K"))])
            self.assertFalse([m for m in c.get("volumeMounts", []) if m["mountPath"].startswith(TLS_ROOT)])
        worker = pod(docs, "StatefulSet", f"{RELEASE}-worker")["containers"][0]
        # The acknowledged plaintext (tls.insecurePlaintext) reaches the worker.
        self.assertEqual(env_of(worker)["INFERSCALE_INSECURE_PLAINTEXT"], "true")
        etcd = pod(docs, "StatefulSet", f"{RELEASE}-etcd")["containers"][0]
        self.assertIn("--listen-client-urls=http://0.0.0.0:2379", etcd["args"])
        self.assertFalse([a for a in etcd["args"] if "cert-auth" in a or "cert-file" in a])
        self.assertEqual(find(docs, "Certificate") + find(docs, "Issuer"), [])

    def test_no_retired_variables(self):
        for variant, docs in self.all.items():
            for d, _, c in containers(docs):
                with self.subTest(variant=variant, container=f"{d['metadata']['name']}/{c['name']}"):
                    self.assertFalse(RETIRED_ENV & set(env_of(c)))

    # ------------------------------------------------------------ optional features

    def test_custom_resources_are_known(self):
        for variant, docs in self.all.items():
            for d in docs:
                with self.subTest(variant=variant, obj=f"{d['kind']}/{d['metadata']['name']}"):
                    if d["kind"] in CUSTOM_RESOURCES:
                        self.assertEqual(d["apiVersion"], CUSTOM_RESOURCES[d["kind"]])
                    else:
                        self.assertIn(d["kind"], BUILTIN_KINDS)
        # The optional custom resources are off by default.
        for kind in ("ServiceMonitor", "ScaledObject"):
            self.assertEqual(find(self.default, kind), [])

    def test_service_monitors(self):
        sms = {m["metadata"]["name"]: m for m in find(self.features, "ServiceMonitor")}
        self.assertEqual(set(sms), {f"{RELEASE}-{c}" for c in ("router", "worker", "etcd", "dcgm-exporter")})
        services = find(self.features, "Service")
        for component, port, container_port in (("router", "http", 8080), ("worker", "http", 9090), ("etcd", "metrics", 2381)):
            with self.subTest(component=component):
                sm = sms[f"{RELEASE}-{component}"]["spec"]
                self.assertEqual(sms[f"{RELEASE}-{component}"]["metadata"]["labels"]["release"], "kube-prometheus-stack")
                self.assertEqual(sm["namespaceSelector"], {"matchNames": [NS]})
                (ep,) = sm["endpoints"]
                self.assertEqual((ep["port"], ep["path"], ep["scheme"]), (port, "/metrics", "http"))
                # Some Service it selects has that port, pointing at the pods' port.
                selected = [s for s in services if labels_match(sm["selector"]["matchLabels"], s["metadata"]["labels"])]
                with_port = [s for s in selected if any(p["name"] == port for p in s["spec"]["ports"])]
                self.assertTrue(with_port)
                for s in selected:
                    self.assertEqual(s["metadata"]["labels"]["app.kubernetes.io/component"], component)
                workload = next(
                    d for d in self.features if d["kind"] in ("Deployment", "StatefulSet")
                    and labels_match(with_port[0]["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
                )
                target = next(p["targetPort"] for p in with_port[0]["spec"]["ports"] if p["name"] == port)
                ports = {p["name"]: p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
                self.assertEqual(ports[target], container_port)
        dcgm = sms[f"{RELEASE}-dcgm-exporter"]["spec"]
        self.assertEqual(dcgm["namespaceSelector"], {"matchNames": ["gpu-monitoring"]})
        self.assertEqual(dcgm["selector"]["matchLabels"], {"app.kubernetes.io/name": "dcgm-exporter"})
        self.assertEqual(dcgm["endpoints"][0]["port"], "metrics")

    def test_ingress(self):
        self.assertEqual(find(self.default, "Ingress"), [])
        ing = one(self.features, "Ingress", f"{RELEASE}-router")["spec"]
        self.assertEqual(ing["ingressClassName"], "nginx")
        self.assertEqual(ing["tls"], [{"secretName": "inferscale-api-tls", "hosts": ["api.example.com"]}])
        (rule,) = ing["rules"]
        self.assertEqual(rule["host"], "api.example.com")
        (path,) = rule["http"]["paths"]
        self.assertEqual((path["path"], path["pathType"]), ("/v1", "Prefix"))
        backend = path["backend"]["service"]
        svc = one(self.features, "Service", backend["name"])
        self.assertIn(backend["port"]["name"], [p["name"] for p in svc["spec"]["ports"]])

    def test_worker_scaling_on_the_queue(self):
        self.assertIn("replicas", one(self.default, "StatefulSet", f"{RELEASE}-worker")["spec"])
        so = one(self.features, "ScaledObject", f"{RELEASE}-worker")["spec"]
        sts = one(self.features, "StatefulSet", f"{RELEASE}-worker")
        self.assertNotIn("replicas", sts["spec"], "KEDA owns the replica count")
        self.assertEqual(so["scaleTargetRef"], {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"]})
        self.assertEqual((so["minReplicaCount"], so["maxReplicaCount"]), (2, 16))
        (trigger,) = so["triggers"]
        self.assertEqual((trigger["type"], trigger["metricType"]), ("prometheus", "AverageValue"))
        meta = trigger["metadata"]
        self.assertEqual(meta["serverAddress"], "http://kube-prometheus-stack-prometheus.monitoring.svc:9090")
        self.assertEqual(meta["threshold"], "4")
        query = meta["query"]
        self.assertRegex(query, r"^sum\(inferscale_worker_requests_waiting\{")
        self.assertIn(f'namespace="{NS}"', query)
        pod_re = re.search(r'pod=~"([^"]+)"', query).group(1)
        self.assertRegex(f"{RELEASE}-worker-0", f"^{pod_re}$")
        self.assertRegex(f"{RELEASE}-worker-12", f"^{pod_re}$")
        self.assertNotRegex(f"{RELEASE}-router-5d9f", f"^{pod_re}$")
        behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        self.assertEqual(behavior["scaleDown"]["policies"], [{"type": "Pods", "value": 1, "periodSeconds": 600}])

    def test_models_from_an_image(self):
        p = pod(self.features, "StatefulSet", f"{RELEASE}-worker")
        (init,) = p["initContainers"]
        self.assertEqual(init["image"], "registry.example.com/inferscale/models:smollm2-minilm-1")
        self.assertEqual(env_of(init)["MODELS_SRC"], "/inferscale-home")
        self.assertIn('"$MODELS_SRC"/. /models-out/', init["command"][-1])
        self.assertEqual(mounts_of(init)["/models-out"]["name"], "models")
        self.assertEqual(volumes_of(p)["models"], {"name": "models", "emptyDir": {"sizeLimit": "8Gi"}})
        c = p["containers"][0]
        self.assertEqual(mounts_of(c)["/models"], {"name": "models", "mountPath": "/models", "readOnly": True})
        self.assertEqual(env_of(c)["INFERSCALE_HOME"], "/models")
        # The default downloads into the shard volume at first start (no
        # models volume, no copy; vLLM's HF export is the only init container).
        for variant in ("default", "native"):
            d = pod(self.all[variant], "StatefulSet", f"{RELEASE}-worker")
            self.assertEqual(env_of(d["containers"][0])["INFERSCALE_HOME"], "/data/cache")
            self.assertNotIn("models", volumes_of(d))
            self.assertEqual([i["name"] for i in d.get("initContainers", [])], ["export-hf"] if variant == "default" else [])

    def test_runtime_and_priority_classes(self):
        expected = {
            ("StatefulSet", "worker"): ("nvidia", "inferscale-gpu"),
            ("Deployment", "router"): (None, "inferscale-serving"),
            ("StatefulSet", "etcd"): (None, "inferscale-serving"),
            ("Deployment", "jaeger"): (None, None),
        }
        for (kind, component), (runtime, priority) in expected.items():
            with self.subTest(component=component):
                p = pod(self.features, kind, f"{RELEASE}-{component}")
                self.assertEqual((p.get("runtimeClassName"), p.get("priorityClassName")), (runtime, priority))
                d = pod(self.default, kind, f"{RELEASE}-{component}")
                self.assertNotIn("runtimeClassName", d)
                self.assertNotIn("priorityClassName", d)

    def test_schema_covers_every_value(self):
        """values.schema.json describes every value of values.yaml and of the
        values files CI renders, so that none escapes its checks."""
        schema = json.loads((CHART / "values.schema.json").read_text())
        self.assertEqual(schema["$schema"], "http://json-schema.org/draft-07/schema#")
        self.assertFalse(schema["additionalProperties"])

        def resolve(node):
            while "$ref" in node:
                node = schema["definitions"][node["$ref"].split("/")[-1]]
            for key in ("allOf",):
                if key in node:
                    merged = {}
                    for part in node[key]:
                        merged.update(resolve(part))
                    node = merged
            return node

        def walk(value, node, path):
            node = resolve(node)
            with self.subTest(value=path or "(root)"):
                self.assertTrue(node, f"{path}: no schema")
                if isinstance(value, dict) and node.get("additionalProperties") is False:
                    for k, v in value.items():
                        self.assertIn(k, node["properties"], f"{path}.{k}: not in the schema")
                        walk(v, node["properties"][k], f"{path}.{k}".lstrip("."))

        for f in ["values.yaml", "values-cpu.yaml", *sorted(p.relative_to(CHART).as_posix() for p in (CHART / "ci").glob("*.yaml"))]:
            walk(yaml.safe_load((CHART / f).read_text()), schema, "")
        # Closed objects throughout, enums where the chart knows the values.
        props = schema["properties"]
        self.assertEqual(resolve(props["worker"]["properties"]["backend"])["enum"], ["cuda", "cpu"])
        self.assertEqual(resolve(props["worker"]["properties"]["models"]["properties"]["source"])["enum"], ["download", "volume", "image"])
        self.assertEqual(resolve(props["worker"]["properties"]["kvCacheMb"])["type"], "integer")


if __name__ == "__main__":
    result = unittest.main(argv=sys.argv[:1], verbosity=2, exit=False).result
    sys.exit(0 if result.wasSuccessful() else 1)
