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
  description = "URLs of the router and worker image repositories."
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
