# Default StorageClass: encrypted gp3 through the EBS CSI driver, bound where
# the pod lands (volumes are zonal).
resource "kubernetes_storage_class_v1" "gp3" {
  metadata {
    name = "gp3"
    annotations = {
      "storageclass.kubernetes.io/is-default-class" = "true"
    }
  }

  storage_provisioner    = "ebs.csi.aws.com"
  reclaim_policy         = "Retain"
  volume_binding_mode    = "WaitForFirstConsumer"
  allow_volume_expansion = true

  parameters = {
    type      = "gp3"
    encrypted = "true"
    kmsKeyId  = module.cluster.kms_key_arn
  }

  depends_on = [module.cluster]
}

# The chart's pods meet the "restricted" Pod Security Standard; enforce it.
resource "kubernetes_namespace_v1" "inferscale" {
  metadata {
    name = var.namespace
    labels = {
      "pod-security.kubernetes.io/enforce" = "restricted"
      "pod-security.kubernetes.io/audit"   = "restricted"
      "pod-security.kubernetes.io/warn"    = "restricted"
    }
  }

  depends_on = [module.cluster]
}

resource "kubernetes_secret_v1" "api_keys" {
  count = length(var.api_keys) > 0 ? 1 : 0

  metadata {
    name      = "inferscale-api-keys"
    namespace = kubernetes_namespace_v1.inferscale.metadata[0].name
  }

  data = {
    "keys.txt" = join("\n", concat(var.api_keys, [""]))
  }
}

# NVIDIA device plugin: advertises nvidia.com/gpu on the GPU nodes.
resource "helm_release" "nvidia_device_plugin" {
  name             = "nvidia-device-plugin"
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = var.nvidia_device_plugin_version
  namespace        = "nvidia-device-plugin"
  create_namespace = true
  wait             = true

  values = [yamlencode({
    nodeSelector = { "nvidia.com/gpu.present" = "true" }
    tolerations = [{
      key      = "nvidia.com/gpu"
      operator = "Exists"
      effect   = "NoSchedule"
    }]
  })]

  depends_on = [module.cluster]
}

# cert-manager (with its CRDs): issues the chart's mutual-TLS certificates
# (its default tls values: a private CA per release).
resource "helm_release" "cert_manager" {
  count = var.install_cert_manager ? 1 : 0

  name             = "cert-manager"
  repository       = "https://charts.jetstack.io"
  chart            = "cert-manager"
  version          = var.cert_manager_version
  namespace        = "cert-manager"
  create_namespace = true
  wait             = true

  values = [yamlencode({
    crds            = { enabled = true }
    nodeSelector    = { "inferscale.io/pool" = "system" }
    webhook         = { nodeSelector = { "inferscale.io/pool" = "system" } }
    cainjector      = { nodeSelector = { "inferscale.io/pool" = "system" } }
    startupapicheck = { nodeSelector = { "inferscale.io/pool" = "system" } }
  })]

  depends_on = [module.cluster]
}

# Cluster autoscaler: node-group auto-discovery (the tags modules/eks-gpu
# writes), credentials through EKS Pod Identity (the module binds its role to
# this ServiceAccount). Scales the GPU group within gpu_node_count when
# workers are pending (e.g. KEDA added some) and removes unneeded nodes.
resource "helm_release" "cluster_autoscaler" {
  count = var.enable_cluster_autoscaler ? 1 : 0

  name       = "cluster-autoscaler"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = var.cluster_autoscaler_chart_version
  namespace  = module.cluster.cluster_autoscaler.namespace
  wait       = true

  values = [yamlencode({
    cloudProvider    = "aws"
    awsRegion        = var.region
    fullnameOverride = "cluster-autoscaler"
    autoDiscovery    = { clusterName = module.cluster.cluster_name }
    image            = { tag = local.cluster_autoscaler_image_tags[var.kubernetes_version] }
    rbac = {
      serviceAccount = {
        create = true
        name   = module.cluster.cluster_autoscaler.service_account
      }
    }
    nodeSelector = { "inferscale.io/pool" = "system" }
    extraArgs = {
      "balance-similar-node-groups" = true
      "expander"                    = "least-waste"
      # Workers keep scratch in emptyDirs (their data is on PVCs): such
      # nodes may still be emptied.
      "skip-nodes-with-local-storage" = false
      "skip-nodes-with-system-pods"   = false
      # A worker's drain (preStop) takes up to its grace period (600 s).
      "max-graceful-termination-sec" = 660
      "scale-down-unneeded-time"     = "10m"
      "scale-down-delay-after-add"   = "10m"
    }
  })]

  depends_on = [module.cluster]
}

# InferScale, from the chart in this repository.
resource "helm_release" "inferscale" {
  name      = "inferscale"
  chart     = local.chart_path
  namespace = kubernetes_namespace_v1.inferscale.metadata[0].name
  wait      = true
  timeout   = var.helm_timeout_seconds

  values = [yamlencode({
    image = {
      registry = local.image_registry
    }
    apiKeys = {
      existingSecret = length(var.api_keys) > 0 ? kubernetes_secret_v1.api_keys[0].metadata[0].name : ""
    }
    otel = {
      endpoint = var.otel_endpoint
    }
    router = {
      image = { tag = var.image_tag }
      autoscaling = {
        enabled     = true
        minReplicas = var.router_replicas.min
        maxReplicas = var.router_replicas.max
      }
      service = {
        type = "LoadBalancer"
        annotations = merge(
          { "service.beta.kubernetes.io/aws-load-balancer-type" = "nlb" },
          var.router_internal ? { "service.beta.kubernetes.io/aws-load-balancer-internal" = "true" } : {},
        )
        loadBalancerSourceRanges = var.router_allowed_cidrs
        externalTrafficPolicy    = "Local"
      }
      nodeSelector = { "inferscale.io/pool" = "system" }
    }
    worker = {
      image        = { tag = var.image_tag }
      replicaCount = var.worker_replicas
      backend      = "cuda"
      engine       = var.worker_engine
      vllm         = { image = { tag = var.image_tag } }
      model        = var.worker_model
      kvCacheMb    = var.worker_kv_cache_mb
      persistence = {
        size             = "${var.worker_volume_size_gib}Gi"
        storageClassName = kubernetes_storage_class_v1.gp3.metadata[0].name
      }
    }
    etcd = {
      persistence  = { storageClassName = kubernetes_storage_class_v1.gp3.metadata[0].name }
      nodeSelector = { "inferscale.io/pool" = "system" }
    }
    jaeger = {
      enabled      = var.enable_jaeger && var.otel_endpoint == ""
      nodeSelector = { "inferscale.io/pool" = "system" }
    }
  })]

  depends_on = [
    helm_release.nvidia_device_plugin,
    helm_release.cert_manager,
    helm_release.cluster_autoscaler,
    module.cluster,
  ]
}

# The router's load balancer, once the release has created it.
data "kubernetes_service_v1" "router" {
  metadata {
    name      = "inferscale-router"
    namespace = helm_release.inferscale.namespace
  }

  depends_on = [helm_release.inferscale]
}
