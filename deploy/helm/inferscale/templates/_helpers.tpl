{{/*
Names. Every object is "<fullname>-<component>"; fullname follows the usual
release-name/chart-name convention, cut to leave room for the component suffix
and for the StatefulSet pod ordinal (hostnames are DNS labels, 63 characters).
*/}}
{{- define "inferscale.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "inferscale.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "inferscale.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object names per component. */}}
{{- define "inferscale.router.fullname" -}}{{ include "inferscale.fullname" . }}-router{{- end }}
{{- define "inferscale.worker.fullname" -}}{{ include "inferscale.fullname" . }}-worker{{- end }}
{{- define "inferscale.worker.headless" -}}{{ include "inferscale.fullname" . }}-worker-headless{{- end }}
{{- define "inferscale.etcd.fullname" -}}{{ include "inferscale.fullname" . }}-etcd{{- end }}
{{- define "inferscale.etcd.headless" -}}{{ include "inferscale.fullname" . }}-etcd-headless{{- end }}
{{- define "inferscale.jaeger.fullname" -}}{{ include "inferscale.fullname" . }}-jaeger{{- end }}

{{/* Labels shared by every object. */}}
{{- define "inferscale.labels" -}}
helm.sh/chart: {{ include "inferscale.chart" . }}
app.kubernetes.io/name: {{ include "inferscale.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inferscale
{{- end }}

{{/*
Selector labels of one component: (dict "ctx" $ "component" "router").
*/}}
{{- define "inferscale.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inferscale.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "inferscale.componentLabels" -}}
{{ include "inferscale.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "inferscale.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "inferscale.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference: (dict "ctx" $ "image" .Values.router.image "registry" true).
Our own images take image.registry as a prefix; third-party ones (etcd,
Jaeger) carry their full repository. A digest, when given, wins over the tag.
*/}}
{{- define "inferscale.image" -}}
{{- $repo := .image.repository }}
{{- if and .registry .ctx.Values.image.registry }}
{{- $repo = printf "%s/%s" (trimSuffix "/" .ctx.Values.image.registry) .image.repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repo .image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .image.tag | toString) }}
{{- end }}
{{- end }}

{{/* etcd endpoints as the inferscale processes take them (host:port, comma-separated). */}}
{{- define "inferscale.etcd.endpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "%s.%s.svc.%s:2379" (include "inferscale.etcd.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- else }}
{{- required "etcd.external.endpoints is required when etcd.enabled is false" (join "," .Values.etcd.external.endpoints) }}
{{- end }}
{{- end }}

{{/* --initial-cluster for the bundled etcd: one peer URL per replica. */}}
{{- define "inferscale.etcd.initialCluster" -}}
{{- $fullname := include "inferscale.etcd.fullname" . }}
{{- $headless := include "inferscale.etcd.headless" . }}
{{- $scheme := include "inferscale.etcd.scheme" . }}
{{- $peers := list }}
{{- range $i := until (int .Values.etcd.replicaCount) }}
{{- $peers = append $peers (printf "%s-%d=%s://%s-%d.%s.%s.svc.%s:2380" $fullname $i $scheme $fullname $i $headless $.Release.Namespace $.Values.clusterDomain) }}
{{- end }}
{{- join "," $peers }}
{{- end }}

{{/*
TLS. One certificate per role (worker, router, etcdServer, etcdClient), each a
Secret in cert-manager's layout (tls.crt, tls.key, ca.crt): the one named in
tls.existingSecrets.<role>, else "<fullname>-<role>-tls" made by cert-manager.
Mounted read-only at /etc/inferscale/tls/<role in kebab case>/.
*/}}
{{- define "inferscale.tls.secretName" -}}
{{- $existing := index .ctx.Values.tls.existingSecrets .role }}
{{- if $existing }}
{{- $existing }}
{{- else }}
{{- printf "%s-%s-tls" (include "inferscale.fullname" .ctx) (kebabcase .role) }}
{{- end }}
{{- end }}

{{- define "inferscale.tls.dir" -}}
{{- printf "/etc/inferscale/tls/%s" (kebabcase .) }}
{{- end }}

{{/* "true" when etcd is spoken to over TLS: the bundled one with tls.enabled, an external one also needs etcd.external.tls. */}}
{{- define "inferscale.etcd.tls" -}}
{{- if and .Values.tls.enabled (or .Values.etcd.enabled .Values.etcd.external.tls) }}true{{ end }}
{{- end }}

{{- define "inferscale.etcd.scheme" -}}
{{- ternary "https" "http" .Values.tls.enabled }}
{{- end }}

{{/* The roles whose certificates this release needs, as a list. */}}
{{- define "inferscale.tls.roles" -}}
{{- $roles := list }}
{{- if .Values.tls.enabled }}
{{- $roles = list "worker" "router" }}
{{- if .Values.etcd.enabled }}
{{- $roles = append $roles "etcdServer" }}
{{- end }}
{{- if include "inferscale.etcd.tls" . }}
{{- $roles = append $roles "etcdClient" }}
{{- end }}
{{- end }}
{{- toJson $roles }}
{{- end }}

{{/* A Secret volume of one role's certificate: (dict "ctx" $ "role" "worker"). */}}
{{- define "inferscale.tls.volume" -}}
- name: tls-{{ kebabcase .role }}
  secret:
    secretName: {{ include "inferscale.tls.secretName" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}

{{- define "inferscale.tls.volumeMount" -}}
- name: tls-{{ kebabcase . }}
  mountPath: {{ include "inferscale.tls.dir" . }}
  readOnly: true
{{- end }}

{{/*
The environment of a process that dials workers (and, for a worker, serves
them): its own certificate, key and the CA, or the plaintext acknowledgement
(read by workers only).
*/}}
{{- define "inferscale.tls.env" -}}
{{- if .ctx.Values.tls.enabled }}
{{- $dir := include "inferscale.tls.dir" .role }}
- name: INFERSCALE_TLS_CERT
  value: {{ printf "%s/tls.crt" $dir }}
- name: INFERSCALE_TLS_KEY
  value: {{ printf "%s/tls.key" $dir }}
- name: INFERSCALE_TLS_CA
  value: {{ printf "%s/ca.crt" $dir }}
{{- else if .plaintext }}
- name: INFERSCALE_INSECURE_PLAINTEXT
  value: "true"
{{- end }}
{{- end }}

{{/* etcd client settings of routers and workers: TLS and authentication. */}}
{{- define "inferscale.etcd.env" -}}
{{- if include "inferscale.etcd.tls" . }}
{{- $dir := include "inferscale.tls.dir" "etcdClient" }}
- name: INFERSCALE_ETCD_CA
  value: {{ printf "%s/ca.crt" $dir }}
- name: INFERSCALE_ETCD_CERT
  value: {{ printf "%s/tls.crt" $dir }}
- name: INFERSCALE_ETCD_KEY
  value: {{ printf "%s/tls.key" $dir }}
{{- end }}
{{- if .Values.etcd.auth.user }}
- name: INFERSCALE_ETCD_USER
  value: {{ .Values.etcd.auth.user | quote }}
- name: INFERSCALE_ETCD_PASSWORD_FILE
  value: {{ printf "/etc/inferscale/etcd-auth/%s" .Values.etcd.auth.passwordKey }}
{{- end }}
{{- end }}

{{/* Volumes (and their mounts) a process needs for its TLS and etcd settings: (dict "ctx" $ "role" "router"). */}}
{{- define "inferscale.tls.volumes" -}}
{{- if .ctx.Values.tls.enabled }}
{{ include "inferscale.tls.volume" (dict "ctx" .ctx "role" .role) }}
{{- end }}
{{- if include "inferscale.etcd.tls" .ctx }}
{{ include "inferscale.tls.volume" (dict "ctx" .ctx "role" "etcdClient") }}
{{- end }}
{{- if .ctx.Values.etcd.auth.user }}
- name: etcd-auth
  secret:
    secretName: {{ .ctx.Values.etcd.auth.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .ctx.Values.etcd.auth.passwordKey }}
        path: {{ .ctx.Values.etcd.auth.passwordKey }}
{{- end }}
{{- end }}

{{- define "inferscale.tls.volumeMounts" -}}
{{- if .ctx.Values.tls.enabled }}
{{ include "inferscale.tls.volumeMount" .role }}
{{- end }}
{{- if include "inferscale.etcd.tls" .ctx }}
{{ include "inferscale.tls.volumeMount" "etcdClient" }}
{{- end }}
{{- if .ctx.Values.etcd.auth.user }}
- name: etcd-auth
  mountPath: /etc/inferscale/etcd-auth
  readOnly: true
{{- end }}
{{- end }}

{{/* Pod-level scheduling classes of a component: .Values.<component>. */}}
{{- define "inferscale.podClasses" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Checks across values that the schema (values.schema.json) cannot express;
included once, by the router Deployment (always rendered).
*/}}
{{- define "inferscale.validate" -}}
{{- if and (not .Values.tls.enabled) (not .Values.tls.insecurePlaintext) }}
{{- fail "tls.enabled=false serves the workers' gRPC (users' memories) and etcd in plaintext: set tls.insecurePlaintext=true to acknowledge it (a network you trust only)" }}
{{- end }}
{{- range $role := include "inferscale.tls.roles" . | fromJsonArray }}
{{- if and (not (index $.Values.tls.existingSecrets $role)) (not $.Values.tls.certManager.enabled) }}
{{- fail (printf "tls.enabled needs the %s certificate: set tls.existingSecrets.%s or tls.certManager.enabled" $role $role) }}
{{- end }}
{{- end }}
{{- $m := .Values.worker.models }}
{{- if and (eq $m.source "volume") (not $m.existingClaim) }}
{{- fail "worker.models.source=volume needs worker.models.existingClaim (a PVC holding an INFERSCALE_HOME)" }}
{{- end }}
{{- if and $m.existingClaim (ne $m.source "volume") }}
{{- fail "worker.models.existingClaim is mounted only with worker.models.source=volume" }}
{{- end }}
{{- if and (eq $m.source "image") (not $m.image.repository) }}
{{- fail "worker.models.source=image needs worker.models.image.repository" }}
{{- end }}
{{- $a := .Values.worker.autoscaling }}
{{- if $a.enabled }}
{{- if not $a.prometheus.serverAddress }}
{{- fail "worker.autoscaling.enabled needs worker.autoscaling.prometheus.serverAddress (the Prometheus KEDA queries)" }}
{{- end }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail "worker.autoscaling.minReplicas must not exceed maxReplicas" }}
{{- end }}
{{- end }}
{{- if and .Values.router.autoscaling.enabled (gt (int .Values.router.autoscaling.minReplicas) (int .Values.router.autoscaling.maxReplicas)) }}
{{- fail "router.autoscaling.minReplicas must not exceed maxReplicas" }}
{{- end }}
{{- if and .Values.etcd.auth.user (not .Values.etcd.auth.existingSecret) }}
{{- fail "etcd.auth.user needs etcd.auth.existingSecret (the Secret holding its password)" }}
{{- end }}
{{- end }}

{{/* Where traces go: otel.endpoint, else the bundled Jaeger, else nowhere (tracing off). */}}
{{- define "inferscale.otel.endpoint" -}}
{{- if .Values.otel.endpoint }}
{{- .Values.otel.endpoint }}
{{- else if .Values.jaeger.enabled }}
{{- $port := ternary 4317 4318 (eq .Values.otel.protocol "grpc") }}
{{- printf "http://%s.%s.svc.%s:%d" (include "inferscale.jaeger.fullname" .) .Release.Namespace .Values.clusterDomain $port }}
{{- end }}
{{- end }}

{{/*
OpenTelemetry environment: (dict "ctx" $ "service" "inferscale-router").
Both processes read the standard OTEL_* variables; no endpoint means no tracing.
*/}}
{{- define "inferscale.otel.env" -}}
{{- $endpoint := include "inferscale.otel.endpoint" .ctx }}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .ctx.Values.otel.protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .service | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(POD_NAME),service.instance.id=$(POD_NAME),deployment.environment=%s" .ctx.Release.Namespace .ctx.Values.otel.environment | quote }}
{{- with .ctx.Values.otel.tracesSamplerArg }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod-level security context. */}}
{{- define "inferscale.podSecurityContext" -}}
{{- toYaml .Values.securityContext.pod }}
{{- end }}

{{/* Container-level security context. */}}
{{- define "inferscale.containerSecurityContext" -}}
{{- toYaml .Values.securityContext.container }}
{{- end }}

{{/* Name of the Secret holding API keys. */}}
{{- define "inferscale.apiKeys.secretName" -}}
{{- default (printf "%s-api-keys" (include "inferscale.fullname" .)) .Values.apiKeys.existingSecret }}
{{- end }}

{{/*
Jaeger v2 all-in-one configuration, explicit rather than the binary's
built-in one: OTLP receivers only, in-memory storage of jaeger.maxTraces
traces, the UI/query API, a health endpoint; all on every interface.
*/}}
{{- define "inferscale.jaeger.config" -}}
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 0.0.0.0:13133
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 0.0.0.0:16686
    grpc:
      endpoint: 0.0.0.0:16685
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: {{ int .Values.jaeger.maxTraces }}
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 0.0.0.0:4317
      http:
        endpoint: 0.0.0.0:4318
processors:
  batch: {}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
{{- end }}
