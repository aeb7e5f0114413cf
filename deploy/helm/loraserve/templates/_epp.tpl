{{/*
The endpoint picker's configuration for loraserve executors (an EndpointPickerConfig of the llm-d
router's EPP): it scrapes /metrics on each executor's HTTP port, reads them through the engine
config named loraserve (the pods' llm-d.ai/engine-type label picks it; the names are
loraserve/metrics.py ENGINE_CONFIG) and scores by queue, KV-cache use and LoRA affinity
(running_lora_adapters: the adapters resident in GPU slots). The weights are those
benchmarks/fleet_sim.py simulates (EPP_WEIGHTS).
*/}}
{{- define "loraserve.eppConfig" -}}
apiVersion: {{ .Values.inferencePool.configApiVersion }}
kind: EndpointPickerConfig
plugins:
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
  - type: core-metrics-extractor
    parameters:
      engineLabelKey: llm-d.ai/engine-type
      engineConfigs:
        - name: loraserve
          queuedRequestsSpec: loraserve_executor_waiting_sequences
          runningRequestsSpec: loraserve_executor_running_sequences
          kvUsageSpec: loraserve_executor_kv_cache_usage_ratio
          loraSpec: loraserve_lora_requests_info
          cacheInfoSpec: loraserve_executor_cache_config_info
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: lora-affinity-scorer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 1
      - pluginRef: kv-cache-utilization-scorer
        weight: 1
      - pluginRef: lora-affinity-scorer
        weight: 2
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
{{- end }}

{{/* Values for the llm-d router's inferencepool chart: its EPP runs the configuration above and
watches this chart's InferencePool (the --pool-name flag); its own InferencePool (the chart
always renders one, named after its release) selects the same executors and carries no route. */}}
{{- define "loraserve.routerValues" -}}
inferenceExtension:
  pluginsConfigFile: loraserve-plugins.yaml
  pluginsCustomConfig:
    loraserve-plugins.yaml: |
      {{- include "loraserve.eppConfig" . | nindent 6 }}
  flags:
    pool-name: {{ include "loraserve.inferencePoolName" . }}
  failureMode: {{ .Values.inferencePool.endpointPicker.failureMode }}
  extProcPort: {{ .Values.inferencePool.endpointPicker.port }}
inferencePool:
  targetPorts:
    - number: {{ .Values.executor.httpPort }}
  modelServers:
    matchLabels:
      {{- include "loraserve.selectorLabels" (list . "executor") | nindent 6 }}
      {{- include "loraserve.engineTypeLabel" . | nindent 6 }}
{{- end }}
