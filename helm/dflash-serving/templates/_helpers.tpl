{{/* Names: every object is "<fullname>-<component>", cut to the 63-character DNS limit. */}}
{{- define "dflash.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash.fullname" -}}
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

{{- define "dflash.gateway.fullname" -}}
{{- printf "%s-gateway" (include "dflash.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash.worker.fullname" -}}
{{- printf "%s-worker" (include "dflash.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels shared by every object; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "dflash.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
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
{{- end -}}

{{/* "repo:tag", the tag defaulting to the chart's appVersion. */}}
{{- define "dflash.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "dflash.embedded" -}}
{{- if eq .Values.mode "embedded" }}true{{ end -}}
{{- end -}}

{{/* The worker's headless Service DNS name the gateway re-resolves to find every pod. */}}
{{- define "dflash.worker.dns" -}}
{{- printf "%s.%s.svc.cluster.local:%d" (include "dflash.worker.fullname" .) .Release.Namespace (int .Values.worker.port) -}}
{{- end -}}

{{- define "dflash.gateway.apiKeySecret" -}}
{{- default (printf "%s-api-keys" (include "dflash.gateway.fullname" .)) .Values.gateway.apiKeys.existingSecret -}}
{{- end -}}

{{- define "dflash.worker.hfTokenSecret" -}}
{{- default (printf "%s-hf-token" (include "dflash.worker.fullname" .)) .Values.worker.hfToken.existingSecret -}}
{{- end -}}

{{/* "auto" means: render when the cluster serves the CRD (helm template --api-versions). */}}
{{- define "dflash.monitoringEnabled" -}}
{{- $flag := toString .flag -}}
{{- if eq $flag "true" -}}true
{{- else if and (eq $flag "auto") (.ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind)) -}}true
{{- end -}}
{{- end -}}

{{/* The speculative config JSON exactly as `vllm serve --speculative-config` takes it. */}}
{{- define "dflash.speculativeConfig" -}}
{{- $spec := .Values.model.speculative -}}
{{- dict "method" "dflash" "model" $spec.drafter "num_speculative_tokens" (int $spec.numSpeculativeTokens) | toJson -}}
{{- end -}}

{{/* The worker argv after the `dflash-worker` command; one flag or value per list item. */}}
{{- define "dflash.worker.args" -}}
{{- if include "dflash.embedded" . -}}
{{- /* No MODEL: the embedded worker serves the bundled target with its DFlash drafter. */ -}}
- --backend
- embedded
{{- if not .Values.model.speculative.enabled }}
- --no-speculation
{{- end }}
- --served-model-name
- {{ .Values.embedded.servedModelName | quote }}
- --max-num-seqs
- {{ int .Values.embedded.maxNumSeqs | quote }}
- --max-model-len
- {{ int .Values.embedded.maxModelLen | quote }}
{{- else -}}
- --backend
- vllm
- {{ .Values.model.name | quote }}
{{- if .Values.model.speculative.enabled }}
- --speculative-config
- {{ include "dflash.speculativeConfig" . | quote }}
{{- end }}
- --served-model-name
- {{ .Values.model.servedModelName | quote }}
- --max-num-seqs
- {{ int .Values.worker.maxNumSeqs | quote }}
- --max-model-len
- {{ int .Values.worker.maxModelLen | quote }}
- --tensor-parallel-size
- {{ int .Values.worker.tensorParallelSize | quote }}
- --gpu-memory-utilization
- {{ .Values.worker.gpuMemoryUtilization | quote }}
- --dtype
- {{ .Values.worker.dtype | quote }}
{{- end }}
- --seed
- {{ int .Values.worker.seed | quote }}
- --host
- "0.0.0.0"
- --port
- {{ int .Values.worker.port | quote }}
- --per-request-spec-decode-metrics
- {{ .Values.worker.perRequestSpecDecodeMetrics | quote }}
{{- /* Both backends: dflash-worker passes it to vLLM as --shutdown-timeout. */}}
- --drain-timeout
- {{ int .Values.worker.shutdownTimeoutSeconds | quote }}
{{- if not (include "dflash.embedded" .) }}
{{- range .Values.worker.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The model name on the gateway side: what clients send. */}}
{{- define "dflash.servedModelName" -}}
{{- if include "dflash.embedded" . }}{{ .Values.embedded.servedModelName }}{{ else }}{{ .Values.model.servedModelName }}{{ end -}}
{{- end -}}

{{/* Worker affinity: GPU-product node affinity (vllm mode) + soft one-per-node spreading,
     merged with worker.affinity (whose nodeAffinity, if given, replaces the generated one). */}}
{{- define "dflash.worker.affinity" -}}
{{- $w := .Values.worker -}}
{{- $aff := deepCopy $w.affinity -}}
{{- if and (not (hasKey $aff "nodeAffinity")) (not (include "dflash.embedded" .)) -}}
{{- $exprs := list -}}
{{- if $w.gpu.products -}}
{{- $exprs = append $exprs (dict "key" "nvidia.com/gpu.product" "operator" "In" "values" $w.gpu.products) -}}
{{- end -}}
{{- $exprs = concat $exprs $w.extraNodeMatchExpressions -}}
{{- if $exprs -}}
{{- $terms := list (dict "matchExpressions" $exprs) -}}
{{- $_ := set $aff "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms)) -}}
{{- end -}}
{{- end -}}
{{- if and $w.spreadAcrossNodes (not (hasKey $aff "podAntiAffinity")) -}}
{{- $labels := include "dflash.selectorLabels" (dict "ctx" . "component" "worker") | fromYaml -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" $labels) -}}
{{- $_ := set $aff "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- if $aff }}{{ toYaml $aff }}{{ end -}}
{{- end -}}

{{/* Worker tolerations: the GPU taint (vllm mode) + worker.tolerations. */}}
{{- define "dflash.worker.tolerations" -}}
{{- $tol := list -}}
{{- if and .Values.worker.gpu.tolerateGpuTaint (not (include "dflash.embedded" .)) -}}
{{- $tol = append $tol (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") -}}
{{- end -}}
{{- $tol = concat $tol .Values.worker.tolerations -}}
{{- if $tol }}{{ toYaml $tol }}{{ end -}}
{{- end -}}

{{/* Worker resources: one GPU per tensor-parallel rank (vllm mode). */}}
{{- define "dflash.worker.resources" -}}
{{- if include "dflash.embedded" . -}}
{{- toYaml .Values.embedded.resources -}}
{{- else -}}
{{- $r := deepCopy .Values.worker.resources -}}
{{- $gpus := int .Values.worker.tensorParallelSize -}}
{{- $_ := set $r "limits" (merge (dict "nvidia.com/gpu" $gpus) ($r.limits | default dict)) -}}
{{- $_ = set $r "requests" (merge (dict "nvidia.com/gpu" $gpus) ($r.requests | default dict)) -}}
{{- toYaml $r -}}
{{- end -}}
{{- end -}}

{{/* Worker environment: the HF cache and token (vllm mode), HOME on the writable /tmp
     (embedded mode runs with a read-only root filesystem), then worker.extraEnv. */}}
{{- define "dflash.worker.env" -}}
{{- $w := .Values.worker -}}
{{- $env := list -}}
{{- if include "dflash.embedded" . -}}
{{- $env = append $env (dict "name" "HOME" "value" "/tmp") -}}
{{- else -}}
{{- $env = append $env (dict "name" "HF_HOME" "value" (printf "%s/huggingface" $w.modelCache.mountPath)) -}}
{{- if or $w.hfToken.existingSecret $w.hfToken.value -}}
{{- $ref := dict "name" (include "dflash.worker.hfTokenSecret" .) "key" $w.hfToken.secretKey -}}
{{- $env = append $env (dict "name" "HF_TOKEN" "valueFrom" (dict "secretKeyRef" $ref)) -}}
{{- end -}}
{{- end -}}
{{- $env = concat $env $w.extraEnv -}}
{{- toYaml $env -}}
{{- end -}}
