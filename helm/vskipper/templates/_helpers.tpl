{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "vskipper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "vskipper.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vskipper.operatorName" -}}
{{- printf "%s-operator" (include "vskipper.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vskipper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of the operator pod (never change on upgrade: Deployment selectors are immutable). */}}
{{- define "vskipper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vskipper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "vskipper.labels" -}}
helm.sh/chart: {{ include "vskipper.chart" . }}
{{ include "vskipper.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: vskipper
{{- end -}}

{{- define "vskipper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vskipper.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "vskipper.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}
