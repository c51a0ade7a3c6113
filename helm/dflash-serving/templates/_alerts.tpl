{{/* Recording and alerting rules, rendered into the PrometheusRule. Every expression is scoped
     to this release's series (namespace and job: monitoring.alerts.*Selector), so another vLLM
     in the same Prometheus triggers nothing. rules/alerts.yaml and rules/cluster.yaml are these
     groups rendered with the compose stack's selectors (a test keeps them identical); promtool
     unit tests run against them. Prometheus's own {{ $labels }} are escaped as raw strings. */}}
{{- define "dflash.ruleGroups" -}}
groups:
  {{ include "dflash.rules.recording" . }}
  {{ include "dflash.rules.alerts" . }}
  {{ include "dflash.rules.cluster" . }}
{{- end -}}

{{- define "dflash.rules.recording" -}}
{{- $g := include "dflash.gatewaySelector" . -}}
{{- $by := "sum by (namespace, job, model)" -}}
{{- $pool := "sum by (namespace, job, model, pool)" -}}
  - name: dflash-serving.recording
    rules:
      # Mean acceptance length = tokens committed per verify step = 1 + accepted / steps.
      - record: model:dflash_spec_acceptance_length:mean15m
        expr: 1 + {{ $by }} (rate(dflash_spec_accepted_tokens_total{ {{- $g -}} }[15m])) / {{ $by }} (rate(dflash_spec_steps_total{ {{- $g -}} }[15m]))
      - record: model:dflash_spec_acceptance_length:mean1h
        expr: 1 + {{ $by }} (rate(dflash_spec_accepted_tokens_total{ {{- $g -}} }[1h])) / {{ $by }} (rate(dflash_spec_steps_total{ {{- $g -}} }[1h]))
      - record: model:dflash_time_to_first_token_seconds:p95_5m
        expr: histogram_quantile(0.95, sum by (namespace, job, model, le) (rate(dflash_time_to_first_token_seconds_bucket{ {{- $g -}} }[5m])))
      - record: model:dflash_time_per_output_token_seconds:p95_5m
        expr: histogram_quantile(0.95, sum by (namespace, job, model, le) (rate(dflash_time_per_output_token_seconds_bucket{ {{- $g -}} }[5m])))
      - record: model:dflash_requests_5xx:ratio5m
        expr: {{ $by }} (rate(dflash_requests_total{ {{- $g -}} ,status=~"5.."}[5m])) / {{ $by }} (rate(dflash_requests_total{ {{- $g -}} }[5m]))
      # Per pool (several pools of one model: drafter canaries). Rules of a group run in order,
      # so the later ones read the earlier ones' fresh values.
      - record: pool:dflash_spec_acceptance_length:mean15m
        expr: 1 + {{ $pool }} (rate(dflash_spec_accepted_tokens_total{ {{- $g -}} }[15m])) / {{ $pool }} (rate(dflash_spec_steps_total{ {{- $g -}} }[15m]))
      - record: pool:dflash_spec_acceptance_length:mean1h
        expr: 1 + {{ $pool }} (rate(dflash_spec_accepted_tokens_total{ {{- $g -}} }[1h])) / {{ $pool }} (rate(dflash_spec_steps_total{ {{- $g -}} }[1h]))
      - record: pool:dflash_completion_tokens:rate5m
        expr: {{ $pool }} (rate(dflash_completion_tokens_total{ {{- $g -}} }[5m]))
      # GPUs of the pool's healthy workers (each gateway replica reports every worker: max).
      - record: pool:dflash_healthy_gpus:sum
        expr: sum by (namespace, job, pool) (max by (namespace, job, pool, worker) (dflash_worker_healthy{ {{- $g -}} })) * on (namespace, job, pool) max by (namespace, job, pool) (dflash_pool_gpus_per_worker{ {{- $g -}} })
      - record: pool:dflash_completion_tokens_per_gpu:rate5m
        expr: pool:dflash_completion_tokens:rate5m / on (namespace, job, pool) group_left () (pool:dflash_healthy_gpus:sum > 0)
{{- end -}}

{{/* Alerts on the gateway's and the workers' own metrics (DESIGN §3, §3b). */}}
{{- define "dflash.rules.alerts" -}}
{{- $a := .Values.monitoring.alerts -}}
{{- $g := include "dflash.gatewaySelector" . -}}
{{- $w := include "dflash.workerSelector" . -}}
{{- $spec := .Values.model.speculative -}}
{{- $low := round (mulf $a.acceptanceLowRatio $spec.expectedAcceptanceLength) 3 -}}
{{- $pod := "namespace, job, pod, instance, model_name" -}}
  - name: dflash-serving.alerts
    rules:
      - alert: DFlashAcceptanceLengthLow
        expr: model:dflash_spec_acceptance_length:mean1h < {{ $low }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: DFlash acceptance length far below the drafter's expected value
          description: >-
            {{`Model {{ $labels.model }} commits {{ $value | printf "%.2f" }} tokens per verify step over 1 h`}}, below {{ $a.acceptanceLowRatio }} × the expected {{ $spec.expectedAcceptanceLength }} (model.speculative.expectedAcceptanceLength). A traffic-mix shift moves it less; check sampling defaults, the drafter revision and the prompts.
      # A model's baseline pool is its heaviest (dflash_pool_weight); every other pool of the
      # model is a canary, compared on the same hour of live traffic.
      - alert: DFlashCanaryAcceptanceBelowBaseline
        expr: >-
          pool:dflash_spec_acceptance_length:mean1h
          < on (namespace, job, model) group_left ()
          ({{ $a.canaryAcceptanceRatio }} * max by (namespace, job, model) (pool:dflash_spec_acceptance_length:mean1h
          and on (namespace, job, model, pool) topk by (namespace, job, model) (1, max by (namespace, job, model, pool) (dflash_pool_weight{ {{- $g -}} }))))
        for: 30m
        labels:
          severity: warning
        annotations:
          summary: A canary pool's drafter accepts clearly less than its model's baseline pool
          description: >-
            {{`Pool {{ $labels.pool }} of model {{ $labels.model }} commits {{ $value | printf "%.2f" }} tokens per verify step over 1 h`}}, below {{ $a.canaryAcceptanceRatio }} × its model's baseline pool (the pool with the highest weight) on the same traffic. Outputs are unaffected (DFlash is lossless), but the canary is slower: compare the pools row of the dashboard, and lower the canary's weight or roll its drafter back.
      - alert: DFlashDrafterMismatch
        expr: >-
          (1 + sum by ({{ $pod }}) (rate(vllm:spec_decode_num_accepted_tokens_total{ {{- $w -}} }[5m]))
          / sum by ({{ $pod }}) (rate(vllm:spec_decode_num_drafts_total{ {{- $w -}} }[5m])) < {{ $a.drafterMismatchLength }})
          and on ({{ $pod }}) sum by ({{ $pod }}) (rate(vllm:spec_decode_num_drafts_total{ {{- $w -}} }[5m])) > 0.5
        for: 3m
        labels:
          severity: critical
        annotations:
          summary: DFlash drafter does not match the target
          description: >-
            {{`Worker {{ $labels.instance }} commits {{ $value | printf "%.2f" }} tokens per verify step`}} (a matching drafter: about {{ $spec.expectedAcceptanceLength }}). The drafter probably does not match the target (wrong checkpoint, tokenizer or revision); every step pays for a useless draft. Roll back.
      - alert: DFlashTTFTP95AboveSLO
        expr: model:dflash_time_to_first_token_seconds:p95_5m > {{ $a.ttftP95Seconds }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: Time to first token p95 above SLO
          description: >-
            {{`Model {{ $labels.model }}: TTFT p95 is {{ $value | humanizeDuration }}`}} (SLO {{ $a.ttftP95Seconds }} s).
      - alert: DFlashTPOTP95AboveSLO
        expr: model:dflash_time_per_output_token_seconds:p95_5m > {{ $a.tpotP95Seconds }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: Time per output token p95 above SLO
          description: >-
            {{`Model {{ $labels.model }}: TPOT p95 is {{ $value | humanizeDuration }}`}} (SLO {{ $a.tpotP95Seconds }} s).
      - alert: DFlashWorkerDown
        expr: max by (namespace, job, worker) (dflash_worker_healthy{ {{- $g -}} }) == 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: A DFlash worker fails its health checks
          description: >-
            {{`Worker {{ $labels.worker }} has been unhealthy for every gateway for 5 minutes.`}}
      # The gauge's series disappear when a worker leaves DNS: no series plus 503s is no worker too.
      - alert: DFlashNoHealthyWorker
        expr: >-
          (max by (namespace, job) (dflash_worker_healthy{ {{- $g -}} }) == 0)
          or on (namespace, job)
          (sum by (namespace, job) (rate(dflash_requests_total{ {{- $g -}} ,status="503"}[5m])) > 0
          unless on (namespace, job) (max by (namespace, job) (dflash_worker_healthy{ {{- $g -}} }) == 1))
        for: 2m
        labels:
          severity: critical
        annotations:
          summary: No healthy DFlash worker
          description: >-
            The gateway has no healthy worker; every request gets a 503.
{{- if gt (int (include "dflash.worker.minReplicas" .)) 0 }}
      # From the workers' side: no worker is scraped at all (dead, pending, or never started).
      - alert: DFlashWorkerMetricsAbsent
        expr: absent(vllm:num_requests_running{ {{- $w -}} })
        for: 10m
        labels:
          severity: critical
        annotations:
          summary: No DFlash worker reports metrics
          description: >-
            No worker series ({{ $w }}) for 10 minutes: every worker is down, pending or still loading its model, or the PodMonitor selects nothing.
{{- end }}
      - alert: DFlashHigh5xxRatio
        expr: model:dflash_requests_5xx:ratio5m > {{ $a.errorRatio5xx }}
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: Too many 5xx responses
          description: >-
            {{`Model {{ $labels.model }}: {{ $value | humanizePercentage }} of requests end in 5xx`}} (threshold {{ $a.errorRatio5xx }}).
      - alert: DFlashQueueBacklog
        expr: vllm:num_requests_waiting{ {{- $w -}} } > {{ $a.queueBacklog }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: Requests are queueing on a worker
          description: >-
            {{`Worker {{ $labels.instance }} has {{ $value }} requests waiting`}} (threshold {{ $a.queueBacklog }}); add workers (worker.autoscaling) or lower max concurrency.
      - alert: DFlashKVCachePressure
        expr: vllm:kv_cache_usage_perc{ {{- $w -}} } > {{ $a.kvCacheUsageHigh }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: A worker's KV cache is nearly full
          description: >-
            {{`Worker {{ $labels.instance }} uses {{ $value | humanizePercentage }} of its KV cache`}} (threshold {{ $a.kvCacheUsageHigh }}); requests will queue or be preempted. Add workers or lower max-num-seqs / max-model-len.
{{- end -}}

{{/* Alerts on series only a cluster Prometheus has: `up` of the scraped pods, kube-state-metrics,
     and counters real vLLM exports but the embedded worker does not. */}}
{{- define "dflash.rules.cluster" -}}
{{- $a := .Values.monitoring.alerts -}}
{{- $g := include "dflash.gatewaySelector" . -}}
{{- $w := include "dflash.workerSelector" . -}}
{{- $name := include "dflash.worker.fullname" . -}}
{{- $ns := .Release.Namespace -}}
{{- $load := div (mul .Values.worker.startupProbe.periodSeconds .Values.worker.startupProbe.failureThreshold) 60 | int -}}
  - name: dflash-serving.cluster
    rules:
      # A pod that answered scrapes and stopped: crash loop, OOM kill, hung engine. A pod still
      # loading its model has never been up and stays out.
      - alert: DFlashWorkerTargetDown
        expr: up{ {{- $w -}} } == 0 and max_over_time(up{ {{- $w -}} }[1h]) == 1
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: A DFlash worker stopped answering
          description: >-
            {{`Worker {{ $labels.instance }} answered scrapes before and has not for 3 minutes (crash loop, OOM kill or a hung engine).`}}
      - alert: DFlashGatewayDown
        expr: (sum by (namespace, job) (up{ {{- $g -}} }) == 0) or absent(up{ {{- $g -}} })
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: No DFlash gateway answers
          description: >-
            No gateway pod ({{ $g }}) has answered a scrape for 5 minutes: clients get connection errors.
{{- if include "dflash.multiNode" . }}
      - alert: DFlashWorkerReplicasUnavailable
        expr: kube_statefulset_status_replicas_ready{namespace="{{ $ns }}",statefulset="{{ $name }}"} < kube_statefulset_replicas{namespace="{{ $ns }}",statefulset="{{ $name }}"}
{{- else }}
      - alert: DFlashWorkerReplicasUnavailable
        expr: kube_deployment_status_replicas_available{namespace="{{ $ns }}",deployment="{{ $name }}"} < kube_deployment_spec_replicas{namespace="{{ $ns }}",deployment="{{ $name }}"}
{{- end }}
        # Longer than a model load (the startup probe's budget), so rollouts stay quiet.
        for: {{ add $load 15 }}m
        labels:
          severity: warning
        annotations:
          summary: Fewer DFlash workers ready than requested
          description: >-
            {{`{{ $value }}`}} worker(s) of {{ $name }} ready, fewer than requested for {{ add $load 15 }} minutes: pods pending (no free GPU node?), crash-looping or failing to load the model.
      - alert: DFlashPreemptions
        expr: sum by (namespace, job, pod, instance, model_name) (rate(vllm:num_preemptions_total{ {{- $w -}} }[5m])) > {{ $a.preemptionsPerSecond }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: vLLM preempts requests for lack of KV cache
          description: >-
            {{`Worker {{ $labels.instance }} preempts {{ $value | printf "%.2f" }} requests/s`}} (threshold {{ $a.preemptionsPerSecond }}): they are recomputed, latency suffers. Add workers or lower max-num-seqs.
{{- end -}}
