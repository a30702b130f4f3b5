# Image repositories for the three images (deploy/docker: the router, our
# engine's worker, the vLLM worker). Tags are immutable: push a new tag per
# build and set image_tag.
resource "aws_ecr_repository" "this" {
  for_each = toset(["inferscale-router", "inferscale-worker", "inferscale-worker-vllm"])

  name                 = "${var.cluster_name}/${each.value}"
  image_tag_mutability = "IMMUTABLE"
  force_delete         = false

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }

  tags = var.tags
}

resource "aws_ecr_lifecycle_policy" "this" {
  for_each = aws_ecr_repository.this

  repository = each.value.name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Keep the 30 newest images"
      selection = {
        tagStatus   = "any"
        countType   = "imageCountMoreThan"
        countNumber = 30
      }
      action = { type = "expire" }
    }]
  })
}
