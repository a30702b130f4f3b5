locals {
  router_ingress  = try(data.kubernetes_service_v1.router.status[0].load_balancer[0].ingress[0], null)
  router_hostname = try(coalesce(local.router_ingress.hostname, local.router_ingress.ip), "")
}

output "router_endpoint" {
  description = "Base URL of the OpenAI-compatible API (the router's load balancer); empty until AWS has assigned its name."
  value       = local.router_hostname == "" ? "" : "http://${local.router_hostname}:8080/v1"
}

output "router_hostname" {
  description = "DNS name of the router's load balancer."
  value       = local.router_hostname
}

output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = module.cluster.cluster_name
}

output "cluster_endpoint" {
  description = "URL of the Kubernetes API."
  value       = module.cluster.cluster_endpoint
}

output "kubeconfig_command" {
  description = "Adds the cluster to your kubeconfig."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.cluster_name}"
}

output "ecr_repository_urls" {
  description = "Where to push the router and worker images (tag: image_tag)."
  value       = module.cluster.ecr_repository_urls
}

output "namespace" {
  description = "Namespace of the InferScale release."
  value       = helm_release.inferscale.namespace
}

output "api_key_command" {
  description = "Prints the router's API keys (`tenant:key` lines)."
  value       = "kubectl -n ${helm_release.inferscale.namespace} get secret inferscale-api-keys -o jsonpath='{.data.keys\\.txt}' | base64 -d"
}
