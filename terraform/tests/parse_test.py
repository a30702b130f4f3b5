#!/usr/bin/env python3
"""Structure tests of terraform/, parsed with python-hcl2 (no providers needed).

`terraform validate` needs every provider plugin, and the helm and kubernetes
providers cannot be fetched offline, so these tests check what validate would
not anyway, and the wiring it cannot reach here:

- every .tf file parses;
- every variable is typed and described, and every non-bool root variable
  has a validation block whose condition tests that variable;
- the module call passes exactly the module's variables;
- versions.tf pins Terraform and every provider used;
- the outputs exist (the router endpoint from the router Service's load balancer);
- the GPU node group is H100/H200-only, labelled and tainted as the chart's
  worker expects, and the NVIDIA device plugin is installed from NVIDIA's repo;
- helm_release.inferscale installs ../deploy/helm/inferscale, and every value
  it sets exists in that chart's values.yaml;
- nat_gateway_per_az: one NAT gateway and private route table per zone or one
  in all, each zone routed through its own, state of the single one moved;
- GPU node autoscaling: the cluster autoscaler's release, its Pod Identity
  role bound to the ServiceAccount the release creates, a policy that resizes
  only this cluster's groups, and the auto-discovery and node-template tags
  that match the GPU node group's labels, taint and GPUs;
- cert-manager, which the chart's default TLS needs, installed before the chart.

Run: PYTHONPATH=<dir with python-hcl2 and PyYAML> python3 terraform/tests/parse_test.py
(scripts/check_deploy.sh does).
"""

from __future__ import annotations

import re
import sys
import unittest
from pathlib import Path

import hcl2
import yaml

TF = Path(__file__).resolve().parents[1]
MODULE = TF / "modules" / "eks-gpu"


def unq(v):
    """python-hcl2 >= 5 keeps the quotes of string literals and block labels."""
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return v[1:-1]
    return v


def load_dir(d: Path) -> dict:
    """Merges the top-level blocks of every .tf file in d."""
    merged: dict = {}
    for f in sorted(d.glob("*.tf")):
        with f.open() as fh:
            doc = hcl2.load(fh)
        for kind, blocks in doc.items():
            merged.setdefault(kind, []).extend(blocks if isinstance(blocks, list) else [blocks])
    return merged


def labelled(blocks: list, depth: int) -> dict:
    """{label: body} for blocks with one label (variable, output, module), or
    {(type, name): body} for two (resource, data)."""
    out = {}
    for b in blocks:
        for k1, v1 in b.items():
            if depth == 1:
                out[unq(k1)] = v1
            else:
                for k2, v2 in v1.items():
                    out[(unq(k1), unq(k2))] = v2
    return out


def as_list(v):
    return v if isinstance(v, list) else [v]


def hcl_object_paths(text: str) -> list[tuple[str, ...]]:
    """Key paths of an HCL object-constructor expression, e.g. the argument of
    yamlencode({...}): nested `{ key = value, ... }`; values that are not
    object literals are leaves. Enough of HCL for helm_release values."""
    i = 0
    n = len(text)

    def skip_ws():
        nonlocal i
        while i < n and text[i] in " \t\r\n,":
            i += 1

    def read_string() -> str:
        nonlocal i
        assert text[i] == '"'
        i += 1
        out = []
        while text[i] != '"':
            if text[i] == "\\":
                i += 1
            out.append(text[i])
            i += 1
        i += 1
        return "".join(out)

    def skip_value():
        """Skips one non-object value up to the next top-level , or }."""
        nonlocal i
        depth = 0
        while i < n:
            c = text[i]
            if c == '"':
                read_string()
                continue
            if c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    return
                depth -= 1
            elif c in ",\n" and depth == 0:
                return
            i += 1

    def parse_object(prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
        nonlocal i
        assert text[i] == "{", text[i:i + 40]
        i += 1
        paths = []
        while True:
            skip_ws()
            if text[i] == "}":
                i += 1
                return paths
            if text[i] == '"':
                key = read_string()
            else:
                m = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*").match(text, i)
                assert m, text[i:i + 40]
                key = m.group(0)
                i = m.end()
            skip_ws()
            assert text[i] in "=:", text[i:i + 40]
            i += 1
            skip_ws()
            path = prefix + (key,)
            if text[i] == "{":
                sub = parse_object(path)
                paths.extend(sub or [path])
            else:
                skip_value()
                paths.append(path)

    i = text.index("{", text.index("yamlencode(") if "yamlencode(" in text else 0)
    return parse_object(())


class TerraformStructure(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = load_dir(TF)
        cls.module = load_dir(MODULE)
        cls.root_vars = labelled(cls.root["variable"], 1)
        cls.module_vars = labelled(cls.module["variable"], 1)
        cls.outputs = labelled(cls.root["output"], 1)
        cls.resources = labelled(cls.root["resource"], 2)
        cls.data = labelled(cls.root["data"], 2)
        cls.module_resources = labelled(cls.module["resource"], 2)
        cls.module_data = labelled(cls.module["data"], 2)
        cls.module_locals = {}
        for blk in cls.module.get("locals", []):
            cls.module_locals.update({k: v for k, v in blk.items() if not k.startswith("__")})
        cls.modules = labelled(cls.root["module"], 1)
        cls.locals = {}
        for blk in cls.root.get("locals", []):
            cls.locals.update({k: v for k, v in blk.items() if not k.startswith("__")})

    def test_every_file_parses(self):
        files = sorted(TF.rglob("*.tf"))
        self.assertGreaterEqual(len(files), 10)
        for f in files:
            if ".terraform" in f.parts:
                continue
            with self.subTest(file=str(f.relative_to(TF))), f.open() as fh:
                hcl2.load(fh)

    def test_variables_typed_described_validated(self):
        self.assertGreaterEqual(len(self.root_vars), 20)
        for name, body in self.root_vars.items():
            with self.subTest(variable=name):
                self.assertIn("type", body, "untyped")
                self.assertTrue(unq(body.get("description", "")), "no description")
                if body["type"] == "bool":
                    continue
                validations = as_list(body.get("validation", []))
                self.assertTrue(validations, "no validation block")
                for v in validations:
                    self.assertIn(f"var.{name}", v["condition"])
                    self.assertTrue(unq(v["error_message"]))
        for name, body in self.module_vars.items():
            with self.subTest(module_variable=name):
                self.assertIn("type", body)
                self.assertTrue(unq(body.get("description", "")))

    def test_validations_reject_what_they_should(self):
        # The conditions checkov cannot see (CKV_AWS_38 is skipped on their strength).
        cidrs = self.root_vars["endpoint_public_access_cidrs"]
        self.assertNotIn("default", cidrs, "the API allowlist must be chosen by whoever deploys")
        conditions = " ".join(v["condition"] for v in as_list(cidrs["validation"]))
        self.assertIn('"0.0.0.0/0"', conditions)
        gpu = self.root_vars["gpu_instance_type"]
        allowed = re.findall(r'"(p[0-9a-z]+\.[0-9a-z]+)"', as_list(gpu["validation"])[0]["condition"])
        self.assertTrue(allowed)
        for t in allowed:
            # H100 (p5) and H200 (p5e, p5en) only.
            self.assertRegex(t, r"^p5(e|en)?\.(4|48)xlarge$")
        self.assertIn(unq(gpu["default"]), allowed)
        self.assertEqual(self.root_vars["api_keys"].get("sensitive"), True)

    def test_module_call_matches_module_variables(self):
        call = self.modules["cluster"]
        self.assertEqual(unq(call["source"]), "./modules/eks-gpu")
        passed = {k for k in call if k not in ("source", "__is_block__") and not k.startswith("__")}
        required = {n for n, b in self.module_vars.items() if "default" not in b}
        self.assertEqual(passed - set(self.module_vars), set(), "arguments the module does not declare")
        self.assertEqual(required - passed, set(), "module variables left unset")

    def test_versions_pin_providers(self):
        tf = self.root["terraform"][0]
        self.assertRegex(unq(tf["required_version"]), r">=\s*1\.\d+")
        providers = as_list(tf["required_providers"])[0]
        for name in ("aws", "helm", "kubernetes"):
            with self.subTest(provider=name):
                self.assertEqual(unq(providers[name]["source"]), f"hashicorp/{name}")
                self.assertRegex(unq(providers[name]["version"]), r"\d+\.\d+")
        used = {t.split("_")[0] for t, _ in list(self.resources) + list(self.data)}
        used |= {t.split("_")[0] for t, _ in self.module_resources}
        self.assertLessEqual(used, {"aws", "helm", "kubernetes"})
        module_tf = self.module["terraform"][0]
        self.assertEqual(set(as_list(module_tf["required_providers"])[0]) - {"__is_block__"}, {"aws"})

    def test_outputs(self):
        for name in ("router_endpoint", "router_hostname", "cluster_name", "kubeconfig_command", "ecr_repository_urls"):
            with self.subTest(output=name):
                self.assertIn(name, self.outputs)
                self.assertTrue(unq(self.outputs[name].get("description", "")))
        self.assertIn("local.router_hostname", self.outputs["router_endpoint"]["value"])
        out_locals = {}
        for blk in self.root["locals"]:
            out_locals.update(blk)
        self.assertIn("data.kubernetes_service_v1.router.status", out_locals["router_ingress"])
        router = self.data[("kubernetes_service_v1", "router")]
        meta = as_list(router["metadata"])[0]
        self.assertEqual(unq(meta["name"]), "inferscale-router")
        self.assertIn("helm_release.inferscale", " ".join(as_list(router["depends_on"])))

    def test_gpu_node_group(self):
        ng = self.module_resources[("aws_eks_node_group", "gpu")]
        self.assertEqual(unq(ng["ami_type"]), "AL2023_x86_64_NVIDIA")
        self.assertIn("var.gpu_instance_type", str(ng["instance_types"]))
        labels = ng["labels"]
        self.assertEqual(unq(labels.get('"nvidia.com/gpu.present"', labels.get("nvidia.com/gpu.present"))), "true")
        taint = as_list(ng["taint"])[0]
        self.assertEqual((unq(taint["key"]), unq(taint["effect"])), ("nvidia.com/gpu", "NO_SCHEDULE"))

    def test_device_plugin_release(self):
        dp = self.resources[("helm_release", "nvidia_device_plugin")]
        self.assertEqual(unq(dp["repository"]), "https://nvidia.github.io/k8s-device-plugin")
        self.assertEqual(unq(dp["chart"]), "nvidia-device-plugin")
        self.assertIn("var.nvidia_device_plugin_version", dp["version"])
        self.assertIn("nvidia.com/gpu", dp["values"][0])

    def test_inferscale_release_points_at_the_chart(self):
        rel = self.resources[("helm_release", "inferscale")]
        self.assertEqual(rel["chart"], "${local.chart_path}")
        chart_path = unq(self.locals["chart_path"]).replace("${path.module}", str(TF))
        chart = Path(chart_path).resolve()
        self.assertEqual(chart, (TF.parent / "deploy" / "helm" / "inferscale").resolve())
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        self.assertEqual(meta["name"], "inferscale")
        self.assertIn("helm_release.nvidia_device_plugin", " ".join(as_list(rel["depends_on"])))

    def test_release_values_exist_in_the_chart(self):
        rel = self.resources[("helm_release", "inferscale")]
        expr = rel["values"][0]
        self.assertTrue(expr.startswith("${yamlencode("), expr[:40])
        chart_values = yaml.safe_load((TF.parent / "deploy/helm/inferscale/values.yaml").read_text())
        paths = hcl_object_paths(expr)
        self.assertGreaterEqual(len(paths), 15)
        for path in paths:
            with self.subTest(value=".".join(path)):
                node = chart_values
                for j, key in enumerate(path):
                    self.assertIsInstance(node, dict, ".".join(path[:j]))
                    if key not in node and isinstance(node, dict) and not node:
                        break  # a free-form map in the chart (annotations, nodeSelector)
                    self.assertIn(key, node, f"{'.'.join(path)}: no {key!r} under {'.'.join(path[:j]) or 'the root'}")
                    node = node[key]
                    if path[j] in ("annotations", "nodeSelector", "podAnnotations"):
                        break

    def test_chart_schedules_workers_on_the_gpu_nodes(self):
        values = yaml.safe_load((TF.parent / "deploy/helm/inferscale/values.yaml").read_text())
        self.assertEqual(values["worker"]["nodeSelector"], {"nvidia.com/gpu.present": "true"})
        self.assertIn({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, values["worker"]["tolerations"])
        self.assertEqual(values["worker"]["backend"], "cuda")
        self.assertGreaterEqual(values["worker"]["gpu"]["count"], 1)

    def test_nat_gateway_per_az(self):
        var = self.root_vars["nat_gateway_per_az"]
        self.assertEqual((var["type"], var["default"]), ("bool", False))
        self.assertEqual(self.modules["cluster"]["nat_gateway_per_az"], "${var.nat_gateway_per_az}")
        self.assertEqual(self.module_vars["nat_gateway_per_az"]["type"], "bool")
        count = self.module_locals["nat_count"]
        self.assertEqual(count, "${var.nat_gateway_per_az ? length(local.azs) : 1}")
        for kind, name in (("aws_eip", "nat"), ("aws_nat_gateway", "this"), ("aws_route_table", "private"), ("aws_route", "private_nat")):
            with self.subTest(resource=f"{kind}.{name}"):
                self.assertEqual(self.module_resources[(kind, name)]["count"], "${local.nat_count}")
        nat = self.module_resources[("aws_nat_gateway", "this")]
        self.assertEqual(nat["subnet_id"], "${aws_subnet.public[count.index].id}")
        self.assertEqual(self.module_resources[("aws_route", "private_nat")]["nat_gateway_id"], "${aws_nat_gateway.this[count.index].id}")
        assoc = self.module_resources[("aws_route_table_association", "private")]
        self.assertEqual(assoc["count"], "${length(local.azs)}")
        self.assertEqual(assoc["route_table_id"], "${aws_route_table.private[var.nat_gateway_per_az ? count.index : 0].id}")
        # State made before the option moves to index 0 rather than being replaced.
        moved = {(m["from"], m["to"]) for m in self.module.get("moved", [])}
        for address in ("aws_eip.nat", "aws_nat_gateway.this", "aws_route_table.private", "aws_route.private_nat"):
            self.assertIn((f"${{{address}}}", f"${{{address}[0]}}"), moved)

    def test_gpu_node_autoscaling(self):
        var = self.root_vars["enable_cluster_autoscaler"]
        self.assertEqual((var["type"], var["default"]), ("bool", True))
        rel = self.resources[("helm_release", "cluster_autoscaler")]
        self.assertEqual(unq(rel["repository"]), "https://kubernetes.github.io/autoscaler")
        self.assertEqual(unq(rel["chart"]), "cluster-autoscaler")
        self.assertEqual(rel["count"], "${var.enable_cluster_autoscaler ? 1 : 0}")
        self.assertEqual(rel["namespace"], "${module.cluster.cluster_autoscaler.namespace}")
        values = rel["values"][0]
        self.assertIn("autoDiscovery = {clusterName = module.cluster.cluster_name}", values)
        self.assertIn("name = module.cluster.cluster_autoscaler.service_account", values)
        self.assertIn("image = {tag = local.cluster_autoscaler_image_tags[var.kubernetes_version]}", values)
        # An autoscaler image for every Kubernetes version the root accepts.
        versions = re.findall(r'"(1\.\d+)"', as_list(self.root_vars["kubernetes_version"]["validation"])[0]["condition"])
        tags = {unq(k): unq(v) for k, v in self.locals["cluster_autoscaler_image_tags"].items()}
        self.assertEqual(set(tags), set(versions))
        for k, v in tags.items():
            self.assertTrue(v.startswith(f"v{k}."), (k, v))

        # Its role, through EKS Pod Identity, bound to that ServiceAccount.
        ml = self.module_locals
        assoc = self.module_resources[("aws_eks_pod_identity_association", "cluster_autoscaler")]
        self.assertEqual(assoc["namespace"], "${local.cluster_autoscaler_namespace}")
        self.assertEqual(assoc["service_account"], "${local.cluster_autoscaler_service_account}")
        self.assertEqual((unq(ml["cluster_autoscaler_namespace"]), unq(ml["cluster_autoscaler_service_account"])),
                         ("kube-system", "cluster-autoscaler"))
        self.assertEqual(assoc["role_arn"], "${aws_iam_role.cluster_autoscaler[0].arn}")
        assume = as_list(self.module_data[("aws_iam_policy_document", "cluster_autoscaler_assume")]["statement"])[0]
        self.assertEqual([unq(i) for i in as_list(assume["principals"])[0]["identifiers"]], ["pods.eks.amazonaws.com"])
        # Resizing is limited to this cluster's groups.
        policy = as_list(self.module_data[("aws_iam_policy_document", "cluster_autoscaler")]["statement"])
        scale = next(st for st in policy if "autoscaling:SetDesiredCapacity" in [unq(a) for a in st["actions"]])
        self.assertNotEqual([unq(r) for r in scale["resources"]], ["*"])
        cond = as_list(scale["condition"])[0]
        self.assertEqual(unq(cond["variable"]), "aws:ResourceTag/k8s.io/cluster-autoscaler/${var.cluster_name}")
        self.assertEqual([unq(v) for v in cond["values"]], ["owned"])

        # Auto-discovery tags on both groups; node-template tags on the GPU
        # group that say what its nodes carry (for scaling up from zero).
        discovery = {unq(k): unq(v) for k, v in ml["autoscaler_discovery_tags"].items()}
        self.assertEqual(discovery, {"k8s.io/cluster-autoscaler/enabled": "true",
                                     "k8s.io/cluster-autoscaler/${var.cluster_name}": "owned"})
        template = {unq(k): unq(v) for k, v in ml["gpu_node_template_tags"].items()}
        prefix = "k8s.io/cluster-autoscaler/node-template/"
        ng = self.module_resources[("aws_eks_node_group", "gpu")]
        for label, value in ng["labels"].items():
            self.assertEqual(template[f"{prefix}label/{unq(label)}"], unq(value))
        taint = as_list(ng["taint"])[0]
        self.assertEqual(template[f"{prefix}taint/{unq(taint['key'])}"], f"{unq(taint['value'])}:NoSchedule")
        self.assertEqual(template[f"{prefix}resources/nvidia.com/gpu"], "${tostring(local.gpus_per_instance[var.gpu_instance_type])}")
        allowed = re.findall(r'"(p[0-9a-z]+\.[0-9a-z]+)"', as_list(self.root_vars["gpu_instance_type"]["validation"])[0]["condition"])
        self.assertEqual({unq(k) for k in ml["gpus_per_instance"]}, set(allowed))
        tag = self.module_resources[("aws_autoscaling_group_tag", "autoscaler")]
        self.assertEqual(tag["for_each"], "${local.autoscaler_asg_tags}")
        self.assertIn("gpu_node_template_tags", ml["autoscaler_asg_tags"])
        self.assertEqual(ml["node_group_asgs"]["gpu"], "${aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name}")
        # The chart waits for both.
        deps = " ".join(as_list(self.resources[("helm_release", "inferscale")]["depends_on"]))
        self.assertIn("helm_release.cluster_autoscaler", deps)

    def test_cert_manager_for_the_charts_tls(self):
        chart_values = yaml.safe_load((TF.parent / "deploy/helm/inferscale/values.yaml").read_text())
        self.assertTrue(chart_values["tls"]["enabled"] and chart_values["tls"]["certManager"]["enabled"])
        rel = self.resources[("helm_release", "cert_manager")]
        self.assertEqual(unq(rel["repository"]), "https://charts.jetstack.io")
        self.assertEqual(unq(rel["chart"]), "cert-manager")
        self.assertEqual(rel["count"], "${var.install_cert_manager ? 1 : 0}")
        self.assertIn("crds = {enabled = true}", rel["values"][0])
        self.assertIn("helm_release.cert_manager", " ".join(as_list(self.resources[("helm_release", "inferscale")]["depends_on"])))


if __name__ == "__main__":
    result = unittest.main(verbosity=2, exit=False).result
    sys.exit(0 if result.wasSuccessful() else 1)
