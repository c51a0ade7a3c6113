{{/* Pools: several models, engines and drafters behind one gateway.

     Each pool renders its own workers (Deployment or LeaderWorkerSet, headless Service, PDB,
     NetworkPolicy, HPA or ScaledObject) from the release's values with the pool's own keys
     merged over them, in this order: the release's values, the `gpu` preset's worker values
     (values-<gpu>.yaml), `engine`, then the pool's `model`, `worker` and `embedded`. With no
     `pools:` the release is one unnamed pool and renders exactly what 0.2.0 did. */}}

{{/* Fills .out.list with one context per pool: a dict with the root's Release, Chart,
     Capabilities, Files and Template, the pool's merged Values, and `pool` (name, weight,
     model). Call as: $p := dict; $_ := include "dflash.poolContexts" (dict "root" $ "out" $p). */}}
{{- define "dflash.poolContexts" -}}
{{- $root := .root -}}
{{- $contexts := list -}}
{{- if not $root.Values.pools -}}
{{- $contexts = list $root -}}
{{- else -}}
{{- range $pool := $root.Values.pools -}}
{{- $values := omit (deepCopy $root.Values) "pools" -}}
{{- with $pool.gpu -}}
{{- $preset := $root.Files.Get (printf "values-%s.yaml" .) | fromYaml -}}
{{- $values = mergeOverwrite $values (dict "worker" (deepCopy $preset.worker)) -}}
{{- end -}}
{{- with $pool.engine -}}
{{- $_ := set $values "mode" . -}}
{{- end -}}
{{- $own := pick (deepCopy $pool) "model" "worker" "embedded" -}}
{{- $values = mergeOverwrite $values $own -}}
{{- $ctx := dict "Values" $values "Release" $root.Release "Chart" $root.Chart "Capabilities" $root.Capabilities "Files" $root.Files "Template" $root.Template -}}
{{- $model := include "dflash.servedModelName" $ctx -}}
{{- $weight := 100.0 -}}
{{- if hasKey $pool "weight" }}{{ $weight = float64 $pool.weight }}{{ end -}}
{{- $_ := set $ctx "pool" (dict "name" $pool.name "weight" $weight "model" $model "weightGiven" (hasKey $pool "weight")) -}}
{{- if hasKey $pool "capture" }}{{ $_ := set $ctx.pool "capture" $pool.capture }}{{ end -}}
{{- with $pool.promotion }}{{ $_ := set $ctx.pool "promotion" . }}{{ end -}}
{{- $contexts = append $contexts $ctx -}}
{{- end -}}
{{- include "dflash.poolGuards" (dict "contexts" $contexts "pools" $root.Values.pools) -}}
{{- end -}}
{{- $_ := set .out "list" $contexts -}}
{{- end -}}

{{/* What the schema cannot say about a pools list; each failure names the value. */}}
{{- define "dflash.poolGuards" -}}
{{- $names := dict -}}
{{- $weights := dict -}}
{{- range $i, $ctx := .contexts -}}
{{- $pool := $ctx.pool -}}
{{- if hasKey $names $pool.name -}}
{{- fail (printf "pools[%d].name: %q is the name of pools[%v] too; pool names must be unique" $i $pool.name (get $names $pool.name)) -}}
{{- end -}}
{{- $_ := set $names $pool.name $i -}}
{{- $_ := set $weights $pool.model (addf (get $weights $pool.model | default 0.0) $pool.weight) -}}
{{- end -}}
{{- range $model, $total := $weights -}}
{{- if eq (float64 $total) 0.0 -}}
{{- fail (printf "pools: every pool serving model %q has weight 0; give one a weight above 0" $model) -}}
{{- end -}}
{{- end -}}
{{- range $i, $pool := .pools -}}
{{- if and $pool.worker (hasKey $pool.worker "modelCache") -}}
{{- fail (printf "pools[%d].worker.modelCache: the model cache is shared by every pool; set worker.modelCache" $i) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The gateway's DFLASH_GATEWAY_POOLS: JSON, a pool per entry with its headless Service. */}}
{{- define "dflash.gateway.pools" -}}
{{- $pools := dict -}}
{{- $_ := include "dflash.poolContexts" (dict "root" . "out" $pools) -}}
{{- $out := list -}}
{{- range $ctx := $pools.list -}}
{{- $gpus := include "dflash.worker.gpusPerWorker" $ctx | int -}}
{{- /* No pools list (one engine for the release): the gateway's "default" pool. */ -}}
{{- $pool := (index $ctx "pool") | default (dict "name" "default" "weight" 100.0 "model" (include "dflash.servedModelName" $ctx)) -}}
{{- $spec := dict "name" $pool.name "model" $pool.model "engine" $ctx.Values.mode "worker_dns" (include "dflash.worker.dns" $ctx) "gpus_per_worker" $gpus -}}
{{- /* A weight the values leave out stays out (the gateway's default is the same 100): a
       promotion refuses one that is set. */ -}}
{{- if or (not (hasKey $pool "weightGiven")) $pool.weightGiven }}{{ $_ := set $spec "weight" $pool.weight }}{{ end -}}
{{- if hasKey $pool "capture" }}{{ $_ := set $spec "capture" $pool.capture }}{{ end -}}
{{- with $pool.promotion }}{{ $_ := set $spec "promotion" . }}{{ end -}}
{{- $out = append $out $spec -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* GPUs behind one worker: tensor parallel size, times the nodes of a multi-node group; a
     CPU (embedded) worker counts 1. The gateway divides a pool's tokens/s by it. */}}
{{- define "dflash.worker.gpusPerWorker" -}}
{{- $w := .Values.worker -}}
{{- if include "dflash.embedded" . -}}1
{{- else if include "dflash.multiNode" . -}}{{ mul (int $w.tensorParallelSize) (int $w.multiNode.nodes) }}
{{- else -}}{{ int $w.tensorParallelSize }}
{{- end -}}
{{- end -}}

{{/* A model clients can ask for: the first pool's (NOTES.txt's example, `helm test`). */}}
{{- define "dflash.firstModel" -}}
{{- $pools := dict -}}
{{- $_ := include "dflash.poolContexts" (dict "root" . "out" $pools) -}}
{{- $first := first $pools.list -}}
{{- include "dflash.servedModelName" $first -}}
{{- end -}}
