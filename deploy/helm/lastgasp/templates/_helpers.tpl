{{- define "lastgasp.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The name every object starts with (nameOverride). */}}
{{- define "lastgasp.name" -}}
{{ default "lastgasp" .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end -}}

{{/* Labels only Helm can know: the release and the chart. */}}
{{- define "lastgasp.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
