{{/* The chart's name: `nameOverride`, else the chart's. */}}
{{- define "stallwatch.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The objects' name: `fullnameOverride`; else the release's name when it
contains the chart's name (`helm install stallwatch ...`: `stallwatch`,
the kustomize base's names), else RELEASE-NAME.
*/}}
{{- define "stallwatch.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "stallwatch.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The labels every object has (the kustomize base's). */}}
{{- define "stallwatch.labels" -}}
app.kubernetes.io/name: {{ include "stallwatch.name" . }}
{{- end -}}

{{/* The service account the pods run as. */}}
{{- define "stallwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "stallwatch.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* Whether the agent asks the API server (`kubernetes` is not off). */}}
{{- define "stallwatch.kubernetes" -}}
{{- if ne (lower (toString .Values.kubernetes)) "off" }}true{{ end -}}
{{- end -}}

{{/*
The image: REGISTRY/REPOSITORY, then @DIGEST if given, else :TAG (the
chart's appVersion when empty).
*/}}
{{- define "stallwatch.image" -}}
{{- $repository := .Values.image.repository -}}
{{- with .Values.image.registry }}{{ $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}{{ end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/* The capabilities the agent uses, exactly (components/capabilities). */}}
{{- define "stallwatch.securityContext" -}}
{{- if .Values.privileged -}}
privileged: true
{{- else -}}
privileged: false
allowPrivilegeEscalation: false
seccompProfile:
  type: Unconfined
capabilities:
  drop: [ALL]
  add: [BPF, PERFMON, SYS_ADMIN, SYS_PTRACE, SYS_RESOURCE]
{{- end -}}
{{- end -}}

{{- define "stallwatch.config" -}}
{{- .Values.config | default (.Files.Get "files/config.toml") -}}
{{- end -}}
