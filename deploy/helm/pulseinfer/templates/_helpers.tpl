{{/*
Names. The fullname is kept to 40 characters: a StatefulSet's pods get "-N" and its
controller-revision-hash label value (pod name + hash) must stay within 63.
*/}}
{{- define "pulseinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "pulseinfer.fullname" -}}
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

{{- define "pulseinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The node StatefulSet, and its headless Service (the gateways' dns: target) */}}
{{- define "pulseinfer.node.fullname" -}}
{{- printf "%s-node" (include "pulseinfer.fullname" .) }}
{{- end }}

{{- define "pulseinfer.node.metricsName" -}}
{{- printf "%s-node-metrics" (include "pulseinfer.fullname" .) }}
{{- end }}

{{- define "pulseinfer.gateway.fullname" -}}
{{- printf "%s-gateway" (include "pulseinfer.fullname" .) }}
{{- end }}

{{/* The headless Service's DNS name: resolves to every ready node pod's IP */}}
{{- define "pulseinfer.node.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "pulseinfer.node.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "pulseinfer.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "pulseinfer.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pulseinfer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Selector labels: call with (dict "ctx" $ "component" "node"|"gateway") */}}
{{- define "pulseinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pulseinfer.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Standard labels: call with (dict "ctx" $ "component" "node"|"gateway") */}}
{{- define "pulseinfer.labels" -}}
helm.sh/chart: {{ include "pulseinfer.chart" .ctx }}
{{ include "pulseinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pulseinfer
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* The pod's securityContext from a component's securityContext values */}}
{{- define "pulseinfer.podSecurityContext" -}}
runAsUser: {{ .runAsUser }}
runAsGroup: {{ .runAsGroup }}
runAsNonRoot: {{ ne (int .runAsUser) 0 }}
fsGroup: {{ .fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* HOME and TMPDIR on the /tmp emptyDir (Triton's kernel cache, joined model files), then extraEnv */}}
{{- define "pulseinfer.env" -}}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* TLS flags (both components mount the Secret at /etc/pulseinfer/tls) */}}
{{- define "pulseinfer.tlsArgs" -}}
- --tls-cert
- /etc/pulseinfer/tls/tls.crt
- --tls-key
- /etc/pulseinfer/tls/tls.key
- --tls-ca
- /etc/pulseinfer/tls/ca.crt
{{- end }}

{{- define "pulseinfer.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
