{{- define "loraserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; components append -store, -executor, -redis (kept under 63). */}}
{{- define "loraserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* Selector labels of one component: include "loraserve.selectorLabels" (list . "store") */}}
{{- define "loraserve.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "loraserve.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "loraserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "loraserve.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "loraserve.fullname" .)) }}
{{- end }}

{{- define "loraserve.hasStoreToken" -}}
{{- if or .Values.auth.storeAdminToken .Values.auth.existingSecret }}true{{ end }}
{{- end }}

{{- /* "true" when the store has a Redis: then the registry lives there and stores can be replicas */ -}}
{{- define "loraserve.storeRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.existingSecret }}true{{ end }}
{{- end }}

{{- define "loraserve.hasExecutorToken" -}}
{{- if or .Values.auth.executorAdminToken .Values.auth.existingSecret }}true{{ end }}
{{- end }}

{{/* The model volume (model.volume), mounted read-only in the store and every executor. */}}
{{- define "loraserve.modelVolume" -}}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}

{{- define "loraserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/* The TLS Secret (tls.existingSecret), mounted read-only in the store and every executor. */}}
{{- define "loraserve.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
{{- end }}

{{- define "loraserve.tlsMount" -}}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}

{{/* Settings that only make sense together; checked at install time. */}}
{{- define "loraserve.validate" -}}
{{- if and (or .Values.model.name .Values.model.path) (not (and .Values.model.name .Values.model.path)) }}
{{- fail "model.name and model.path go together: set both (and model.volume), or neither for the embedded SmolLM2" }}
{{- end }}
{{- if and (gt (int .Values.executor.tpSize) 1) (gt (int .Values.executor.epSize) 1) }}
{{- fail "executor.epSize > 1 needs executor.tpSize 1: expert parallelism replicates attention on every rank" }}
{{- end }}
{{- $ranks := mul (int .Values.executor.tpSize) (int .Values.executor.epSize) }}
{{- if and (gt (int .Values.executor.gpu.count) 0) (lt (int .Values.executor.gpu.count) (int $ranks)) }}
{{- fail (printf "executor.gpu.count %d is fewer than the executor's %d ranks (tpSize x epSize): each rank needs its own GPU" (int .Values.executor.gpu.count) (int $ranks)) }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.enabled needs tls.existingSecret: a Secret with tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if and .Values.inferencePool.enabled (not (int .Values.executor.httpPort)) }}
{{- fail "inferencePool.enabled needs executor.httpPort: the gateway routes to, and the endpoint picker scrapes /metrics on, the executors' HTTP port" }}
{{- end }}
{{- if and (gt (int .Values.store.replicaCount) 1) (not (include "loraserve.storeRedis" .)) }}
{{- fail "store.replicaCount > 1 needs a Redis (redis.enabled, redis.url or redis.existingSecret): the stores share their registry there" }}
{{- end }}
{{- if and .Values.executor.enableDora .Values.executor.fullyShardedLoras (gt (int .Values.executor.tpSize) 1) }}
{{- fail "executor.enableDora is not served with executor.fullyShardedLoras under executor.tpSize > 1: a DoRA norm needs each rank's whole LoRA rank (drop one of the two)" }}
{{- end }}
{{- with .Values.executor.kvEvents }}
{{- if and .enabled .replayPort (eq (int .replayPort) (int .port)) }}
{{- fail (printf "executor.kvEvents.replayPort %d is executor.kvEvents.port: the replay socket needs a port of its own" (int .replayPort)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The label the endpoint picker chooses an engine config by (loraserve/metrics.py ENGINE_TYPE_LABEL). */}}
{{- define "loraserve.engineTypeLabel" -}}
llm-d.ai/engine-type: loraserve
{{- end }}

{{- define "loraserve.inferencePoolName" -}}
{{- .Values.inferencePool.name | default (include "loraserve.fullname" .) }}
{{- end }}

{{- define "loraserve.endpointPickerService" -}}
{{- .Values.inferencePool.endpointPicker.service | default (printf "%s-epp" (printf "%s-router" .Release.Name | lower | trunc 40)) }}
{{- end }}
