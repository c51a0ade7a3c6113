{{/* The worker pod: shared by the Deployment (one pod per worker) and the LeaderWorkerSet
     (multi-node: a leader that serves HTTP, `nodes - 1` headless pods). */}}

{{/* The worker argv after the `dflash-worker` command; one flag or value per list item.
     Call with (dict "ctx" $ "role" "single|leader|node"). */}}
{{- define "dflash.worker.args" -}}
{{- $ := .ctx -}}
{{- $w := $.Values.worker -}}
{{- if include "dflash.embedded" $ -}}
{{- /* No MODEL: the embedded worker serves the bundled target with its DFlash drafter. */ -}}
- --backend
- embedded
{{- if not $.Values.model.speculative.enabled }}
- --no-speculation
{{- end }}
- --served-model-name
- {{ $.Values.embedded.servedModelName | quote }}
- --max-num-seqs
- {{ int $.Values.embedded.maxNumSeqs | quote }}
- --max-model-len
- {{ int $.Values.embedded.maxModelLen | quote }}
{{- else -}}
{{- $mn := $w.multiNode -}}
{{- $tp := int $w.tensorParallelSize -}}
{{- if and (ne .role "single") (eq $mn.parallelism "tensor") }}{{ $tp = mul $tp (int $mn.nodes) }}{{ end -}}
- --backend
- vllm
- {{ $.Values.model.name | quote }}
{{- if $.Values.model.speculative.enabled }}
- --speculative-config
- {{ include "dflash.speculativeConfig" $ | quote }}
{{- end }}
- --served-model-name
- {{ $.Values.model.servedModelName | quote }}
- --max-num-seqs
- {{ int $w.maxNumSeqs | quote }}
- --max-model-len
- {{ int $w.maxModelLen | quote }}
- --tensor-parallel-size
- {{ $tp | quote }}
- --gpu-memory-utilization
- {{ $w.gpuMemoryUtilization | quote }}
- --dtype
- {{ $w.dtype | quote }}
{{- end }}
- --seed
- {{ int $w.seed | quote }}
- --host
- "0.0.0.0"
- --port
- {{ int $w.port | quote }}
- --per-request-spec-decode-metrics
- {{ $w.perRequestSpecDecodeMetrics | quote }}
{{- if include "dflash.worker.keyed" $ }}
{{- /* Kubernetes expands $(VAR) from the container env: the key stays out of the pod spec. */}}
- --api-key
- "$(DFLASH_WORKER_API_KEY)"
{{- end }}
{{- /* Both backends: dflash-worker hands it to vLLM as --shutdown-timeout. */}}
- --drain-timeout
- {{ int $w.shutdownTimeoutSeconds | quote }}
{{- if not (include "dflash.embedded" $) }}
{{- include "dflash.worker.multiNodeArgs" . }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* vLLM's multi-node flags (none for a single pod); LWS sets LWS_LEADER_ADDRESS and
     LWS_WORKER_INDEX in every pod of a group. Call with (dict "ctx" $ "role" ...). */}}
{{- define "dflash.worker.multiNodeArgs" -}}
{{- $w := .ctx.Values.worker -}}
{{- if ne .role "single" }}
{{- if eq $w.multiNode.parallelism "pipeline" }}
- --pipeline-parallel-size
- {{ int $w.multiNode.nodes | quote }}
{{- end }}
- --nnodes
- {{ int $w.multiNode.nodes | quote }}
- --node-rank
- {{ ternary "0" "$(LWS_WORKER_INDEX)" (eq .role "leader") | quote }}
- --master-addr
- "$(LWS_LEADER_ADDRESS)"
- --master-port
- {{ int $w.multiNode.masterPort | quote }}
{{- if eq .role "node" }}
- --headless
{{- end }}
{{- end }}
{{- end -}}

{{/* "true" when the workers run vLLM's own image directly (worker.launcher: vllm). */}}
{{- define "dflash.worker.direct" -}}
{{- if and (not (include "dflash.embedded" .)) (eq .Values.worker.launcher "vllm") }}true{{ end -}}
{{- end -}}

{{/* `vllm serve`'s argv after `vllm serve`, for vLLM's official image: the command
     `dflash-worker --backend vllm` would exec for the same values, in its order
     (engine/worker/vllm_backend.py; tests/deploy/test_worker_argv.py keeps them equal).
     Call with (dict "ctx" $ "role" "single|leader|node"). */}}
{{- define "dflash.worker.vllmArgs" -}}
{{- $ := .ctx -}}
{{- $w := $.Values.worker -}}
{{- $mn := $w.multiNode -}}
{{- $tp := int $w.tensorParallelSize -}}
{{- if and (ne .role "single") (eq $mn.parallelism "tensor") }}{{ $tp = mul $tp (int $mn.nodes) }}{{ end -}}
- {{ $.Values.model.name | quote }}
- --served-model-name
- {{ $.Values.model.servedModelName | quote }}
- --host
- "0.0.0.0"
- --port
- {{ int $w.port | quote }}
- --max-num-seqs
- {{ int $w.maxNumSeqs | quote }}
- --max-model-len
- {{ int $w.maxModelLen | quote }}
- --seed
- {{ int $w.seed | quote }}
- --dtype
- {{ $w.dtype | quote }}
- --tensor-parallel-size
- {{ $tp | quote }}
- --gpu-memory-utilization
- {{ $w.gpuMemoryUtilization | quote }}
{{- if include "dflash.worker.keyed" $ }}
- --api-key
- "$(DFLASH_WORKER_API_KEY)"
{{- end }}
{{- if $.Values.model.speculative.enabled }}
- --speculative-config
- {{ include "dflash.vllmSpeculativeConfig" $ | quote }}
- --per-request-spec-decode-metrics
- {{ $w.perRequestSpecDecodeMetrics | quote }}
{{- end }}
- --enable-per-request-metrics
- --shutdown-timeout
- {{ int $w.shutdownTimeoutSeconds | quote }}
{{- if $.Values.tracing.endpoint }}
- --otlp-traces-endpoint
- {{ include "dflash.tracing.url" $ | quote }}
{{- end }}
{{- include "dflash.worker.multiNodeArgs" . }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* SGLang's argv after `python3 -m sglang.launch_server`, for SGLang's own image (mode or
     pool engine sglang): what `dflash-worker --backend sglang` builds from the same settings
     (engine/worker/sglang_backend.py; tests/deploy/test_chart_engines.py keeps them equal, and
     SGLang 0.5.23's own parser checks it). */}}
{{- define "dflash.worker.sglangArgs" -}}
{{- $w := .Values.worker -}}
{{- $spec := .Values.model.speculative -}}
- --model-path
- {{ .Values.model.name | quote }}
- --served-model-name
- {{ .Values.model.servedModelName | quote }}
- --host
- "0.0.0.0"
- --port
- {{ int $w.port | quote }}
- --max-running-requests
- {{ int $w.maxNumSeqs | quote }}
- --context-length
- {{ int $w.maxModelLen | quote }}
- --random-seed
- {{ int $w.seed | quote }}
- --dtype
- {{ $w.dtype | quote }}
- --tp-size
- {{ int $w.tensorParallelSize | quote }}
- --mem-fraction-static
- {{ $w.gpuMemoryUtilization | quote }}
{{- if include "dflash.worker.keyed" . }}
- --api-key
- "$(DFLASH_WORKER_API_KEY)"
{{- end }}
{{- if $spec.enabled }}
- --speculative-algorithm
- DFLASH
- --speculative-draft-model-path
- {{ $spec.drafter | quote }}
- --speculative-num-draft-tokens
- {{ add1 (int $spec.numSpeculativeTokens) | quote }}
{{- end }}
- --enable-metrics
{{- if .Values.tracing.endpoint }}
- --enable-trace
- --otlp-traces-endpoint
- {{ include "dflash.tracing.url" . | quote }}
- --otlp-service-name
- {{ .Values.tracing.worker.serviceName | quote }}
{{- end }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Where TensorRT-LLM's pods read their LLM API options (the worker's ConfigMap). */}}
{{- define "dflash.worker.trtllmOptionsPath" -}}/etc/dflash-trtllm/llm-api-options.yaml{{- end -}}

{{/* trtllm-serve's LLM API options (YAML), as `dflash-worker --backend trtllm` writes them
     (engine/worker/trtllm_backend.py), with trtllm.extraLlmApiOptions merged over them. */}}
{{- define "dflash.worker.trtllmOptions" -}}
{{- $w := .Values.worker -}}
{{- $spec := .Values.model.speculative -}}
{{- $options := dict "return_perf_metrics" true "enable_iter_perf_stats" true "kv_cache_config" (dict "free_gpu_memory_fraction" (float64 $w.gpuMemoryUtilization)) -}}
{{- if .Values.tracing.endpoint -}}
{{- $_ := set $options "otlp_traces_endpoint" (include "dflash.tracing.url" .) -}}
{{- end -}}
{{- if $spec.enabled -}}
{{- if eq ($spec.method | default "dflash") "dflash2" -}}
{{- fail "model.speculative.method: dflash2 is not served by TensorRT-LLM (its DFlash has no candidate selector at any release we can name); use engine vllm or sglang" -}}
{{- end -}}
{{- $_ := set $options "speculative_config" (dict "decoding_type" "DFlash" "max_draft_len" (int $spec.numSpeculativeTokens) "speculative_model" $spec.drafter) -}}
{{- end -}}
{{- toYaml (mergeOverwrite $options (deepCopy .Values.trtllm.extraLlmApiOptions)) -}}
{{- end -}}

{{/* trtllm-serve's argv after `trtllm-serve`, for TensorRT-LLM's own image (mode or pool engine
     trtllm), as `dflash-worker --backend trtllm` builds it (tests keep them equal). */}}
{{- define "dflash.worker.trtllmArgs" -}}
{{- $w := .Values.worker -}}
{{- $spec := .Values.model.speculative -}}
{{- $drafts := 0 -}}
{{- if $spec.enabled }}{{ $drafts = int $spec.numSpeculativeTokens }}{{ end -}}
- {{ .Values.model.name | quote }}
- --backend
- pytorch
- --served_model_name
- {{ .Values.model.servedModelName | quote }}
- --host
- "0.0.0.0"
- --port
- {{ int $w.port | quote }}
- --max_batch_size
- {{ int $w.maxNumSeqs | quote }}
- --max_seq_len
- {{ int $w.maxModelLen | quote }}
- --tp_size
- {{ int $w.tensorParallelSize | quote }}
- --max_num_tokens
- {{ max 8192 (mul (int $w.maxNumSeqs) (add1 $drafts)) | quote }}
- --extra_llm_api_options
- {{ include "dflash.worker.trtllmOptionsPath" . | quote }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Node label key of worker.gpu.platform (nodeLabelKey overrides it). */}}
{{- define "dflash.worker.gpuLabelKey" -}}
{{- $keys := dict "gpu-operator" "nvidia.com/gpu.product" "gke" "cloud.google.com/gke-accelerator" "eks" "node.kubernetes.io/instance-type" "generic" "" -}}
{{- default (get $keys .Values.worker.gpu.platform) .Values.worker.gpu.nodeLabelKey -}}
{{- end -}}

{{/* Worker affinity: the platform's GPU node label (vllm mode) + extraNodeMatchExpressions,
     soft one-per-node spreading, merged with worker.affinity (whose nodeAffinity, if given,
     replaces the generated one). */}}
{{- define "dflash.worker.affinity" -}}
{{- $w := .Values.worker -}}
{{- $aff := deepCopy $w.affinity -}}
{{- if and (not (hasKey $aff "nodeAffinity")) (not (include "dflash.embedded" .)) -}}
{{- $exprs := list -}}
{{- $key := include "dflash.worker.gpuLabelKey" . -}}
{{- if and $key $w.gpu.nodeLabelValues -}}
{{- $exprs = append $exprs (dict "key" $key "operator" "In" "values" $w.gpu.nodeLabelValues) -}}
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

{{/* Worker resources: CPU, memory and GPUs scale with tensorParallelSize (vllm mode);
     worker.resources is merged over them. */}}
{{- define "dflash.worker.resources" -}}
{{- if include "dflash.embedded" . -}}
{{- toYaml .Values.embedded.resources -}}
{{- else -}}
{{- $per := .Values.worker.resourcesPerGpu -}}
{{- $gpus := int .Values.worker.tensorParallelSize -}}
{{- $extra := deepCopy .Values.worker.resources -}}
{{- $requests := dict "cpu" (toString (mul $gpus (int $per.cpu))) "memory" (printf "%dGi" (mul $gpus (int $per.memoryGi))) -}}
{{- $limits := dict "memory" (printf "%dGi" (mul $gpus (int $per.memoryLimitGi))) -}}
{{- $requests = merge (dict "nvidia.com/gpu" $gpus) ($extra.requests | default dict) $requests -}}
{{- $limits = merge (dict "nvidia.com/gpu" $gpus) ($extra.limits | default dict) $limits -}}
{{- toYaml (dict "requests" $requests "limits" $limits) -}}
{{- end -}}
{{- end -}}

{{/* Worker environment: HOME on the writable /tmp (the pods run as non-root, some with a
     read-only root), the idle keep-alive of its HTTP server, the HF cache, token and offline switch (vllm mode), the worker key,
     then worker.extraEnv. */}}
{{- define "dflash.worker.env" -}}
{{- $w := .Values.worker -}}
{{- $c := $w.modelCache -}}
{{- $env := list (dict "name" "HOME" "value" "/tmp") -}}
{{- $env = append $env (dict "name" "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" "value" (toString (int $w.httpKeepAliveSeconds))) -}}
{{- if not (include "dflash.embedded" .) -}}
{{- $env = append $env (dict "name" "HF_HOME" "value" (printf "%s/huggingface" $c.mountPath)) -}}
{{- if or $c.offline $c.readOnly (eq $c.type "hostPath") -}}
{{- $env = append $env (dict "name" "HF_HUB_OFFLINE" "value" "1") -}}
{{- end -}}
{{- if or $w.hfToken.existingSecret $w.hfToken.value -}}
{{- $ref := dict "name" (include "dflash.worker.hfTokenSecret" .) "key" $w.hfToken.secretKey -}}
{{- if not $w.hfToken.value -}}
{{- /* A Secret made outside the chart may not exist yet: ungated models need none, so the
     pod starts without it instead of waiting in CreateContainerConfigError. */ -}}
{{- $_ := set $ref "optional" true -}}
{{- end -}}
{{- $env = append $env (dict "name" "HF_TOKEN" "valueFrom" (dict "secretKeyRef" $ref)) -}}
{{- end -}}
{{- end -}}
{{- if include "dflash.worker.keyed" . -}}
{{- $ref := dict "name" (include "dflash.gateway.apiKeySecret" .) "key" .Values.gateway.apiKeys.workerKeyKey -}}
{{- $env = append $env (dict "name" "DFLASH_WORKER_API_KEY" "valueFrom" (dict "secretKeyRef" $ref)) -}}
{{- end -}}
{{- $tracing := include "dflash.tracing.env" (dict "ctx" . "service" .Values.tracing.worker.serviceName) -}}
{{- if $tracing }}{{ $env = concat $env (fromYamlArray $tracing) }}{{ end -}}
{{- $env = concat $env $w.extraEnv -}}
{{- toYaml $env -}}
{{- end -}}

{{/* The model-cache volume (vllm mode). */}}
{{- define "dflash.worker.cacheVolume" -}}
{{- $c := .Values.worker.modelCache -}}
- name: model-cache
{{- if eq $c.type "shared" }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model-cache" (include "dflash.worker.basename" .)) $c.existingClaim }}
    {{- if $c.readOnly }}
    readOnly: true
    {{- end }}
{{- else if eq $c.type "hostPath" }}
  hostPath:
    path: {{ $c.hostPath }}
    type: Directory
{{- else if eq $c.type "ephemeral" }}
  ephemeral:
    volumeClaimTemplate:
      metadata:
        labels:
          {{- include "dflash.selectorLabels" (dict "ctx" . "component" "worker") | nindent 10 }}
      spec:
        accessModes: [ReadWriteOnce]
        {{- with $c.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $c.size }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $c.size }}
{{- end }}
{{- end -}}

{{/* The worker pod spec; call with (dict "ctx" $ "role" "single|leader|node"). Only pods
     that serve HTTP (single, leader) have HTTP probes and the http port. */}}
{{- define "dflash.worker.podSpec" -}}
{{- $ := .ctx -}}
{{- $w := $.Values.worker -}}
{{- $embedded := include "dflash.embedded" $ -}}
{{- $serves := ne .role "node" -}}
{{- $direct := include "dflash.worker.direct" $ -}}
{{- $engine := $.Values.mode -}}
{{- $image := ternary $.Values.embedded.image (ternary $w.vllmImage $w.image (not (empty $direct))) (not (empty $embedded)) -}}
{{- if has $engine (list "sglang" "trtllm") }}{{ $image = (get $.Values $engine).image }}{{ end -}}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
serviceAccountName: {{ include "dflash.serviceAccountName" (dict "ctx" $ "component" "worker") }}
# Workers call no Kubernetes API: no token in the pod.
automountServiceAccountToken: false
{{- with $w.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $w.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $w.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
# preStop sleep (gateways see the pod leave DNS), then SIGTERM: vLLM drains for
# --shutdown-timeout seconds, SGLang until its requests end (its /health answers 503 meanwhile),
# TensorRT-LLM as its HTTP server stops; the grace period bounds them all.
terminationGracePeriodSeconds: {{ $w.terminationGracePeriodSeconds }}
containers:
  - name: worker
    image: {{ include "dflash.image" (dict "ctx" $ "image" $image) }}
    imagePullPolicy: {{ $image.pullPolicy }}
    {{- if eq $engine "sglang" }}
    command: ["python3", "-m", "sglang.launch_server"]
    args:
      {{- include "dflash.worker.sglangArgs" $ | nindent 6 }}
    {{- else if eq $engine "trtllm" }}
    command: ["trtllm-serve"]
    args:
      {{- include "dflash.worker.trtllmArgs" $ | nindent 6 }}
    {{- else if $direct }}
    command: ["vllm", "serve"]
    args:
      {{- include "dflash.worker.vllmArgs" (dict "ctx" $ "role" .role) | nindent 6 }}
    {{- else }}
    command: ["dflash-worker"]
    args:
      {{- include "dflash.worker.args" (dict "ctx" $ "role" .role) | nindent 6 }}
    {{- end }}
    ports:
      - name: http
        containerPort: {{ $w.port }}
        protocol: TCP
      {{- if ne .role "single" }}
      - name: rendezvous
        containerPort: {{ $w.multiNode.masterPort }}
        protocol: TCP
      {{- end }}
    env:
      {{- include "dflash.worker.env" $ | nindent 6 }}
    {{- if $serves }}
    startupProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: {{ $w.startupProbe.periodSeconds }}
      failureThreshold: {{ $w.startupProbe.failureThreshold }}
      timeoutSeconds: 5
    livenessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 3
    readinessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 5
      timeoutSeconds: 5
      failureThreshold: 2
    lifecycle:
      preStop:
        exec:
          command: ["sleep", {{ $w.preStopSleepSeconds | toString | quote }}]
    {{- end }}
    resources:
      {{- include "dflash.worker.resources" $ | nindent 6 }}
    {{- with $w.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      {{- if not $embedded }}
      - name: dshm
        mountPath: /dev/shm
      - name: model-cache
        mountPath: {{ $w.modelCache.mountPath }}
        {{- if or $w.modelCache.readOnly (eq $w.modelCache.type "hostPath") }}
        readOnly: true
        {{- end }}
      {{- end }}
      {{- if eq $engine "trtllm" }}
      - name: trtllm-options
        mountPath: {{ include "dflash.worker.trtllmOptionsPath" $ | dir }}
        readOnly: true
      {{- end }}
      {{- with $w.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  - name: tmp
    emptyDir: {}
  {{- if eq $engine "trtllm" }}
  - name: trtllm-options
    configMap:
      name: {{ include "dflash.worker.fullname" $ }}-trtllm
  {{- end }}
  {{- if not $embedded }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ printf "%dGi" (mul (int $w.tensorParallelSize) (int $w.resourcesPerGpu.shmGi)) }}
  {{- include "dflash.worker.cacheVolume" $ | nindent 2 }}
  {{- end }}
  {{- with $w.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $w.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with include "dflash.worker.affinity" $ }}
affinity:
  {{- . | nindent 2 }}
{{- end }}
{{- with include "dflash.worker.tolerations" $ }}
tolerations:
  {{- . | nindent 2 }}
{{- end }}
{{- end -}}
