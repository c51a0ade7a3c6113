{{/* Value combinations the schema cannot express; each fails with a message naming the values. */}}
{{- define "dflash.guards" -}}
{{- $w := .Values.worker -}}
{{- $drain := add $w.preStopSleepSeconds $w.shutdownTimeoutSeconds | int -}}
{{- if le (int $w.terminationGracePeriodSeconds) $drain -}}
{{- fail (printf "worker.terminationGracePeriodSeconds (%d) must exceed worker.preStopSleepSeconds + worker.shutdownTimeoutSeconds (%d), or vLLM is killed mid-drain" (int $w.terminationGracePeriodSeconds) $drain) -}}
{{- end -}}
{{- if lt (float64 $w.preStopSleepSeconds) (float64 .Values.gateway.discoveryIntervalSeconds) -}}
{{- fail (printf "worker.preStopSleepSeconds (%v) must be at least gateway.discoveryIntervalSeconds (%v): gateways must re-resolve DNS and stop routing to a worker before it drains" $w.preStopSleepSeconds .Values.gateway.discoveryIntervalSeconds) -}}
{{- end -}}
{{- if and (eq (int $w.rollingUpdate.maxSurge) 0) (eq (int $w.rollingUpdate.maxUnavailable) 0) -}}
{{- fail "worker.rollingUpdate: maxSurge and maxUnavailable cannot both be 0 (the rollout could never start)" -}}
{{- end -}}
{{- $spec := .Values.model.speculative -}}
{{- if gt (float64 $spec.expectedAcceptanceLength) (float64 (add1 (int $spec.numSpeculativeTokens))) -}}
{{- fail (printf "model.speculative.expectedAcceptanceLength (%v) cannot exceed numSpeculativeTokens + 1 (%d): a verify step commits at most that many tokens" $spec.expectedAcceptanceLength (add1 (int $spec.numSpeculativeTokens))) -}}
{{- end -}}
{{- $a := $w.autoscaling -}}
{{- if $a.enabled -}}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) -}}
{{- fail (printf "worker.autoscaling.minReplicas (%d) exceeds maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- if and (eq $a.driver "keda") (not $a.keda.prometheusAddress) -}}
{{- fail "worker.autoscaling.keda.prometheusAddress is required with driver keda (the Prometheus KEDA queries, e.g. http://prometheus-operated.monitoring:9090)" -}}
{{- end -}}
{{- if and (eq $a.driver "hpa") (lt (int $a.minReplicas) 1) -}}
{{- fail "worker.autoscaling.minReplicas must be at least 1 with driver hpa (only KEDA scales to zero)" -}}
{{- end -}}
{{- if include "dflash.multiNode" . -}}
{{- fail "worker.autoscaling and worker.multiNode cannot be combined: scale a LeaderWorkerSet with worker.replicas" -}}
{{- end -}}
{{- end -}}
{{- $engine := .Values.mode -}}
{{- $where := ternary (printf "pools[%s].engine" (include "dflash.poolName" .)) "mode" (not (empty (include "dflash.poolName" .))) -}}
{{- if and (eq $engine "trtllm") $w.requireApiKey -}}
{{- fail (printf "%s trtllm: trtllm-serve takes no API key; set worker.requireApiKey=false for these workers (their NetworkPolicy admits only the gateway and Prometheus)" $where) -}}
{{- end -}}
{{- if and (has $engine (list "sglang" "trtllm")) $w.multiNode.enabled -}}
{{- fail (printf "%s %s: worker.multiNode (LeaderWorkerSet) is rendered for vLLM only; use worker.tensorParallelSize within one node" $where $engine) -}}
{{- end -}}
{{- if and $w.autoscaling.enabled (eq $w.autoscaling.driver "hpa") (has $engine (list "sglang" "trtllm")) (hasPrefix "vllm_" $w.autoscaling.hpa.waitingMetricName) -}}
{{- fail (printf "%s %s: worker.autoscaling.hpa.waitingMetricName and runningMetricName name vLLM's series; give the custom-metrics names prometheus-adapter serves for this engine's queue (README: Autoscaling), or use driver keda" $where $engine) -}}
{{- end -}}
{{- if and $w.requireApiKey (not .Values.gateway.apiKeys.enabled) (not (include "dflash.embedded" .)) -}}
{{- fail "worker.requireApiKey needs gateway.apiKeys.enabled (the worker key lives in the gateway's API-key Secret); set worker.requireApiKey=false to run workers without a key" -}}
{{- end -}}
{{- /* ConfigMap keys rendered from the chart's own values: an extraSettings entry with the
same name would be a second, conflicting key. */ -}}
{{- $owned := dict "HOST" "the chart (0.0.0.0)" "PORT" "gateway.port" "WORKER_DNS" "the worker Service" "POOLS" "pools" "GPUS_PER_WORKER" "worker.tensorParallelSize" "ROUTING" "gateway.routingPolicy" "DNS_INTERVAL_S" "gateway.discoveryIntervalSeconds" "DRAIN_TIMEOUT_S" "gateway.drainTimeoutSeconds" "METRICS_AUTH" "gateway.metricsRequireAuth" "LOG_LEVEL" "gateway.logLevel" "PROCESSES" "gateway.processes" "REQUEST_TIMEOUT_S" "gateway.requestTimeoutSeconds" "UPSTREAM_KEEPALIVE_S" "worker.httpKeepAliveSeconds" "RATE_LIMIT_FAILURE_MODE" "gateway.rateLimits.failureMode" "RATE_LIMIT_DEADLINE_S" "gateway.rateLimits.deadlineSeconds" "REDIS_URL" "gateway.rateLimits.redis" "REDIS_PASSWORD" "gateway.rateLimits.redis.passwordSecret" "REDIS_TLS_CA_FILE" "gateway.rateLimits.redis.tls" "REDIS_TLS_CERT_FILE" "gateway.rateLimits.redis.tls" "REDIS_TLS_KEY_FILE" "gateway.rateLimits.redis.tls" "REDIS_TLS_VERIFY" "gateway.rateLimits.redis.tls.verify" -}}
{{- if .Values.gateway.apiKeys.enabled -}}
{{- $_ := set $owned "API_KEY_FILE" "gateway.apiKeys" -}}
{{- end -}}
{{- range $key, $_ := .Values.gateway.extraSettings -}}
{{- $value := get $owned (upper $key) -}}
{{- if $value -}}
{{- fail (printf "gateway.extraSettings.%s: set by the chart from %s; set that instead" $key $value) -}}
{{- end -}}
{{- end -}}
{{- $g := .Values.gateway -}}
{{- if and $g.apiKeys.tenants (not $g.apiKeys.enabled) -}}
{{- fail "gateway.apiKeys.tenants needs gateway.apiKeys.enabled (tenants are told apart by their keys)" -}}
{{- end -}}
{{- if and $g.apiKeys.tenants $g.apiKeys.existingSecret -}}
{{- fail "gateway.apiKeys.tenants is written into the Secret the chart creates: with gateway.apiKeys.existingSecret, put the tenant file in that Secret instead" -}}
{{- end -}}
{{- $r := $g.rateLimits.redis -}}
{{- if gt (len (compact (list $r.deploy $r.existingSecret $r.url))) 1 -}}
{{- fail "gateway.rateLimits.redis: set one of deploy, existingSecret or url" -}}
{{- end -}}
{{- if and $r.deploy $r.passwordSecret -}}
{{- fail "gateway.rateLimits.redis.passwordSecret is for url: the chart's own Redis has a generated password" -}}
{{- end -}}
{{- if and $r.tls.enabled (not (and $r.deploy $r.tls.secret)) -}}
{{- fail "gateway.rateLimits.redis.tls.enabled (the chart's Redis listens with TLS) needs deploy=true and tls.secret (tls.crt, tls.key and ca.crt; for url or existingSecret, use a rediss:// URL)" -}}
{{- end -}}
{{- if and $r.tls.clientCertificate (not $r.tls.secret) -}}
{{- fail "gateway.rateLimits.redis.tls.clientCertificate needs tls.secret (with tls.crt and tls.key)" -}}
{{- end -}}
{{- $several := or (gt (int $g.replicas) 1) $g.autoscaling.enabled (gt (int $g.processes) 1) -}}
{{- if and $g.apiKeys.tenants $several (not (include "dflash.redis.enabled" .)) -}}
{{- fail "gateway.apiKeys.tenants with more than one gateway process (gateway.replicas, gateway.autoscaling or gateway.processes) need a shared store: set gateway.rateLimits.redis.deploy=true, gateway.rateLimits.redis.existingSecret or gateway.rateLimits.redis.url (each process would count alone)" -}}
{{- end -}}
{{- if and (eq $w.modelCache.type "hostPath") (not $w.modelCache.hostPath) -}}
{{- fail "worker.modelCache.hostPath is required with worker.modelCache.type=hostPath" -}}
{{- end -}}
{{- /* What the gateway refuses at startup (service/tenancy/tenants.py), refused here: a
   rollout would otherwise crash-loop its new pods. No key's value in a message. */ -}}
{{- $names := list -}}
{{- $keys := list -}}
{{- range $t := $g.apiKeys.tenants -}}
{{- if has $t.name $names -}}
{{- fail (printf "gateway.apiKeys.tenants: duplicate tenant name %s" $t.name) -}}
{{- end -}}
{{- $names = append $names $t.name -}}
{{- range $k := $t.keys -}}
{{- if has $k $keys -}}
{{- fail (printf "gateway.apiKeys.tenants: a key of tenant %s is given twice (each key belongs to one tenant, once)" $t.name) -}}
{{- end -}}
{{- $keys = append $keys $k -}}
{{- end -}}
{{- end -}}
{{- if and .Values.capture.adapt.enabled (not .Values.capture.enabled) -}}
{{- fail "capture.adapt.enabled needs capture.enabled: the adapt job trains on the captured dataset" -}}
{{- end -}}
{{- end -}}
