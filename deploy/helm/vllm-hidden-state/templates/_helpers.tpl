{{/*
Expand the name of the chart.
*/}}
{{- define "vllm-hidden-state.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "vllm-hidden-state.fullname" -}}
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

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "vllm-hidden-state.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "vllm-hidden-state.labels" -}}
helm.sh/chart: {{ include "vllm-hidden-state.chart" . }}
{{ include "vllm-hidden-state.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels
*/}}
{{- define "vllm-hidden-state.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-hidden-state.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "vllm-hidden-state.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vllm-hidden-state.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image references.
*/}}
{{- define "vllm-hidden-state.vllmImage" -}}
{{- printf "%s:%s" .Values.image.vllm.repository .Values.image.vllm.tag }}
{{- end }}

{{- define "vllm-hidden-state.proxyImage" -}}
{{- printf "%s:%s" .Values.image.proxy.repository .Values.image.proxy.tag }}
{{- end }}

{{/*
The model name clients send.
*/}}
{{- define "vllm-hidden-state.servedModelName" -}}
{{- default .Values.model .Values.servedModelName }}
{{- end }}

{{/*
Secret holding the Hugging Face token; empty when there is none.
*/}}
{{- define "vllm-hidden-state.hfTokenSecretName" -}}
{{- if .Values.hfToken.existingSecret }}
{{- .Values.hfToken.existingSecret }}
{{- else if .Values.hfToken.value }}
{{- printf "%s-hf-token" (include "vllm-hidden-state.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Secret holding the proxy's API key; empty when proxy.apiKey is off.
*/}}
{{- define "vllm-hidden-state.apiKeySecretName" -}}
{{- if .Values.proxy.apiKey.enabled }}
{{- if .Values.proxy.apiKey.existingSecret }}
{{- .Values.proxy.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "vllm-hidden-state.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The generated API key, base64: the one the release's Secret already holds (so an upgrade keeps
it; `lookup` finds nothing offline, e.g. under `helm template`), else a new random one.
*/}}
{{- define "vllm-hidden-state.apiKeyData" -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "vllm-hidden-state.apiKeySecretName" .) }}
{{- $kept := dig "data" .Values.proxy.apiKey.secretKey "" ($existing | default dict) }}
{{- if $kept }}
{{- $kept }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}

{{/*
A probe from values: as given, with the chart's handler when it names none.
Call with (dict "probe" <values probe> "handler" <default handler>).
*/}}
{{- define "vllm-hidden-state.probe" -}}
{{- $probe := deepCopy .probe }}
{{- if not (or (hasKey $probe "exec") (hasKey $probe "httpGet") (hasKey $probe "tcpSocket") (hasKey $probe "grpc")) }}
{{- $probe = merge $probe .handler }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{/*
The chart's handler for vLLM's probes: /health over loopback, from inside the container,
within the probe's timeoutSeconds (Kubernetes' default 1 when unset).
*/}}
{{- define "vllm-hidden-state.vllmHealthHandler" -}}
{{- $code := printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=%d)" (int .root.Values.vllm.port) (int (.probe.timeoutSeconds | default 1)) }}
{{- dict "exec" (dict "command" (list "python3" "-c" $code)) | toYaml }}
{{- end }}

{{/*
Checks that the schema cannot express. Rendered (empty) by the Deployment.
*/}}
{{- define "vllm-hidden-state.validate" -}}
{{- if or (eq (clean .Values.ringDir) "/dev/shm") (hasPrefix "/dev/shm/" (clean .Values.ringDir)) (eq (clean .Values.ringDir) .Values.modelCache.mountPath) }}
{{- fail (printf "ringDir %q: the ring volume is mounted there, so it must be outside /dev/shm (vLLM's own /dev/shm volume, not shared with the proxy) and not the model cache" .Values.ringDir) }}
{{- end }}
{{- if eq (int .Values.vllm.port) (int .Values.proxy.port) }}
{{- fail "vllm.port and proxy.port must differ: both containers share the pod's network namespace" }}
{{- end }}
{{- $gpus := dig "limits" "nvidia.com/gpu" "" (.Values.vllm.resources | default dict) }}
{{- if and (ne (toString $gpus) "") (gt (int .Values.tensorParallelSize) (int $gpus)) }}
{{- fail (printf "tensorParallelSize %d needs at least %d GPUs, but vllm.resources.limits[\"nvidia.com/gpu\"] is %v" (int .Values.tensorParallelSize) (int .Values.tensorParallelSize) $gpus) }}
{{- end }}
{{- $stopping := add (int .Values.preStopSleepSeconds) (ceil .Values.proxy.drainTimeout) }}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $stopping) }}
{{- fail (printf "terminationGracePeriodSeconds %d must exceed preStopSleepSeconds %d + proxy.drainTimeout %v = %d: kubelet would kill the pod while the proxy still drains requests (and vLLM, whose preStop sleeps that long, before it could shut down)" (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds) .Values.proxy.drainTimeout (int $stopping)) }}
{{- end }}
{{- range $name, $probe := dict "vllm.startupProbe" .Values.vllm.startupProbe "vllm.livenessProbe" .Values.vllm.livenessProbe "vllm.readinessProbe" .Values.vllm.readinessProbe "proxy.startupProbe" .Values.proxy.startupProbe "proxy.livenessProbe" .Values.proxy.livenessProbe "proxy.readinessProbe" .Values.proxy.readinessProbe }}
{{- $handlers := 0 }}
{{- range $handler := list "exec" "httpGet" "tcpSocket" "grpc" }}
{{- if hasKey ($probe | default dict) $handler }}
{{- $handlers = add1 $handlers }}
{{- end }}
{{- end }}
{{- if gt $handlers 1 }}
{{- fail (printf "%s has %d handlers (exec, httpGet, tcpSocket, grpc): a probe takes one. Helm merges your probe with the chart's default, so set the ones you do not want to null" $name $handlers) }}
{{- end }}
{{- end }}
{{- if .Values.proxy.apiKey.enabled }}
{{- range .Values.proxy.env }}
{{- if has .name (list "HIDDEN_STATE_PROXY_API_KEY" "VLLM_API_KEY") }}
{{- fail (printf "proxy.env sets %s while proxy.apiKey.enabled is true: the chart already gives the proxy its key; name your Secret in proxy.apiKey.existingSecret instead" .name) }}
{{- end }}
{{- end }}
{{- else if .Values.proxy.protectMetrics }}
{{- fail "proxy.protectMetrics needs proxy.apiKey.enabled: /metrics is protected by the API key" }}
{{- end }}
{{- range .Values.vllm.env }}
{{- if and (eq .name "VLLM_PLUGINS") (hasKey . "value") (not (contains "hidden_state_hook" (toString .value))) }}
{{- fail "vllm.env sets VLLM_PLUGINS without hidden_state_hook: the worker hook would not load and no vector would ever arrive" }}
{{- end }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not .Values.autoscaling.targetCPUUtilizationPercentage) (not .Values.autoscaling.metrics) }}
{{- fail "autoscaling.enabled needs autoscaling.targetCPUUtilizationPercentage or autoscaling.metrics" }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (kindIs "invalid" .Values.podDisruptionBudget.minAvailable) (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable) }}
{{- fail "podDisruptionBudget.enabled needs minAvailable or maxUnavailable" }}
{{- end }}
{{- if .Values.serviceMonitor.enabled }}
{{- $scrape := .Values.serviceMonitor.scrapeTimeout }}
{{- $scale := get (dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0) (regexFind "[a-z]+$" $scrape) }}
{{- $scrapeSeconds := mulf (float64 (regexFind "^[0-9]+" $scrape)) $scale }}
{{- $upstream := .Values.proxy.metricsUpstreamTimeout | default 2 }}
{{- if ge (float64 $upstream) $scrapeSeconds }}
{{- fail (printf "proxy.metricsUpstreamTimeout %v must be below serviceMonitor.scrapeTimeout %s: Prometheus would give up on the scrape before the proxy gives up on vLLM's metrics and serves its own" $upstream $scrape) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.modelCache.type "existingClaim") (not .Values.modelCache.existingClaim) }}
{{- fail "modelCache.type is existingClaim but modelCache.existingClaim is empty" }}
{{- end }}
{{- end }}
