{{/* Names: every object is "<fullname>-<component>", within the 63-character DNS limit. */}}
{{- define "dflash.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release name alone when it already names the chart ("dflash-serving-prod") or is a
     leading part of it ("dflash"): `helm install dflash` gives dflash-gateway, not
     dflash-dflash-serving-gateway. 54 characters leave room for "-gateway"/"-worker". */}}
{{- define "dflash.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if or (contains $name .Release.Name) (hasPrefix (printf "%s-" .Release.Name) (printf "%s-" $name)) -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dflash.gateway.fullname" -}}
{{- printf "%s-gateway" (include "dflash.fullname" .) -}}
{{- end -}}

{{/* A pool's workers are "<fullname>-worker-<pool>" (the fullname shortened to keep 63
     characters); the release's own, or one pool with no `pools:` list, "<fullname>-worker".
     Call with the root or a pool context (dflash.poolContexts). */}}
{{- define "dflash.worker.fullname" -}}
{{- $pool := include "dflash.poolName" . -}}
{{- if $pool -}}
{{- $base := include "dflash.fullname" . | trunc (int (sub 55 (len $pool))) | trimSuffix "-" -}}
{{- printf "%s-worker-%s" $base $pool -}}
{{- else -}}
{{- include "dflash.worker.basename" . -}}
{{- end -}}
{{- end -}}

{{/* What all pools share: the HF-token Secret, the model cache, the PodMonitor. */}}
{{- define "dflash.worker.basename" -}}
{{- printf "%s-worker" (include "dflash.fullname" .) -}}
{{- end -}}

{{/* The pool of a context: "" for the root (and for 0.2.0-style values: one unnamed pool). */}}
{{- define "dflash.poolName" -}}
{{- with (index . "pool") }}{{ .name }}{{ end -}}
{{- end -}}

{{/* Labels of every object's metadata; call with (dict "ctx" $ "component" "gateway").
     Pod templates use dflash.podLabels instead: no chart or app version there, so a chart
     bump does not roll every pod (a worker restart is a model load). */}}
{{- define "dflash.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "dflash.podLabels" . }}
{{- end -}}

{{- define "dflash.podLabels" -}}
app.kubernetes.io/part-of: dflash-serving
{{ include "dflash.selectorLabels" . }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dflash.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dflash.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- $pool := include "dflash.poolName" .ctx }}
{{- if and $pool (hasPrefix "worker" .component) }}
dflash-serving/pool: {{ $pool }}
{{- end }}
{{- end -}}

{{/* "repo:tag", the tag defaulting to the chart's appVersion. */}}
{{- define "dflash.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "dflash.embedded" -}}
{{- if eq .Values.mode "embedded" }}true{{ end -}}
{{- end -}}

{{- define "dflash.multiNode" -}}
{{- if and .Values.worker.multiNode.enabled (not (include "dflash.embedded" .)) }}true{{ end -}}
{{- end -}}

{{/* The worker's headless Service DNS name the gateway re-resolves to find every pod. */}}
{{- define "dflash.worker.dns" -}}
{{- printf "%s.%s.svc.cluster.local:%d" (include "dflash.worker.fullname" .) .Release.Namespace (int .Values.worker.port) -}}
{{- end -}}

{{- define "dflash.gateway.apiKeySecret" -}}
{{- default (printf "%s-api-keys" (include "dflash.gateway.fullname" .)) .Values.gateway.apiKeys.existingSecret -}}
{{- end -}}

{{/* Workers require the worker key only when the gateway has a Secret to hold it. */}}
{{- define "dflash.worker.keyed" -}}
{{- if and .Values.worker.requireApiKey .Values.gateway.apiKeys.enabled }}true{{ end -}}
{{- end -}}

{{- define "dflash.worker.hfTokenSecret" -}}
{{- default (printf "%s-hf-token" (include "dflash.worker.basename" .)) .Values.worker.hfToken.existingSecret -}}
{{- end -}}

{{/* ServiceAccount name of a component; call with (dict "ctx" $ "component" "worker"). */}}
{{- define "dflash.serviceAccountName" -}}
{{- $sa := (index .ctx.Values .component).serviceAccount -}}
{{- if $sa.create -}}
{{- default (printf "%s-%s" (include "dflash.fullname" .ctx) .component) $sa.name -}}
{{- else -}}
{{- default "default" $sa.name -}}
{{- end -}}
{{- end -}}

{{/* "auto" means: render when the cluster serves the CRD (helm template --api-versions). */}}
{{- define "dflash.monitoringEnabled" -}}
{{- $flag := toString .flag -}}
{{- if eq $flag "true" -}}true
{{- else if and (eq $flag "auto") (.ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind)) -}}true
{{- end -}}
{{- end -}}

{{/* Labels of a monitoring object: monitoring.labels, then the object's own labels. */}}
{{- define "dflash.monitoringLabels" -}}
{{- $labels := merge (dict) (.own | default dict) (.ctx.Values.monitoring.labels | default dict) -}}
{{- with $labels }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* PromQL matchers of this release's series. The Prometheus Operator names the job of a
     ServiceMonitor target after the Service, and of a PodMonitor target "<ns>/<podmonitor>". */}}
{{- define "dflash.gatewaySelector" -}}
{{- default (printf "namespace=\"%s\",job=\"%s\"" .Release.Namespace (include "dflash.gateway.fullname" .)) .Values.monitoring.alerts.gatewaySelector -}}
{{- end -}}

{{- define "dflash.workerSelector" -}}
{{- default (printf "namespace=\"%s\",job=\"%s/%s\"" .Release.Namespace .Release.Namespace (include "dflash.worker.basename" .)) .Values.monitoring.alerts.workerSelector -}}
{{- end -}}

{{/* The worker series of one pool (the PodMonitor copies the pod's pool label to `pool`). */}}
{{- define "dflash.poolWorkerSelector" -}}
{{- include "dflash.workerSelector" . -}}
{{- with include "dflash.poolName" . }},pool="{{ . }}"{{ end -}}
{{- end -}}

{{/* A worker's load gauges in its engine's own names (YAML: waiting, running: the selector up
     to its labels; `only`: a selector suffix that keeps one series per worker), from each
     engine's source: vLLM (and the embedded worker) vllm:num_requests_*, SGLang 0.5.23
     sglang:num_queue_reqs / num_running_reqs (the total of every priority is priority=""),
     TensorRT-LLM trtllm_num_requests_*. */}}
{{- define "dflash.engine.loadSeries" -}}
{{- if eq .Values.mode "sglang" -}}
{{- /* Either spelling: see dflash.rules.perEngine (a Prometheus 2 scrape escapes ':'). */ -}}
{waiting: '{__name__=~"sglang[:_]num_queue_reqs",', running: '{__name__=~"sglang[:_]num_running_reqs",', only: ',priority=""'}
{{- else if eq .Values.mode "trtllm" -}}
{waiting: "trtllm_num_requests_waiting{", running: "trtllm_num_requests_running{", only: ""}
{{- else -}}
{waiting: "vllm:num_requests_waiting{", running: "vllm:num_requests_running{", only: ""}
{{- end -}}
{{- end -}}

{{/* The speculative config JSON exactly as `vllm serve --speculative-config` takes it. */}}
{{- define "dflash.speculativeConfig" -}}
{{- $spec := .Values.model.speculative -}}
{{- dict "method" ($spec.method | default "dflash") "model" $spec.drafter "num_speculative_tokens" (int $spec.numSpeculativeTokens) | toJson -}}
{{- end -}}

{{/* The same for `vllm serve` itself (worker.launcher vllm): vLLM 0.33 knows no method
     "dflash2"; a DFlash2 drafter's architecture (DFlash2DraftModel) decides under "dflash". */}}
{{- define "dflash.vllmSpeculativeConfig" -}}
{{- $spec := .Values.model.speculative -}}
{{- dict "method" "dflash" "model" $spec.drafter "num_speculative_tokens" (int $spec.numSpeculativeTokens) | toJson -}}
{{- end -}}

{{/* The model name on the gateway side: what clients send. */}}
{{- define "dflash.servedModelName" -}}
{{- if include "dflash.embedded" . }}{{ .Values.embedded.servedModelName }}{{ else }}{{ .Values.model.servedModelName }}{{ end -}}
{{- end -}}

{{/* Worker replicas the PDB and the alerts can count on (autoscaling: its minimum). */}}
{{- define "dflash.worker.minReplicas" -}}
{{- if .Values.worker.autoscaling.enabled }}{{ int .Values.worker.autoscaling.minReplicas }}{{ else }}{{ int .Values.worker.replicas }}{{ end -}}
{{- end -}}

{{/* Checksum of the client keys: the rendered Secret's, or the live existing Secret's
     (`lookup`; empty under `helm template`, so GitOps renders stay stable). */}}
{{- define "dflash.gateway.apiKeysChecksum" -}}
{{- $k := .Values.gateway.apiKeys -}}
{{- if $k.existingSecret -}}
{{- $live := (lookup "v1" "Secret" .Release.Namespace $k.existingSecret).data | default dict -}}
{{- get $live $k.secretKey | sha256sum -}}
{{- else -}}
{{- $data := (include (print .Template.BasePath "/gateway-secret.yaml") . | fromYaml).data | default dict -}}
{{- get $data $k.secretKey | sha256sum -}}
{{- end -}}
{{- end -}}

{{/* Running requests per worker the autoscaler aims at (default 80 % of max-num-seqs). */}}
{{- define "dflash.worker.targetRunning" -}}
{{- $a := .Values.worker.autoscaling -}}
{{- $seqs := ternary .Values.embedded.maxNumSeqs .Values.worker.maxNumSeqs (eq .Values.mode "embedded") -}}
{{- if gt (float64 $a.targetRunningPerWorker) 0.0 }}{{ $a.targetRunningPerWorker }}{{ else }}{{ max 1 (div (mul (int $seqs) 8) 10) }}{{ end -}}
{{- end -}}

{{/* Seconds a load balancer in front must keep a request open: the gateway's own limit plus
     30 s, so that the gateway's in-band timeout error reaches the client first. */}}
{{- define "dflash.gateway.lbTimeoutSeconds" -}}
{{- add (int .Values.gateway.requestTimeoutSeconds) 30 -}}
{{- end -}}

{{/* Ingress annotations: what the ingress class needs for long streams (ingress-nginx: read
     and send timeouts, no buffering; AWS ALB: the idle timeout), under the user's own. */}}
{{- define "dflash.gateway.ingressAnnotations" -}}
{{- $i := .Values.gateway.ingress -}}
{{- $t := include "dflash.gateway.lbTimeoutSeconds" . -}}
{{- $defaults := dict -}}
{{- if eq $i.className "nginx" -}}
{{- $defaults = dict "nginx.ingress.kubernetes.io/proxy-read-timeout" $t "nginx.ingress.kubernetes.io/proxy-send-timeout" $t "nginx.ingress.kubernetes.io/proxy-buffering" "off" -}}
{{- else if eq $i.className "alb" -}}
{{- $defaults = dict "alb.ingress.kubernetes.io/load-balancer-attributes" (printf "idle_timeout.timeout_seconds=%s" $t) -}}
{{- end -}}
{{- $all := merge (deepCopy $i.annotations) $defaults -}}
{{- if $all }}{{ toYaml $all }}{{ end -}}
{{- end -}}

{{/* The Redis the chart starts for tenants' usage (gateway.rateLimits.redis.deploy). */}}
{{- define "dflash.redis.fullname" -}}
{{- printf "%s-redis" (include "dflash.fullname" .) -}}
{{- end -}}

{{/* True when the gateways share a Redis for tenants' usage (started here or given). */}}
{{- define "dflash.redis.enabled" -}}
{{- $r := .Values.gateway.rateLimits.redis -}}
{{- if or $r.deploy $r.existingSecret $r.url }}true{{ end -}}
{{- end -}}

{{/* OpenTelemetry's own variables for one kind of process (docs/tracing.md), as a YAML list;
     empty when tracing is off. Call with (dict "ctx" $ "service" NAME). */}}
{{- define "dflash.tracing.env" -}}
{{- $t := .ctx.Values.tracing -}}
{{- if $t.endpoint -}}
{{- $env := list (dict "name" "OTEL_EXPORTER_OTLP_ENDPOINT" "value" $t.endpoint) -}}
{{- $env = append $env (dict "name" "OTEL_EXPORTER_OTLP_PROTOCOL" "value" $t.protocol) -}}
{{- $env = append $env (dict "name" "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" "value" $t.protocol) -}}
{{- $env = append $env (dict "name" "OTEL_SERVICE_NAME" "value" .service) -}}
{{- $env = append $env (dict "name" "OTEL_TRACES_SAMPLER" "value" $t.sampler) -}}
{{- $env = append $env (dict "name" "OTEL_TRACES_SAMPLER_ARG" "value" (toString $t.samplerArg)) -}}
{{- if $t.resourceAttributes -}}
{{- $env = append $env (dict "name" "OTEL_RESOURCE_ATTRIBUTES" "value" $t.resourceAttributes) -}}
{{- end -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}

{{/* The traces URL an engine's own flag takes: the endpoint over gRPC, plus /v1/traces over
     HTTP (wire/tracing.py's TracingSettings.url). */}}
{{- define "dflash.tracing.url" -}}
{{- $t := .Values.tracing -}}
{{- if eq $t.protocol "grpc" }}{{ $t.endpoint }}{{ else }}{{ trimSuffix "/" $t.endpoint }}/v1/traces{{ end -}}
{{- end -}}
