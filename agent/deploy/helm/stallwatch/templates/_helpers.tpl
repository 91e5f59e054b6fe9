{{/* The labels every object has (the kustomize base's). */}}
{{- define "stallwatch.labels" -}}
app.kubernetes.io/name: stallwatch
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
