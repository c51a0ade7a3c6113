{{/* Traffic capture (docs/capture.md): the dataset URI, a bucket or the claim's mount. */}}
{{- define "dflash.capture.mountPath" -}}/var/lib/dflash/capture{{- end -}}
{{- define "dflash.capture.uri" -}}
{{- default (include "dflash.capture.mountPath" .) .Values.capture.uri -}}
{{- end -}}
{{- define "dflash.capture.claim" -}}
{{- if and .Values.capture.enabled (not .Values.capture.uri) -}}
{{- default (printf "%s-capture" (include "dflash.fullname" .)) .Values.capture.persistence.existingClaim -}}
{{- end -}}
{{- end -}}

{{/* The store's environment, for the gateway and the adapt job: the Secret's keys, extra env. */}}
{{- define "dflash.capture.envFrom" -}}
{{- with .Values.capture.existingSecret }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end -}}
{{- define "dflash.capture.env" -}}
{{- range $name, $value := .Values.capture.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* The adapt job's pod (templates/capture-adapt-job.yaml): a Job's spec, or a CronJob's jobTemplate. */}}
{{- define "dflash.adapt.jobSpec" }}
{{- $c := .Values.capture }}
{{- $a := $c.adapt }}
{{- $mount := .Values.worker.modelCache.mountPath }}
backoffLimit: 1
template:
  metadata:
    labels:
      {{- include "dflash.podLabels" (dict "ctx" $ "component" "adapt") | nindent 6 }}
  spec:
    serviceAccountName: {{ printf "%s-adapt" (include "dflash.fullname" .) }}
    automountServiceAccountToken: false
    restartPolicy: Never
    containers:
      - name: adapt
        image: {{ include "dflash.image" (dict "ctx" $ "image" .Values.worker.image) }}
        imagePullPolicy: {{ .Values.worker.image.pullPolicy }}
        command: ["/bin/sh", "-ec"]
        # Hugging Face ids are fetched into the cache first (a path is used as it is); the
        # drafter is written atomically, and only when held-out acceptance rose.
        args:
          - |
            local_copy() { python3 -c 'import os, sys; from huggingface_hub import snapshot_download as get; p = sys.argv[1]; print(p if os.path.isdir(p) else get(p))' "$1"; }
            exec dflash-train adapt --device cuda \
              --data "$CAPTURE_URI" \
              --target "$(local_copy "$TARGET")" \
              --drafter "$(local_copy "$DRAFTER")" \
              --minutes "$MINUTES" \
              --runs-dir {{ $mount }}/runs/adapt \
              --out {{ $mount }}/{{ $a.outputPath }}
        env:
          - name: CAPTURE_URI
            value: {{ include "dflash.capture.uri" . | quote }}
          - name: TARGET
            value: {{ default .Values.model.name $a.target | quote }}
          - name: DRAFTER
            value: {{ default .Values.model.speculative.drafter $a.drafter | quote }}
          - name: MINUTES
            value: {{ $a.minutes | quote }}
          - name: HF_HOME
            value: {{ $mount }}/huggingface
          {{- include "dflash.capture.env" . | nindent 10 }}
        {{- with include "dflash.capture.envFrom" . }}
        envFrom:
          {{- . | nindent 10 }}
        {{- end }}
        resources:
          {{- toYaml $a.resources | nindent 10 }}
        volumeMounts:
          - name: model-cache
            mountPath: {{ $mount }}
          {{- if include "dflash.capture.claim" . }}
          - name: capture
            mountPath: {{ include "dflash.capture.mountPath" . }}
            readOnly: true
          {{- end }}
    volumes:
      {{- include "dflash.worker.cacheVolume" . | nindent 6 }}
      {{- with include "dflash.capture.claim" . }}
      - name: capture
        persistentVolumeClaim:
          claimName: {{ . }}
          readOnly: true
      {{- end }}
    {{- with (default .Values.worker.nodeSelector $a.nodeSelector) }}
    nodeSelector:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with (default (include "dflash.worker.tolerations" . | fromYamlArray) $a.tolerations) }}
    tolerations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
