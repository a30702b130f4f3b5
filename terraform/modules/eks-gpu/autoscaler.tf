# Node autoscaling: the Kubernetes cluster autoscaler (installed by the root
# module with Helm) resizes the managed node groups' Auto Scaling groups when
# pods cannot be scheduled (a new worker needs a GPU) or nodes stay unneeded.
# It reads AWS credentials through EKS Pod Identity, like the EBS CSI driver
# (addons.tf), bound to its ServiceAccount kube-system/cluster-autoscaler.

locals {
  cluster_autoscaler_namespace       = "kube-system"
  cluster_autoscaler_service_account = "cluster-autoscaler"

  # GPUs per node of each allowed instance type (the root's validation lists them).
  gpus_per_instance = {
    "p5.4xlarge"    = 1
    "p5.48xlarge"   = 8
    "p5e.48xlarge"  = 8
    "p5en.48xlarge" = 8
  }

  # Auto-discovery: the autoscaler manages the groups tagged with both (EKS
  # puts them on managed node groups' Auto Scaling groups itself; they are
  # written here too so that discovery does not depend on that).
  autoscaler_discovery_tags = {
    "k8s.io/cluster-autoscaler/enabled"             = "true"
    "k8s.io/cluster-autoscaler/${var.cluster_name}" = "owned"
  }

  # What a GPU node will look like, for scaling up from zero nodes (nothing
  # to copy labels, taints and capacity from): the labels and taint the chart's
  # workers select and tolerate, and the node's GPUs.
  gpu_node_template_tags = {
    "k8s.io/cluster-autoscaler/node-template/label/inferscale.io/pool"     = "gpu"
    "k8s.io/cluster-autoscaler/node-template/label/nvidia.com/gpu.present" = "true"
    "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"         = "true:NoSchedule"
    "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu"     = tostring(local.gpus_per_instance[var.gpu_instance_type])
  }

  autoscaler_asg_tags = var.enable_cluster_autoscaler ? merge(
    { for k, v in local.autoscaler_discovery_tags : "system/${k}" => { group = "system", key = k, value = v } },
    { for k, v in merge(local.autoscaler_discovery_tags, local.gpu_node_template_tags) : "gpu/${k}" => { group = "gpu", key = k, value = v } },
  ) : {}

  node_group_asgs = {
    system = aws_eks_node_group.system.resources[0].autoscaling_groups[0].name
    gpu    = aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name
  }
}

resource "aws_autoscaling_group_tag" "autoscaler" {
  for_each = local.autoscaler_asg_tags

  autoscaling_group_name = local.node_group_asgs[each.value.group]

  tag {
    key                 = each.value.key
    value               = each.value.value
    propagate_at_launch = false
  }
}

data "aws_iam_policy_document" "cluster_autoscaler_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }
  }
}

# The cluster autoscaler's permissions (its AWS documentation's minimal set):
# read the groups, instance types and node groups; resize and shrink only the
# groups of this cluster (tagged owned, named as EKS names managed groups).
data "aws_iam_policy_document" "cluster_autoscaler" {
  statement {
    sid = "Describe"
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeAutoScalingInstances",
      "autoscaling:DescribeLaunchConfigurations",
      "autoscaling:DescribeScalingActivities",
      "autoscaling:DescribeTags",
      "ec2:DescribeImages",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:GetInstanceTypesFromInstanceRequirements",
    ]
    resources = ["*"]
  }

  statement {
    sid       = "DescribeNodegroups"
    actions   = ["eks:DescribeNodegroup"]
    resources = ["arn:${local.partition}:eks:${local.region}:${local.account_id}:nodegroup/${var.cluster_name}/*"]
  }

  statement {
    sid = "ScaleThisClustersGroups"
    actions = [
      "autoscaling:SetDesiredCapacity",
      "autoscaling:TerminateInstanceInAutoScalingGroup",
    ]
    resources = ["arn:${local.partition}:autoscaling:${local.region}:${local.account_id}:autoScalingGroup:*:autoScalingGroupName/eks-*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/k8s.io/cluster-autoscaler/${var.cluster_name}"
      values   = ["owned"]
    }
  }
}

resource "aws_iam_role" "cluster_autoscaler" {
  count = var.enable_cluster_autoscaler ? 1 : 0

  name               = "${var.cluster_name}-cluster-autoscaler"
  assume_role_policy = data.aws_iam_policy_document.cluster_autoscaler_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy" "cluster_autoscaler" {
  count = var.enable_cluster_autoscaler ? 1 : 0

  name   = "cluster-autoscaler"
  role   = aws_iam_role.cluster_autoscaler[0].id
  policy = data.aws_iam_policy_document.cluster_autoscaler.json
}

resource "aws_eks_pod_identity_association" "cluster_autoscaler" {
  count = var.enable_cluster_autoscaler ? 1 : 0

  cluster_name    = aws_eks_cluster.this.name
  namespace       = local.cluster_autoscaler_namespace
  service_account = local.cluster_autoscaler_service_account
  role_arn        = aws_iam_role.cluster_autoscaler[0].arn
  tags            = var.tags

  depends_on = [aws_eks_addon.pod_identity_agent]
}
