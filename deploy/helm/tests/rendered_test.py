#!/usr/bin/env python3
"""Assertions on the chart's rendered manifests (what kubeconform-style schema
checks cannot see): wiring between the components, probes, drain, security.

Usage: rendered_test.py DIR, where DIR holds default.yaml (values.yaml, GPU),
cpu.yaml (values-cpu.yaml) and external.yaml (ci/external-values.yaml), each
the output of `helm template inferscale deploy/helm/inferscale -n inferscale`
with those values (scripts/check_deploy.sh makes them). Needs PyYAML.
"""

from __future__ import annotations

import os
import sys
import unittest
from pathlib import Path

import yaml

DIR = Path(os.environ.get("RENDERED_DIR", sys.argv[1] if len(sys.argv) > 1 else "."))
RELEASE = "inferscale"
NS = "inferscale"


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


def containers(docs):
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                yield d, spec, c


class Rendered(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.default = load("default.yaml")
        cls.cpu = load("cpu.yaml")
        cls.external = load("external.yaml")
        cls.all = {"default": cls.default, "cpu": cls.cpu, "external": cls.external}

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
                    self.assertIn("readinessProbe", c)
                    self.assertIn("livenessProbe", c)

    def test_router(self):
        dep = one(self.default, "Deployment", f"{RELEASE}-router")
        self.assertNotIn("replicas", dep["spec"], "the HPA owns the replica count")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        env = env_of(c)
        self.assertEqual(c["args"][0], "router")
        self.assertEqual(env["INFERSCALE_LISTEN"], "0.0.0.0:8080")
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
        sts = one(self.default, "StatefulSet", f"{RELEASE}-worker")
        spec = sts["spec"]
        headless = one(self.default, "Service", spec["serviceName"])
        self.assertEqual(headless["spec"]["clusterIP"], "None")
        self.assertTrue(headless["spec"]["publishNotReadyAddresses"])
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        env = env_of(c)
        self.assertEqual(c["args"][0], "worker")
        self.assertEqual(env["INFERSCALE_BACKEND"], "cuda")
        self.assertEqual(env["INFERSCALE_NAME"], "$(POD_NAME)")
        self.assertEqual(env["INFERSCALE_ADVERTISE"], f"$(POD_NAME).{spec['serviceName']}.{NS}.svc.cluster.local:50051")
        self.assertEqual(env["INFERSCALE_HTTP_LISTEN"], "0.0.0.0:9090")
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
        pdb = one(self.default, "PodDisruptionBudget", f"{RELEASE}-worker")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], spec["selector"]["matchLabels"])

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
                for i, peer in enumerate(peers):
                    self.assertEqual(
                        peer,
                        f"{RELEASE}-etcd-{i}=http://{RELEASE}-etcd-{i}.{RELEASE}-etcd-headless.{NS}.svc.cluster.local:2380",
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
        # Every named port a policy admits exists on the pods it selects.
        for p in pols.values():
            workload = next(
                d for d in self.default
                if d["kind"] in ("Deployment", "StatefulSet")
                and d["spec"]["selector"]["matchLabels"] == p["spec"]["podSelector"]["matchLabels"]
            )
            names = {port["name"] for c in workload["spec"]["template"]["spec"]["containers"] for port in c["ports"]}
            for rule in p["spec"]["ingress"]:
                for port in rule["ports"]:
                    self.assertIn(port["port"], names, p["metadata"]["name"])

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
        self.assertEqual(env_of(c)["INFERSCALE_MODEL"], "/models/Llama-3.1-8B-Instruct")
        self.assertEqual(c["args"][1:3], ["--embedder", "/models/all-minilm-l6-v2"])
        self.assertTrue(c["image"].startswith("registry.example.com/inferscale/inferscale-worker:"))
        self.assertEqual(pod["imagePullSecrets"], [{"name": "regcred"}])


if __name__ == "__main__":
    result = unittest.main(argv=sys.argv[:1], verbosity=2, exit=False).result
    sys.exit(0 if result.wasSuccessful() else 1)
