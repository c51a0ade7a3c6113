{{/* Recording and alerting rules, rendered into the PrometheusRule. Every expression is scoped
     to this release's series (namespace and job: monitoring.alerts.*Selector), so another vLLM
     in the same Prometheus triggers nothing. rules/alerts.yaml and rules/cluster.yaml are these
     groups rendered with the compose stack's selectors (a test keeps them identical); promtool
     unit tests run against them. Prometheus's own {{ $labels }} are escaped as raw strings. */}}
{{- define "dflash.ruleGroups" -}}
groups:
  {{ include "dflash.rules.engines" . }}
  {{- /* The gateway's series: none without it (inferenceGateway.mode=inference). */}}
  {{- if include "dflash.gateway.enabled" . }}
  {{ include "dflash.rules.recording" . }}
  {{- end }}
  {{ include "dflash.rules.alerts" . }}
  {{ include "dflash.rules.cluster" . }}
{{- end -}}

{{/* One expression per engine family, each given its `engine` label, joined with `or`: the
     same recorded series for a fleet that mixes vLLM (and the embedded worker, which speaks
     vLLM's exposition), SGLang and TensorRT-LLM. Call with (dict "vllm" E "sglang" E "trtllm" E);
     a missing key: that engine has no such series. */}}
{{- define "dflash.rules.perEngine" -}}
{{- $parts := list -}}
{{- range $engine := list "vllm" "sglang" "trtllm" -}}
{{- with get $ $engine -}}
{{- $expr := . -}}
{{- if eq $engine "sglang" -}}
{{- /* SGLang serves /metrics with prometheus_client's content negotiation: a Prometheus 2
       that asks for OpenMetrics without an escaping scheme gets `sglang_*` names (':' escaped
       to '_'); Prometheus 3 gets `sglang:*`. Both spellings are read. */ -}}
{{- $expr = regexReplaceAll "sglang:([a-z0-9_]+)\\{" $expr "{__name__=~\"sglang[:_]${1}\"," -}}
{{- end -}}
{{- $parts = append $parts (printf "label_replace(%s, \"engine\", \"%s\", \"\", \"\")" $expr $engine) -}}
{{- end -}}
{{- end -}}
{{- join " or " $parts -}}
{{- end -}}

{{/* Each engine's worker series under common names (`worker:dflash_*`, label `engine`), per
     worker pod; the dashboard's worker panels, the worker alerts and the docs read these only.
     Names and meanings, from each engine's source:
     - vLLM 0.32/0.33 `vllm/v1/metrics/loggers.py`;
     - SGLang 0.5.23 `srt/observability/metrics_collector.py`: gauges are reported per
       scheduler rank (max over tp/pp/ep ranks, summed over dp ranks); with priority scheduling
       the total is the `priority=""` series; a request's generated tokens are its first
       (prefill) token plus, per verify step, the accepted drafts and one bonus token;
     - TensorRT-LLM `tensorrt_llm/metrics/collector.py` (main, 2026): drafted tokens per
       position, so position 0 counts the verify steps that drafted. It has no preemption
       counter (cluster group). */}}
{{- define "dflash.rules.engines" -}}
{{- $w := include "dflash.workerSelector" . -}}
{{- $keep := "namespace, job, pool, pod, instance, model_name" -}}
{{- $by := printf "sum by (%s)" $keep -}}
{{- $sg := printf "%s,priority=\"\"" $w -}}
{{- $sgRank := "max without (tp_rank, pp_rank, moe_ep_rank)" -}}
  - name: dflash-serving.engines
    rules:
      - record: worker:dflash_requests_running:sum
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "%s (vllm:num_requests_running{%s})" $by $w)
          "sglang" (printf "%s (%s (sglang:num_running_reqs{%s}))" $by $sgRank $sg)
          "trtllm" (printf "%s (trtllm_num_requests_running{%s})" $by $w)) }}
      - record: worker:dflash_requests_waiting:sum
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "%s (vllm:num_requests_waiting{%s})" $by $w)
          "sglang" (printf "%s (%s (sglang:num_queue_reqs{%s}))" $by $sgRank $sg)
          "trtllm" (printf "%s (trtllm_num_requests_waiting{%s})" $by $w)) }}
      - record: worker:dflash_kv_cache_usage:ratio
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "max by (%s) (vllm:kv_cache_usage_perc{%s})" $keep $w)
          "sglang" (printf "max by (%s) (sglang:token_usage{%s})" $keep $w)
          "trtllm" (printf "max by (%s) (trtllm_kv_cache_utilization{%s})" $keep $w)) }}
      - record: worker:dflash_generation_tokens:rate5m
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "%s (rate(vllm:generation_tokens_total{%s}[5m]))" $by $w)
          "sglang" (printf "%s (rate(sglang:generation_tokens_total{%s}[5m]))" $by $w)
          "trtllm" (printf "%s (rate(trtllm_generation_tokens_total{%s}[5m]))" $by $w)) }}
      # Verify steps (vLLM: drafts; SGLang: verify calls; TensorRT-LLM: position 0 drafted).
      - record: worker:dflash_spec_steps:rate5m
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "%s (rate(vllm:spec_decode_num_drafts_total{%s}[5m]))" $by $w)
          "sglang" (printf "%s (rate(sglang:spec_verify_calls_total{%s}[5m]))" $by $w)
          "trtllm" (printf "%s (rate(trtllm_spec_decode_drafted_tokens_total{%s,token_position=\"0\"}[5m]))" $by $w)) }}
      # Accepted drafts. SGLang counts none: generated tokens less one bonus token per verify
      # step and one prefill token per finished request.
      - record: worker:dflash_spec_accepted_tokens:rate5m
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "%s (rate(vllm:spec_decode_num_accepted_tokens_total{%s}[5m]))" $by $w)
          "sglang" (printf "clamp_min(%s (rate(sglang:generation_tokens_total{%s}[5m])) - %s (rate(sglang:spec_verify_calls_total{%s}[5m])) - %s (rate(sglang:num_requests_total{%s}[5m])), 0)" $by $w $by $w $by $w)
          "trtllm" (printf "%s (rate(trtllm_spec_decode_accepted_tokens_total{%s}[5m]))" $by $w)) }}
      # Drafted tokens (SGLang: verify steps × its current drafts per step, block size - 1).
      - record: worker:dflash_spec_draft_tokens:rate5m
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "%s (rate(vllm:spec_decode_num_draft_tokens_total{%s}[5m]))" $by $w)
          "sglang" (printf "%s (rate(sglang:spec_verify_calls_total{%s}[5m])) * on (%s) (max by (%s) (sglang:spec_num_draft_tokens{%s}) - 1)" $by $w $keep $keep $w)
          "trtllm" (printf "%s (rate(trtllm_spec_decode_drafted_tokens_total{%s}[5m]))" $by $w)) }}
      # Accepted drafts at each draft position (SGLang reports positions only per request, in
      # the response: the gateway's histograms). Divided by the steps: the share of verify
      # steps that accepted the draft at that position.
      - record: worker:dflash_spec_accepted_tokens_by_position:rate5m
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "sum by (%s, position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{%s}[5m]))" $keep $w)
          "trtllm" (printf "sum by (%s, position) (label_replace(rate(trtllm_spec_decode_accepted_tokens_total{%s}[5m]), \"position\", \"$1\", \"token_position\", \"(.*)\"))" $keep $w)) }}
{{- range $name, $series := dict "time_to_first_token" (list "vllm:time_to_first_token_seconds" "sglang:time_to_first_token_seconds" "trtllm_time_to_first_token_seconds") "inter_token_latency" (list "vllm:inter_token_latency_seconds" "sglang:inter_token_latency_seconds" "trtllm_time_per_output_token_seconds") "e2e_request_latency" (list "vllm:e2e_request_latency_seconds" "sglang:e2e_request_latency_seconds" "trtllm_e2e_request_latency_seconds") }}
{{- $p95 := "histogram_quantile(0.95, sum by (namespace, job, pool, model_name, le) (rate(%s_bucket{%s}[5m])))" }}
      # Each engine has its own buckets: quantiles per engine, never across engines' buckets.
      - record: engine:dflash_worker_{{ $name }}_seconds:p95_5m
        expr: {{ include "dflash.rules.perEngine" (dict
          "vllm" (printf $p95 (index $series 0) $w)
          "sglang" (printf $p95 (index $series 1) $w)
          "trtllm" (printf $p95 (index $series 2) $w)) }}
{{- end }}
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

{{/* Alerts on the gateway's and the workers' own metrics (ARCHITECTURE.md: the worker wire contract, the gateway's metrics). */}}
{{- define "dflash.rules.alerts" -}}
{{- $a := .Values.monitoring.alerts -}}
{{- $g := include "dflash.gatewaySelector" . -}}
{{- $w := include "dflash.workerSelector" . -}}
{{- $spec := .Values.model.speculative -}}
{{- $low := round (mulf $a.acceptanceLowRatio $spec.expectedAcceptanceLength) 3 -}}
  - name: dflash-serving.alerts
    rules:
{{- if include "dflash.gateway.enabled" . }}
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
{{- end }}
      - alert: DFlashDrafterMismatch
        expr: >-
          (1 + worker:dflash_spec_accepted_tokens:rate5m{ {{- $w -}} }
          / worker:dflash_spec_steps:rate5m{ {{- $w -}} } < {{ $a.drafterMismatchLength }})
          and worker:dflash_spec_steps:rate5m{ {{- $w -}} } > 0.5
        for: 3m
        labels:
          severity: critical
        annotations:
          summary: DFlash drafter does not match the target
          description: >-
            {{`Worker {{ $labels.instance }} commits {{ $value | printf "%.2f" }} tokens per verify step`}} (a matching drafter: about {{ $spec.expectedAcceptanceLength }}). The drafter probably does not match the target (wrong checkpoint, tokenizer or revision); every step pays for a useless draft. Roll back.
{{- if include "dflash.gateway.enabled" . }}
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
{{- end }}
{{- if gt (int (include "dflash.worker.minReplicas" .)) 0 }}
      # From the workers' side: no worker is scraped at all (dead, pending, or never started).
      - alert: DFlashWorkerMetricsAbsent
        expr: absent(worker:dflash_requests_running:sum{ {{- $w -}} })
        for: 10m
        labels:
          severity: critical
        annotations:
          summary: No DFlash worker reports metrics
          description: >-
            No worker series ({{ $w }}) for 10 minutes: every worker is down, pending or still loading its model, or the PodMonitor selects nothing.
{{- end }}
{{- if include "dflash.gateway.enabled" . }}
      - alert: DFlashHigh5xxRatio
        expr: model:dflash_requests_5xx:ratio5m > {{ $a.errorRatio5xx }}
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: Too many 5xx responses
          description: >-
            {{`Model {{ $labels.model }}: {{ $value | humanizePercentage }} of requests end in 5xx`}} (threshold {{ $a.errorRatio5xx }}).
{{- end }}
      - alert: DFlashQueueBacklog
        expr: worker:dflash_requests_waiting:sum{ {{- $w -}} } > {{ $a.queueBacklog }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: Requests are queueing on a worker
          description: >-
            {{`Worker {{ $labels.instance }} has {{ $value }} requests waiting`}} (threshold {{ $a.queueBacklog }}); add workers (worker.autoscaling) or lower max concurrency.
      - alert: DFlashKVCachePressure
        expr: worker:dflash_kv_cache_usage:ratio{ {{- $w -}} } > {{ $a.kvCacheUsageHigh }}
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
{{- $keep := "namespace, job, pool, pod, instance, model_name" -}}
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
{{- if include "dflash.gateway.enabled" . }}
      - alert: DFlashGatewayDown
        expr: (sum by (namespace, job) (up{ {{- $g -}} }) == 0) or absent(up{ {{- $g -}} })
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: No DFlash gateway answers
          description: >-
            No gateway pod ({{ $g }}) has answered a scrape for 5 minutes: clients get connection errors.
{{- end }}
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
        expr: >-
          ({{ include "dflash.rules.perEngine" (dict
          "vllm" (printf "sum by (%s) (rate(vllm:num_preemptions_total{%s}[5m]))" $keep $w)
          "sglang" (printf "sum by (%s) (rate(sglang:num_retracted_requests_total{%s}[5m]))" $keep $w)) }})
          > {{ $a.preemptionsPerSecond }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: A worker preempts requests for lack of KV cache
          description: >-
            {{`Worker {{ $labels.instance }} ({{ $labels.engine }}) preempts {{ $value | printf "%.2f" }} requests/s`}} (threshold {{ $a.preemptionsPerSecond }}; SGLang calls it retracting): they are recomputed, latency suffers. Add workers or lower max-num-seqs.
{{- end -}}
