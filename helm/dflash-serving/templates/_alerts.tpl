{{/* Recording and alerting rules, rendered into the PrometheusRule. rules/alerts.yaml is this
     block rendered with the default values (a test keeps the two identical); promtool unit
     tests run against that file. Prometheus's own {{ $labels }} are escaped as raw strings. */}}
{{- define "dflash.ruleGroups" -}}
{{- $a := .Values.monitoring.alerts -}}
groups:
  - name: dflash-serving.recording
    rules:
      # Mean acceptance length = tokens committed per verify step = 1 + accepted / steps.
      - record: model:dflash_spec_acceptance_length:mean15m
        expr: 1 + sum by (model) (rate(dflash_spec_accepted_tokens_total[15m])) / sum by (model) (rate(dflash_spec_steps_total[15m]))
      - record: model:dflash_spec_acceptance_length:mean1h
        expr: 1 + sum by (model) (rate(dflash_spec_accepted_tokens_total[1h])) / sum by (model) (rate(dflash_spec_steps_total[1h]))
      - record: model:dflash_spec_acceptance_length:mean1d
        expr: 1 + sum by (model) (rate(dflash_spec_accepted_tokens_total[1d])) / sum by (model) (rate(dflash_spec_steps_total[1d]))
      - record: model:dflash_spec_draft_acceptance_rate:ratio15m
        expr: sum by (model) (rate(dflash_spec_accepted_tokens_total[15m])) / sum by (model) (rate(dflash_spec_draft_tokens_total[15m]))
      - record: model:dflash_time_to_first_token_seconds:p95_5m
        expr: histogram_quantile(0.95, sum by (model, le) (rate(dflash_time_to_first_token_seconds_bucket[5m])))
      - record: model:dflash_time_per_output_token_seconds:p95_5m
        expr: histogram_quantile(0.95, sum by (model, le) (rate(dflash_time_per_output_token_seconds_bucket[5m])))
      - record: model:dflash_requests_5xx:ratio5m
        expr: sum by (model) (rate(dflash_requests_total{status=~"5.."}[5m])) / sum by (model) (rate(dflash_requests_total[5m]))
  - name: dflash-serving.alerts
    rules:
      - alert: DFlashAcceptanceLengthLow
        expr: model:dflash_spec_acceptance_length:mean15m < {{ $a.acceptanceLengthMin }}
        for: 15m
        labels:
          severity: warning
        annotations:
          summary: DFlash mean acceptance length is low
          description: >-
            {{`Model {{ $labels.model }} commits {{ $value | printf "%.2f" }} tokens per verify step`}} (threshold {{ $a.acceptanceLengthMin }}); speculation is buying little. Check the traffic mix and the drafter.
      - alert: DFlashAcceptanceLengthDropping
        expr: model:dflash_spec_acceptance_length:mean1h < {{ $a.acceptanceLengthDropRatio }} * model:dflash_spec_acceptance_length:mean1d
        for: 30m
        labels:
          severity: warning
        annotations:
          summary: DFlash acceptance length dropped against its 1-day baseline
          description: >-
            {{`Model {{ $labels.model }}: the 1 h mean acceptance length {{ $value | printf "%.2f" }} is below`}} {{ $a.acceptanceLengthDropRatio }} × its 1-day mean. A new traffic mix, a changed sampling default or a model/drafter rollout?
      - alert: DFlashDraftAcceptanceNearZero
        expr: model:dflash_spec_draft_acceptance_rate:ratio15m < {{ $a.acceptanceRateNearZero }}
        for: 10m
        labels:
          severity: critical
        annotations:
          summary: DFlash drafts are almost never accepted (drafter/target mismatch)
          description: >-
            {{`Model {{ $labels.model }} accepts {{ $value | humanizePercentage }} of draft tokens`}}. The drafter probably does not match the target (wrong checkpoint, tokenizer or revision); every step pays for a useless draft.
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
        expr: max by (worker) (dflash_worker_healthy) == 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: A DFlash worker fails its health checks
          description: >-
            {{`Worker {{ $labels.worker }} has been unhealthy for every gateway for 5 minutes.`}}
      - alert: DFlashNoHealthyWorker
        expr: max without (worker, instance, pod, container, endpoint) (dflash_worker_healthy) == 0
        for: 2m
        labels:
          severity: critical
        annotations:
          summary: No healthy DFlash worker
          description: >-
            The gateway has no healthy worker; every request gets a 503.
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
        expr: vllm:num_requests_waiting > {{ $a.queueBacklog }}
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: Requests are queueing on a worker
          description: >-
            {{`Worker {{ $labels.instance }} has {{ $value }} requests waiting`}} (threshold {{ $a.queueBacklog }}); add workers or lower max concurrency.
{{- end -}}
