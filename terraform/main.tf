locals {
  tags = merge({
    "app.kubernetes.io/part-of" = "inferscale"
    "managed-by"                = "terraform"
  }, var.tags)

  chart_path = "${path.module}/../deploy/helm/inferscale"

  # The cluster autoscaler's minor version follows Kubernetes'.
  cluster_autoscaler_image_tags = {
    "1.31" = "v1.31.4"
    "1.32" = "v1.32.3"
    "1.33" = "v1.33.1"
    "1.34" = "v1.34.0"
  }
  image_registry = var.image_registry != "" ? var.image_registry : module.cluster.ecr_registry
}

module "cluster" {
  source = "./modules/eks-gpu"

  cluster_name                 = var.cluster_name
  kubernetes_version           = var.kubernetes_version
  vpc_cidr                     = var.vpc_cidr
  availability_zones           = var.availability_zones
  availability_zone_count      = var.availability_zone_count
  endpoint_public_access_cidrs = var.endpoint_public_access_cidrs
  system_node_instance_types   = var.system_node_instance_types
  system_node_count            = var.system_node_count
  gpu_instance_type            = var.gpu_instance_type
  gpu_node_count               = var.gpu_node_count
  gpu_capacity_type            = var.gpu_capacity_type
  gpu_root_volume_size_gib     = var.gpu_root_volume_size_gib
  log_retention_days           = var.log_retention_days
  nat_gateway_per_az           = var.nat_gateway_per_az
  enable_cluster_autoscaler    = var.enable_cluster_autoscaler
  tags                         = local.tags
}
