variable "cluster_name" {
  description = "Name of the EKS cluster; also the prefix of every resource name."
  type        = string
}

variable "kubernetes_version" {
  description = "Kubernetes minor version of the control plane and node groups."
  type        = string
}

variable "vpc_cidr" {
  description = "CIDR block of the VPC."
  type        = string
}

variable "availability_zones" {
  description = "Availability zone names to use; empty: the first availability_zone_count of the region's zones a-f."
  type        = list(string)
}

variable "availability_zone_count" {
  description = "How many availability zones to spread subnets (and node groups) over when availability_zones is empty."
  type        = number
}

variable "endpoint_public_access_cidrs" {
  description = "CIDR blocks allowed to reach the public Kubernetes API endpoint."
  type        = list(string)
}

variable "system_node_instance_types" {
  description = "Instance types of the CPU node group (routers, etcd, Jaeger, cluster add-ons)."
  type        = list(string)
}

variable "system_node_count" {
  description = "Size of the CPU node group."
  type = object({
    min     = number
    desired = number
    max     = number
  })
}

variable "gpu_instance_type" {
  description = "Instance type of the GPU node group."
  type        = string
}

variable "gpu_node_count" {
  description = "Size of the GPU node group."
  type = object({
    min     = number
    desired = number
    max     = number
  })
}

variable "gpu_capacity_type" {
  description = "ON_DEMAND or SPOT capacity for the GPU node group."
  type        = string
}

variable "gpu_root_volume_size_gib" {
  description = "Root volume of each GPU node (container images: the worker image carries the CUDA runtime)."
  type        = number
}

variable "log_retention_days" {
  description = "Retention of the control-plane and VPC flow log groups."
  type        = number
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}

variable "nat_gateway_per_az" {
  description = "One NAT gateway per availability zone (true) or one shared by all zones (false)."
  type        = bool
}

variable "enable_cluster_autoscaler" {
  description = "Create the cluster autoscaler's IAM role (EKS Pod Identity) and the GPU node group's node-template tags."
  type        = bool
}
