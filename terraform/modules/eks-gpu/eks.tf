data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name               = "${var.cluster_name}-cluster"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

# Created before the cluster so that its retention and key apply (EKS would
# otherwise create it without either).
resource "aws_cloudwatch_log_group" "cluster" {
  name              = local.cluster_log_group
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = var.tags
}

resource "aws_eks_cluster" "this" {
  name     = var.cluster_name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster.arn

  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  vpc_config {
    subnet_ids              = concat(aws_subnet.private[*].id, aws_subnet.public[*].id)
    endpoint_private_access = true
    # Terraform installs the charts through this endpoint from outside the
    # VPC; it is limited to endpoint_public_access_cidrs.
    endpoint_public_access = true
    public_access_cidrs    = var.endpoint_public_access_cidrs
  }

  encryption_config {
    resources = ["secrets"]

    provider {
      key_arn = aws_kms_key.this.arn
    }
  }

  access_config {
    authentication_mode = "API"
    # The identity that runs Terraform administers the cluster (it installs
    # the charts); grant others with aws_eks_access_entry.
    bootstrap_cluster_creator_admin_permissions = true
  }

  tags = var.tags

  depends_on = [
    aws_iam_role_policy_attachment.cluster,
    aws_cloudwatch_log_group.cluster,
  ]
}

# Nodes: one role for both node groups.
data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name               = "${var.cluster_name}-node"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
    "AmazonSSMManagedInstanceCore",
  ])

  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

# Launch templates: encrypted gp3 root volumes and IMDSv2 only, one hop (pods
# cannot borrow the node's credentials; add-ons get theirs through EKS Pod
# Identity).
resource "aws_launch_template" "node" {
  for_each = {
    system = { volume_size = 100, iops = null, throughput = null }
    gpu    = { volume_size = var.gpu_root_volume_size_gib, iops = 6000, throughput = 500 }
  }

  name_prefix            = "${var.cluster_name}-${each.key}-"
  update_default_version = true

  block_device_mappings {
    device_name = "/dev/xvda"

    ebs {
      volume_size           = each.value.volume_size
      volume_type           = "gp3"
      iops                  = each.value.iops
      throughput            = each.value.throughput
      encrypted             = true
      kms_key_id            = aws_kms_key.this.arn
      delete_on_termination = true
    }
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.cluster_name}-${each.key}" })
  }

  tags = var.tags
}

resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "system"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  version         = var.kubernetes_version
  ami_type        = "AL2023_x86_64_STANDARD"
  capacity_type   = "ON_DEMAND"
  instance_types  = var.system_node_instance_types

  launch_template {
    id      = aws_launch_template.node["system"].id
    version = aws_launch_template.node["system"].latest_version
  }

  scaling_config {
    min_size     = var.system_node_count.min
    desired_size = var.system_node_count.desired
    max_size     = var.system_node_count.max
  }

  update_config {
    max_unavailable = 1
  }

  labels = {
    "inferscale.io/pool" = "system"
  }

  tags = var.tags

  depends_on = [aws_iam_role_policy_attachment.node]

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }
}

# GPU nodes: the EKS-optimized AL2023 NVIDIA AMI (driver and container
# toolkit installed; the device plugin comes from Helm). The label and the
# taint are what the chart's worker nodeSelector and tolerations expect.
resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  version         = var.kubernetes_version
  ami_type        = "AL2023_x86_64_NVIDIA"
  capacity_type   = var.gpu_capacity_type
  instance_types  = [var.gpu_instance_type]

  launch_template {
    id      = aws_launch_template.node["gpu"].id
    version = aws_launch_template.node["gpu"].latest_version
  }

  scaling_config {
    min_size     = var.gpu_node_count.min
    desired_size = var.gpu_node_count.desired
    max_size     = var.gpu_node_count.max
  }

  update_config {
    max_unavailable = 1
  }

  labels = {
    "inferscale.io/pool"     = "gpu"
    "nvidia.com/gpu.present" = "true"
  }

  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  tags = var.tags

  depends_on = [aws_iam_role_policy_attachment.node]

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }
}
