{{/* Kubernetes inference gateways (docs/inference-gateway.md): per pool an InferencePool
     (inference.networking.k8s.io/v1) and upstream's endpoint picker (EPP), deployed as the
     Gateway API Inference Extension's own chart (config/charts/inferencepool, v1.5.0) does:
     the same flags, RBAC, Service ports and gRPC probes. */}}

{{- define "dflash.inference.enabled" -}}
{{- if has .Values.inferenceGateway.mode (list "inference" "both") }}true{{ end -}}
{{- end -}}

{{/* Our own gateway (Deployment, Service, ConfigMap, ...) is rendered unless mode inference. */}}
{{- define "dflash.gateway.enabled" -}}
{{- if ne .Values.inferenceGateway.mode "inference" }}true{{ end -}}
{{- end -}}

{{/* The InferencePool of a pool context: its workers' name (at most 63 characters). */}}
{{- define "dflash.inference.poolName" -}}
{{- include "dflash.worker.fullname" . -}}
{{- end -}}

{{- define "dflash.inference.eppName" -}}
{{- printf "%s-epp" (include "dflash.worker.fullname" . | trunc 59 | trimSuffix "-") -}}
{{- end -}}

{{/* The EPP's engine config name for a pool's engine (its core-metrics-extractor's built-in
     engineConfigs at v1.5.0: vllm, sglang, trtllm-serve). The embedded worker speaks vLLM's
     names (engine/worker/metrics.py). */}}
{{- define "dflash.inference.eppEngine" -}}
{{- $engines := dict "vllm" "vllm" "embedded" "vllm" "sglang" "sglang" "trtllm" "trtllm-serve" -}}
{{- $engine := get $engines .Values.mode -}}
{{- if not $engine -}}
{{- fail (printf "%s %s: upstream's endpoint picker (v1.5.0) has no metric names for this engine; serve it with inferenceGateway.mode=dflash" (include "dflash.inference.where" .) .Values.mode) -}}
{{- end -}}
{{- $engine -}}
{{- end -}}

{{- define "dflash.inference.where" -}}
{{- with include "dflash.poolName" . }}pools[{{ . }}].engine{{ else }}mode{{ end -}}
{{- end -}}

{{/* Where the EPP scrapes a pool's pods: trtllm-serve's Prometheus text is at
     /prometheus/metrics (its /metrics is JSON), every other engine's at /metrics. */}}
{{- define "dflash.inference.metricsPath" -}}
{{- if eq .Values.mode "trtllm" }}/prometheus/metrics{{ else }}/metrics{{ end -}}
{{- end -}}

{{/* Labels that pick exactly one pool's serving pods: the workers' selector labels (a
     multi-node group's leader only: its followers are component worker-node). */}}
{{- define "dflash.inference.podSelector" -}}
{{- include "dflash.selectorLabels" (dict "ctx" . "component" "worker") -}}
{{- end -}}

{{/* The EPP's EndpointPickerConfig (apiVersion inference.networking.x-k8s.io/v1alpha1): the
     scorers and weights of upstream's default-plugins.yaml, the metrics data source at the
     pool's path, and the core metrics extractor set to the pool's engine (the metric-name
     flags are refused by the v1.5.0 binary: engine configs replace them). */}}
{{- define "dflash.inference.eppConfig" -}}
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: http
    path: {{ include "dflash.inference.metricsPath" . | quote }}
    insecureSkipVerify: true
- type: core-metrics-extractor
  parameters:
    defaultEngine: {{ include "dflash.inference.eppEngine" . | quote }}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
{{- end -}}

{{/* Combinations that cannot work, refused at `helm template` with the value named. */}}
{{- define "dflash.inference.guards" -}}
{{- $ig := .Values.inferenceGateway -}}
{{- $g := .Values.gateway -}}
{{- $mode := $ig.mode -}}
{{- if and (eq $mode "inference") (not $ig.parentRefs) -}}
{{- fail "inferenceGateway.parentRefs: with inferenceGateway.mode=inference there is no dflash gateway, so name the Gateway the InferencePools are routed by ([{name: ..., namespace: ...}])" -}}
{{- end -}}
{{- if and (eq $mode "dflash") (or $ig.parentRefs $ig.testAddress $ig.networkPolicyPeers) -}}
{{- fail "inferenceGateway.parentRefs, testAddress and networkPolicyPeers need inferenceGateway.mode inference or both (mode dflash renders no InferencePool)" -}}
{{- end -}}
{{- if and (eq $ig.provider "gke") $ig.requestTimeout -}}
{{- fail "inferenceGateway.requestTimeout: GKE's Gateway ignores route timeouts; the GCPBackendPolicy on each InferencePool keeps requests open gateway.requestTimeoutSeconds + 30 s, so set gateway.requestTimeoutSeconds" -}}
{{- end -}}
{{- if eq $mode "inference" -}}
{{- if $g.rateLimits.redis.deploy -}}
{{- fail "gateway.rateLimits.redis.deploy: the Redis holds the dflash gateway's tenant usage; inferenceGateway.mode=inference renders no dflash gateway" -}}
{{- end -}}
{{- if $g.apiKeys.tenants -}}
{{- fail "gateway.apiKeys.tenants: tenants are the dflash gateway's; inferenceGateway.mode=inference renders no dflash gateway (use mode both)" -}}
{{- end -}}
{{- range $key := list "ingress" "httpRoute" "autoscaling" -}}
{{- if (index $g $key).enabled -}}
{{- fail (printf "gateway.%s.enabled: inferenceGateway.mode=inference renders no dflash gateway; use mode both, or route through inferenceGateway.parentRefs" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if include "dflash.inference.enabled" . -}}
{{- if and .Values.networkPolicy.enabled (not $ig.networkPolicyPeers) -}}
{{- fail "inferenceGateway.networkPolicyPeers: networkPolicy.enabled admits only known peers to the workers; name the inference Gateway's proxies (pods, namespaces or, on GKE, the proxy-only subnet as an ipBlock)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Per pool (a pool context): what its InferencePool needs of its workers. */}}
{{- define "dflash.inference.poolGuards" -}}
{{- if .Values.worker.requireApiKey -}}
{{- $where := ternary (printf "pools[%s].worker.requireApiKey" (include "dflash.poolName" .)) "worker.requireApiKey" (not (empty (include "dflash.poolName" .))) -}}
{{- fail (printf "%s: with inferenceGateway.mode=%s the Gateway sends clients' requests straight to the workers, which would ask them for the worker key; set it to false and authenticate at the Gateway" $where .Values.inferenceGateway.mode) -}}
{{- end -}}
{{- end -}}
