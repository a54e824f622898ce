{{/* The chart name, or nameOverride. */}}
{{- define "tailnet-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object names: fullnameOverride, the release name when it contains the chart name, else <release>-<chart>. */}}
{{- define "tailnet-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The selector labels (immutable in a Deployment: never add to them). */}}
{{- define "tailnet-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tailnet-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller-manager
{{- end }}

{{/* The recommended labels of every object but the component; pass (dict "ctx" $ "component" "rbac"). */}}
{{- define "tailnet-operator.labels" -}}
app.kubernetes.io/name: {{ include "tailnet-operator.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: tailnet-operator
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* What the ServiceMonitor selects: the metrics Service of this release. */}}
{{- define "tailnet-operator.labels.selectMetrics" -}}
app.kubernetes.io/name: {{ include "tailnet-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: metrics
{{- end }}

{{- define "tailnet-operator.image" -}}
{{- .Values.image.repository }}{{ with .Values.image.tag }}:{{ . }}{{ end }}
{{- end }}

{{/* The Lease the manager elects on (ManagerOptions.leader_election_id; no flag changes it). */}}
{{- define "tailnet-operator.leaseName" -}}
tailnet-operator
{{- end }}

{{/* Combinations that cannot work: each fails the render with the reason and the fix. */}}
{{- define "tailnet-operator.guards" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail (printf "replicaCount=%d needs leaderElection.enabled=true: without a leader every replica reconciles and they overwrite each other; set replicaCount=1 or enable leader election" (int .Values.replicaCount)) }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (ge (int .Values.podDisruptionBudget.minAvailable) (int .Values.replicaCount)) }}
{{- fail (printf "podDisruptionBudget.minAvailable=%d with replicaCount=%d would block every node drain: raise replicaCount above minAvailable or set podDisruptionBudget.enabled=false" (int .Values.podDisruptionBudget.minAvailable) (int .Values.replicaCount)) }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled }}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled: both would scrape every operator pod twice; enable one" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.service.enabled=true: the ServiceMonitor selects the metrics Service; or use metrics.podMonitor instead" }}
{{- end }}
{{- if eq (int .Values.metrics.port) (int .Values.probes.port) }}
{{- fail (printf "metrics.port and probes.port are both %d: the manager binds each on its own port" (int .Values.probes.port)) }}
{{- end }}
{{- end }}
