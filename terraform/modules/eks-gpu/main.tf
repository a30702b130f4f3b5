# Zones come from an allowlist of names (var.availability_zones, or the
# region's zones a-f), so a zone AWS adds later never enters by itself.
data "aws_availability_zones" "available" {
  state = "available"

  filter {
    name   = "zone-name"
    values = local.zone_candidates
  }

  filter {
    name   = "opt-in-status"
    values = ["opt-in-not-required"]
  }
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

locals {
  zone_candidates = length(var.availability_zones) > 0 ? var.availability_zones : [
    for letter in ["a", "b", "c", "d", "e", "f"] : "${data.aws_region.current.name}${letter}"
  ]
  azs = (length(var.availability_zones) > 0
    ? var.availability_zones
    : slice(sort(data.aws_availability_zones.available.names), 0, var.availability_zone_count)
  )

  # /20 per subnet: private subnets first (nodes and pods: the VPC CNI gives
  # every pod a VPC address), public ones (load balancers, NAT) after them.
  private_subnets = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 4, i)]
  public_subnets  = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 4, i + 8)]

  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  region     = data.aws_region.current.name

  cluster_log_group = "/aws/eks/${var.cluster_name}/cluster"
  flow_log_group    = "/aws/vpc/${var.cluster_name}/flow-logs"
}

# One customer-managed key for the cluster's Secrets envelope encryption,
# the log groups, the node volumes and the image repositories.
resource "aws_kms_key" "this" {
  description             = "${var.cluster_name}: EKS secrets, logs, EBS and ECR"
  deletion_window_in_days = 30
  enable_key_rotation     = true
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.cluster_name}"
  target_key_id = aws_kms_key.this.key_id
}

# In a key policy, resources = ["*"] means "this key" and nothing else; the
# account-root statement is the standard one that lets IAM policies grant use
# of the key (without it the key could become unmanageable).
data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109:Key policy: "*" is the key itself; the account-root statement is AWS's default key policy.
  #checkov:skip=CKV_AWS_111:Key policy: "*" is the key itself; write access is limited to the account and the logs/autoscaling services.
  #checkov:skip=CKV_AWS_356:Key policy: "*" is the key itself (a key policy cannot name another resource).

  statement {
    sid       = "AccountAdministration"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }

  statement {
    sid = "CloudWatchLogs"
    actions = [
      "kms:Encrypt*",
      "kms:Decrypt*",
      "kms:ReEncrypt*",
      "kms:GenerateDataKey*",
      "kms:Describe*",
    ]
    resources = ["*"]

    principals {
      type        = "Service"
      identifiers = ["logs.${local.region}.amazonaws.com"]
    }

    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values = [
        "arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:${local.cluster_log_group}",
        "arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:${local.flow_log_group}",
      ]
    }
  }

  # Encrypted EBS volumes of the node groups are created by the EC2 Auto
  # Scaling service-linked role.
  statement {
    sid = "AutoScalingVolumes"
    actions = [
      "kms:Encrypt",
      "kms:Decrypt",
      "kms:ReEncrypt*",
      "kms:GenerateDataKey*",
      "kms:DescribeKey",
    ]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"]
    }
  }

  statement {
    sid       = "AutoScalingGrants"
    actions   = ["kms:CreateGrant"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"]
    }

    condition {
      test     = "Bool"
      variable = "kms:GrantIsForAWSResource"
      values   = ["true"]
    }
  }
}
