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
{{- $peers := list }}
{{- range $i := until (int .Values.etcd.replicaCount) }}
{{- $peers = append $peers (printf "%s-%d=http://%s-%d.%s.%s.svc.%s:2380" $fullname $i $fullname $i $headless $.Release.Namespace $.Values.clusterDomain) }}
{{- end }}
{{- join "," $peers }}
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
