output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "URL of the Kubernetes API."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_certificate_authority_data" {
  description = "Base64 CA certificate of the Kubernetes API."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "cluster_version" {
  description = "Kubernetes version of the control plane."
  value       = aws_eks_cluster.this.version
}

output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "kms_key_arn" {
  description = "ARN of the cluster's KMS key (secrets, logs, volumes, images)."
  value       = aws_kms_key.this.arn
}

output "ecr_registry" {
  description = "Registry host and path prefix of the image repositories (the chart's image.registry)."
  value       = "${local.account_id}.dkr.ecr.${local.region}.amazonaws.com/${var.cluster_name}"
}

output "ecr_repository_urls" {
  description = "URLs of the router, worker and vLLM worker image repositories."
  value       = { for name, repo in aws_ecr_repository.this : name => repo.repository_url }
}

output "gpu_node_group" {
  description = "Name of the GPU node group."
  value       = aws_eks_node_group.gpu.node_group_name
}

output "addons_ready" {
  description = "Completes once the add-ons that the chart needs (storage, DNS, metrics) are installed."
  value = [
    aws_eks_addon.ebs_csi.id,
    aws_eks_addon.coredns.id,
    aws_eks_addon.metrics_server.id,
    aws_eks_addon.vpc_cni.id,
    aws_eks_addon.kube_proxy.id,
  ]
}

output "cluster_autoscaler" {
  description = "Where the cluster autoscaler must run to get its IAM role (EKS Pod Identity): namespace and ServiceAccount; null when enable_cluster_autoscaler is false."
  value = var.enable_cluster_autoscaler ? {
    namespace       = local.cluster_autoscaler_namespace
    service_account = local.cluster_autoscaler_service_account
    role_arn        = aws_iam_role.cluster_autoscaler[0].arn
  } : null
}

output "nat_gateway_ids" {
  description = "IDs of the NAT gateways (one per zone with nat_gateway_per_az, else one)."
  value       = aws_nat_gateway.this[*].id
}
