# ---------------------------------------------------------------- cluster

variable "region" {
  description = "AWS region, e.g. us-east-1. P5 (H100) and P5e/P5en (H200) capacity differs by region."
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "cluster_name" {
  description = "Name of the EKS cluster and prefix of every resource name."
  type        = string
  default     = "inferscale"

  validation {
    # IAM role names ("<name>-vpc-flow-logs") must stay within 64 characters.
    condition     = can(regex("^[a-z][a-z0-9-]{1,38}[a-z0-9]$", var.cluster_name))
    error_message = "cluster_name must be 3-40 characters of lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "Kubernetes minor version of the EKS control plane and node groups."
  type        = string
  default     = "1.33"

  validation {
    condition     = contains(["1.31", "1.32", "1.33", "1.34"], var.kubernetes_version)
    error_message = "kubernetes_version must be one of 1.31, 1.32, 1.33, 1.34 (the chart is validated against 1.33)."
  }
}

variable "vpc_cidr" {
  description = "CIDR block of the new VPC (/16 recommended: every pod takes a VPC address)."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && tonumber(split("/", var.vpc_cidr)[1]) <= 20
    error_message = "vpc_cidr must be a valid IPv4 CIDR block of /20 or larger."
  }
}

variable "availability_zones" {
  description = "Availability zones to use, e.g. [\"us-east-1a\", \"us-east-1b\"] (where your GPU capacity is). Empty: the first availability_zone_count zones of the region."
  type        = list(string)
  default     = []

  validation {
    condition     = length(var.availability_zones) == 0 || (length(var.availability_zones) >= 2 && alltrue([for z in var.availability_zones : can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9][a-z]$", z))]))
    error_message = "availability_zones must be empty or list at least two zone names such as us-east-1a."
  }
}

variable "availability_zone_count" {
  description = "Availability zones to spread the subnets and node groups over."
  type        = number
  default     = 3

  validation {
    condition     = var.availability_zone_count >= 2 && var.availability_zone_count <= 4 && floor(var.availability_zone_count) == var.availability_zone_count
    error_message = "availability_zone_count must be a whole number from 2 to 4 (EKS needs subnets in two zones at least)."
  }
}

variable "endpoint_public_access_cidrs" {
  description = "CIDR blocks allowed to reach the Kubernetes API (the machine running Terraform must be among them)."
  type        = list(string)

  validation {
    condition     = length(var.endpoint_public_access_cidrs) > 0 && alltrue([for c in var.endpoint_public_access_cidrs : can(cidrhost(c, 0))])
    error_message = "endpoint_public_access_cidrs must be a non-empty list of valid CIDR blocks."
  }

  validation {
    condition     = !contains(var.endpoint_public_access_cidrs, "0.0.0.0/0")
    error_message = "endpoint_public_access_cidrs must not open the Kubernetes API to the whole internet (0.0.0.0/0)."
  }
}

variable "system_node_instance_types" {
  description = "Instance types of the CPU node group (routers, etcd, Jaeger, add-ons)."
  type        = list(string)
  default     = ["m7i.2xlarge"]

  validation {
    condition     = length(var.system_node_instance_types) > 0 && alltrue([for t in var.system_node_instance_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", t))])
    error_message = "system_node_instance_types must be a non-empty list of instance types such as m7i.2xlarge."
  }
}

variable "system_node_count" {
  description = "Size of the CPU node group: min, desired and max nodes."
  type = object({
    min     = number
    desired = number
    max     = number
  })
  default = { min = 3, desired = 3, max = 6 }

  validation {
    condition     = var.system_node_count.min >= 1 && var.system_node_count.min <= var.system_node_count.desired && var.system_node_count.desired <= var.system_node_count.max
    error_message = "system_node_count must satisfy 1 <= min <= desired <= max (3 nodes hold a 3-member etcd, one member each)."
  }
}

variable "nat_gateway_per_az" {
  description = "One NAT gateway per availability zone, each zone's private subnet routed through its own (no cross-zone egress, a zone's loss leaves the others' egress up), instead of one shared by all zones (cheaper; the zone holding it is a single point of failure for egress)."
  type        = bool
  default     = false
}

variable "gpu_instance_type" {
  description = "GPU instance type: p5.4xlarge (1x H100), p5.48xlarge (8x H100), p5e.48xlarge or p5en.48xlarge (8x H200)."
  type        = string
  default     = "p5e.48xlarge"

  validation {
    condition     = contains(["p5.4xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"], var.gpu_instance_type)
    error_message = "gpu_instance_type must be an H100 or H200 instance type: p5.4xlarge, p5.48xlarge, p5e.48xlarge or p5en.48xlarge."
  }
}

variable "gpu_node_count" {
  description = "Size of the GPU node group: min, desired and max nodes."
  type = object({
    min     = number
    desired = number
    max     = number
  })
  default = { min = 1, desired = 1, max = 2 }

  validation {
    condition     = var.gpu_node_count.min >= 0 && var.gpu_node_count.min <= var.gpu_node_count.desired && var.gpu_node_count.desired <= var.gpu_node_count.max && var.gpu_node_count.max >= 1
    error_message = "gpu_node_count must satisfy 0 <= min <= desired <= max and max >= 1."
  }
}

variable "gpu_capacity_type" {
  description = "ON_DEMAND or SPOT capacity for the GPU nodes."
  type        = string
  default     = "ON_DEMAND"

  validation {
    condition     = contains(["ON_DEMAND", "SPOT"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type must be ON_DEMAND or SPOT."
  }
}

variable "gpu_root_volume_size_gib" {
  description = "Root volume of each GPU node in GiB (holds the worker image, which carries the CUDA runtime)."
  type        = number
  default     = 500

  validation {
    condition     = var.gpu_root_volume_size_gib >= 100 && var.gpu_root_volume_size_gib <= 16384
    error_message = "gpu_root_volume_size_gib must be between 100 and 16384."
  }
}

variable "log_retention_days" {
  description = "Retention of the control-plane and VPC flow logs, in days (a CloudWatch-supported value)."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a retention CloudWatch Logs accepts (e.g. 30, 90, 365)."
  }
}

variable "nvidia_device_plugin_version" {
  description = "Version of the NVIDIA device plugin Helm chart (advertises nvidia.com/gpu to the scheduler)."
  type        = string
  default     = "0.17.1"

  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", var.nvidia_device_plugin_version))
    error_message = "nvidia_device_plugin_version must be a version such as 0.17.1."
  }
}

variable "enable_cluster_autoscaler" {
  description = "Install the Kubernetes cluster autoscaler (Helm), which adds GPU nodes (up to gpu_node_count.max) when workers cannot be scheduled and removes unneeded ones (down to gpu_node_count.min), and sizes the system group the same way."
  type        = bool
  default     = true
}

variable "cluster_autoscaler_chart_version" {
  description = "Version of the cluster-autoscaler Helm chart (kubernetes/autoscaler); its image follows kubernetes_version."
  type        = string
  default     = "9.52.1"

  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", var.cluster_autoscaler_chart_version))
    error_message = "cluster_autoscaler_chart_version must be a version such as 9.52.1."
  }
}

variable "install_cert_manager" {
  description = "Install cert-manager (Helm, with its CRDs), which issues the chart's mutual-TLS certificates. false: the cluster has it already (or the chart's tls values are set otherwise)."
  type        = bool
  default     = true
}

variable "cert_manager_version" {
  description = "Version of the cert-manager Helm chart (charts.jetstack.io)."
  type        = string
  default     = "v1.18.2"

  validation {
    condition     = can(regex("^v[0-9]+\\.[0-9]+\\.[0-9]+$", var.cert_manager_version))
    error_message = "cert_manager_version must be a version such as v1.18.2."
  }
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k, v in var.tags : length(k) <= 128 && length(v) <= 256])
    error_message = "Tag keys must be at most 128 characters and values at most 256."
  }
}

# ---------------------------------------------------------------- InferScale

variable "namespace" {
  description = "Kubernetes namespace of the InferScale release."
  type        = string
  default     = "inferscale"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a DNS label (lowercase letters, digits, hyphens; at most 63)."
  }
}

variable "image_registry" {
  description = "Registry prefix of the inferscale-router, inferscale-worker and inferscale-worker-vllm images. Empty: the ECR repositories this configuration creates."
  type        = string
  default     = ""

  validation {
    condition     = var.image_registry == "" || can(regex("^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$", var.image_registry))
    error_message = "image_registry must be empty or a registry host with an optional path, e.g. ghcr.io/acme."
  }
}

variable "image_tag" {
  description = "Tag of both images (ECR tags are immutable: push a new tag per build)."
  type        = string
  default     = "0.1.0"

  validation {
    condition     = can(regex("^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", var.image_tag)) && var.image_tag != "latest"
    error_message = "image_tag must be a valid image tag other than latest."
  }
}

variable "worker_replicas" {
  description = "InferScale workers (one GPU each). A p5*.48xlarge node holds 8."
  type        = number
  default     = 8

  validation {
    condition     = var.worker_replicas >= 1 && floor(var.worker_replicas) == var.worker_replicas
    error_message = "worker_replicas must be a whole number of at least 1."
  }
}

variable "worker_model" {
  description = "Model of the workers: a packaged name (smollm2) or a path inside the worker (GGUF file or HF directory)."
  type        = string
  default     = "smollm2"

  validation {
    condition     = length(trimspace(var.worker_model)) > 0
    error_message = "worker_model must not be empty."
  }
}

variable "worker_engine" {
  description = "What generates on the workers: vllm (vLLM with InferScale's KV connector, from the inferscale-worker-vllm image; the chart's default) or native (InferScale's engine, from inferscale-worker). docs/deploy.md, Engines."
  type        = string
  default     = "vllm"

  validation {
    condition     = contains(["vllm", "native"], var.worker_engine)
    error_message = "worker_engine must be vllm or native."
  }
}

variable "worker_kv_cache_mb" {
  description = "Paged KV cache per native worker in MiB of GPU memory (an H100 has 80 GiB, an H200 141 GiB); vLLM workers size theirs from the chart's worker.vllm.gpuMemoryUtilization."
  type        = number
  default     = 65536

  validation {
    condition     = var.worker_kv_cache_mb >= 256 && var.worker_kv_cache_mb <= 131072
    error_message = "worker_kv_cache_mb must be between 256 and 131072."
  }
}

variable "worker_volume_size_gib" {
  description = "Shard store volume per worker in GiB (facts, embeddings and their KV; model cache)."
  type        = number
  default     = 200

  validation {
    condition     = var.worker_volume_size_gib >= 10 && var.worker_volume_size_gib <= 16384
    error_message = "worker_volume_size_gib must be between 10 and 16384."
  }
}

variable "router_replicas" {
  description = "Minimum and maximum router replicas (the HPA scales between them on CPU)."
  type = object({
    min = number
    max = number
  })
  default = { min = 2, max = 10 }

  validation {
    condition     = var.router_replicas.min >= 1 && var.router_replicas.min <= var.router_replicas.max
    error_message = "router_replicas must satisfy 1 <= min <= max."
  }
}

variable "router_allowed_cidrs" {
  description = "Client CIDR blocks allowed through the router's load balancer."
  type        = list(string)
  default     = ["0.0.0.0/0"]

  validation {
    condition     = length(var.router_allowed_cidrs) > 0 && alltrue([for c in var.router_allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "router_allowed_cidrs must be a non-empty list of valid CIDR blocks."
  }
}

variable "router_internal" {
  description = "Make the router's load balancer internal (reachable from the VPC and its peers only)."
  type        = bool
  default     = false
}

variable "api_keys" {
  description = "Router API keys, `tenant:key` each. Empty: the chart generates one for tenant `default` (see the outputs)."
  type        = list(string)
  default     = []
  sensitive   = true

  validation {
    condition     = alltrue([for k in var.api_keys : can(regex("^[^:\\s]+:\\S{16,}$", k))])
    error_message = "Each API key must be `tenant:key` with a key of at least 16 non-space characters."
  }
}

variable "otel_endpoint" {
  description = "OTLP endpoint of an existing collector (http://host:4317). Empty: the chart's Jaeger when enable_jaeger, else no tracing."
  type        = string
  default     = ""

  validation {
    condition     = var.otel_endpoint == "" || can(regex("^https?://[^\\s/]+(:[0-9]+)?/?$", var.otel_endpoint))
    error_message = "otel_endpoint must be empty or an http(s)://host:port URL."
  }
}

variable "enable_jaeger" {
  description = "Install the chart's Jaeger all-in-one (in-memory) for traces."
  type        = bool
  default     = true
}

variable "helm_timeout_seconds" {
  description = "How long Terraform waits for the release to become ready (GPU nodes, image pulls and the first model fetch)."
  type        = number
  default     = 2400

  validation {
    condition     = var.helm_timeout_seconds >= 300 && var.helm_timeout_seconds <= 7200
    error_message = "helm_timeout_seconds must be between 300 and 7200."
  }
}
