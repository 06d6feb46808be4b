{{/* Chart name, at most 63 characters. */}}
{{- define "optimus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Prefix of every object name. Leaves room for the longest suffix ("-shard-host",
11 characters) under the 63-character limit of label values and DNS names.
*/}}
{{- define "optimus.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "optimus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select one component's pods. Call with (dict "root" $ "component" "coordinator"). */}}
{{- define "optimus.selectorLabels" -}}
app.kubernetes.io/name: {{ include "optimus.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects. Same argument as optimus.selectorLabels. */}}
{{- define "optimus.labels" -}}
helm.sh/chart: {{ include "optimus.chart" .root }}
{{ include "optimus.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: optimus
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "optimus.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "optimus.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The coordinator's gRPC address as shards (and optimusctl inside the cluster) dial it. */}}
{{- define "optimus.coordinatorAddress" -}}
{{- if .Values.coordinator.enabled -}}
{{- printf "%s-coord.%s.svc:%d" (include "optimus.fullname" .) .Release.Namespace (int .Values.coordinator.port) -}}
{{- else -}}
{{- $addr := required "coordinatorAddress is required when coordinator.enabled is false: set it to the HOST:PORT of the optimus-coord the shards should register with" .Values.coordinatorAddress -}}
{{- if not (regexMatch "^[^:/\\s,]+:[0-9]+(,[^:/\\s,]+:[0-9]+)*$" $addr) -}}
{{- fail (printf "coordinatorAddress must be HOST:PORT, or several (a leader and its standbys) as HOST:PORT,HOST:PORT; got %q" $addr) -}}
{{- end -}}
{{- $addr -}}
{{- end -}}
{{- end -}}

{{/* Image reference. Call with (dict "root" $ "image" .Values.x.image "fallback" .Values.shard.image). */}}
{{- define "optimus.image" -}}
{{- $repo := .image.repository -}}
{{- $tag := .image.tag -}}
{{- with get . "fallback" -}}
{{- $repo = $repo | default .repository -}}
{{- $tag = $tag | default .tag -}}
{{- end -}}
{{- $tag = $tag | default .root.Chart.AppVersion -}}
{{- if not $repo -}}
{{- fail "an image repository is empty: set coordinator.image.repository and shard.image.repository" -}}
{{- end -}}
{{- if .root.Values.imageRegistry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .root.Values.imageRegistry) $repo $tag -}}
{{- else -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end -}}

{{/*
A memory quantity ("13Gi", "12800Mi", "1G", "500M") in MiB, or -1 when the form
is not one of those (then the chart does not check it).
*/}}
{{- define "optimus.quantityMiB" -}}
{{- $q := toString . -}}
{{- if regexMatch "^[0-9]+Gi$" $q -}}{{- mul (trimSuffix "Gi" $q | int64) 1024 -}}
{{- else if regexMatch "^[0-9]+Mi$" $q -}}{{- trimSuffix "Mi" $q | int64 -}}
{{- else if regexMatch "^[0-9]+G$" $q -}}{{- div (mul (trimSuffix "G" $q | int64) 1000000000) 1048576 -}}
{{- else if regexMatch "^[0-9]+M$" $q -}}{{- div (mul (trimSuffix "M" $q | int64) 1000000) 1048576 -}}
{{- else -}}-1
{{- end -}}
{{- end -}}

{{/*
Fails unless the container's memory limit holds the shard's state budget plus
headroom. Call with (dict "root" $ "name" "dpu" "values" .Values.dpu).
*/}}
{{- define "optimus.checkShardMemory" -}}
{{- $v := .values -}}
{{- $limit := dig "limits" "memory" "" ($v.resources | default dict) -}}
{{- if $limit -}}
{{- $limitMiB := include "optimus.quantityMiB" $limit | int64 -}}
{{- $needMiB := add (int64 $v.memoryLimitMb) (int64 .root.Values.shard.memoryHeadroomMb) (int64 .root.Values.shard.maxInflightMb) -}}
{{- if and (ge $limitMiB 0) (lt $limitMiB $needMiB) -}}
{{- fail (printf "%s.resources.limits.memory (%s = %d MiB) is below %s.memoryLimitMb (%d) + shard.maxInflightMb (%d) + shard.memoryHeadroomMb (%d) = %d MiB: the shard would be OOM-killed before reaching its state budget; raise the limit or lower %s.memoryLimitMb" .name (toString $limit) $limitMiB .name (int64 $v.memoryLimitMb) (int64 .root.Values.shard.maxInflightMb) (int64 .root.Values.shard.memoryHeadroomMb) $needMiB .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Prometheus scrape annotations for a pod. Call with (dict "root" $ "port" N). */}}
{{- define "optimus.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/* The shard flag file for one kind. Call with (dict "root" $ "kind" "dpu" "values" .Values.dpu). */}}
{{- define "optimus.shardFlags" -}}
{{- $s := .root.Values.shard -}}
--coordinator={{ include "optimus.coordinatorAddress" .root }}
--kind={{ .kind }}
--memory_limit_mb={{ int64 .values.memoryLimitMb }}
--staging_mb={{ int64 (.values.stagingMb | default 0) }}
--step_threads={{ int .values.stepThreads }}
--kernel_threads={{ int .values.kernelThreads }}
--step_nice={{ int (.values.stepNice | default 0) }}
--huge_pages={{ .values.hugePages | default false }}
{{- with .values.transports | default $s.transports }}
--transports={{ . }}
{{- end }}
{{- with .values.netDevices | default $s.netDevices }}
--net_devices={{ . }}
{{- end }}
--metrics_port={{ int $s.metricsPort }}
{{ include "optimus.tlsFlag" .root }}
--max_parked_pulls_per_peer={{ int64 $s.maxParkedPullsPerPeer }}
--max_parked_pulls={{ int64 $s.maxParkedPulls }}
--max_inflight_mb={{ int64 $s.maxInflightMb }}
--max_peers={{ int64 $s.maxPeers }}
{{- if .root.Values.checkpoints.enabled }}
--checkpoint_dir={{ .root.Values.checkpoints.mountPath }}
--checkpoint_max_mb_per_s={{ int64 .root.Values.checkpoints.maxMbPerSec }}
{{- end }}
--verbose={{ $s.verbose }}
--log_format={{ $s.logFormat }}
{{- range $s.extraArgs }}
{{ . }}
{{- end }}
{{- end -}}

{{/* The checkpoint claim's name. */}}
{{- define "optimus.checkpointClaim" -}}
{{- .Values.checkpoints.existingClaim | default (printf "%s-checkpoints" (include "optimus.fullname" .)) -}}
{{- end -}}

{{/* coordinator.stateStore, checked: "file" or "etcd". */}}
{{- define "optimus.coordinatorStore" -}}
{{- $s := .Values.coordinator.stateStore | default "file" -}}
{{- if not (has $s (list "file" "etcd")) -}}
{{- fail (printf "coordinator.stateStore must be file or etcd, got %q" $s) -}}
{{- end -}}
{{- $s -}}
{{- end -}}

{{/* How many coordinator pods: coordinator.replicas, else 2 with etcd and 1 with the file store. */}}
{{- define "optimus.coordinatorReplicas" -}}
{{- $store := include "optimus.coordinatorStore" . -}}
{{- $r := .Values.coordinator.replicas -}}
{{- if and (eq $store "file") $r (gt (int $r) 1) -}}
{{- fail (printf "coordinator.replicas is %d but coordinator.stateStore is file: a standby needs the state in etcd (set coordinator.stateStore=etcd), or keep one replica" (int $r)) -}}
{{- end -}}
{{- if $r -}}{{- int $r -}}{{- else if eq $store "etcd" -}}2{{- else -}}1{{- end -}}
{{- end -}}

{{/* The chart runs its own etcd: etcd mode without etcd.endpoints. */}}
{{- define "optimus.ownEtcd" -}}
{{- if and .Values.coordinator.enabled (eq (include "optimus.coordinatorStore" .) "etcd") (not .Values.etcd.endpoints) -}}true{{- end -}}
{{- end -}}

{{/* The etcd client endpoints the coordinator uses: etcd.endpoints, or each member of the chart's own etcd by its stable name. */}}
{{- define "optimus.etcdEndpoints" -}}
{{- if .Values.etcd.endpoints -}}
{{- if not (regexMatch "^[^:/\\s,]+:[0-9]+(,[^:/\\s,]+:[0-9]+)*$" .Values.etcd.endpoints) -}}
{{- fail (printf "etcd.endpoints must be HOST:PORT,HOST:PORT...; got %q" .Values.etcd.endpoints) -}}
{{- end -}}
{{- .Values.etcd.endpoints -}}
{{- else -}}
{{- $fullname := include "optimus.fullname" . -}}
{{- $e := .Values.etcd.statefulSet -}}
{{- $list := list -}}
{{- range $i := until (int $e.replicas) -}}
{{- $list = append $list (printf "%s-etcd-%d.%s-etcd.%s.svc:%d" $fullname $i $fullname $.Release.Namespace (int $e.clientPort)) -}}
{{- end -}}
{{- join "," $list -}}
{{- end -}}
{{- end -}}

{{/* The key prefix of this release's state in etcd. */}}
{{- define "optimus.etcdPrefix" -}}
{{- .Values.etcd.prefix | default (printf "/optimus/%s/%s" .Release.Namespace .Release.Name) -}}
{{- end -}}

{{/* The coordinator's flag file. */}}
{{- define "optimus.coordinatorFlags" -}}
{{- $c := .Values.coordinator -}}
--listen=0.0.0.0:{{ int $c.port }}
--metrics_port={{ int $c.metricsPort }}
--lease_ms={{ int $c.leaseMs }}
--sweep_ms={{ int $c.sweepMs }}
--max_rpc_threads={{ int $c.maxRpcThreads }}
--max_concurrent_map_reads={{ int $c.maxConcurrentMapReads }}
--max_queued_map_reads={{ int $c.maxQueuedMapReads }}
--map_fetches_per_s={{ $c.mapFetchesPerS }}
--down_shard_grace={{ $c.downShardGrace }}
--max_chunks_per_job={{ int64 $c.maxChunksPerJob }}
--max_tensors_per_job={{ int64 $c.maxTensorsPerJob }}
--max_job_bytes={{ int64 $c.maxJobBytes }}
{{- if eq (include "optimus.coordinatorStore" .) "etcd" }}
--etcd_endpoints={{ include "optimus.etcdEndpoints" . }}
--etcd_prefix={{ include "optimus.etcdPrefix" . }}
{{- else }}
--state_dir={{ trimSuffix "/" $c.persistence.mountPath }}/state
{{- end }}
{{ include "optimus.tlsFlag" . }}
{{- if .Values.checkpoints.enabled }}
--checkpoint_dir={{ .Values.checkpoints.mountPath }}
{{- end }}
--verbose={{ $c.verbose }}
--log_format={{ $c.logFormat }}
{{- range $c.extraArgs }}
{{ . }}
{{- end }}
{{- end -}}

{{/* TLS for gRPC: the mounted Secret, or plain text when turned off. */}}
{{- define "optimus.tlsFlag" -}}
{{- if .Values.tls.enabled -}}
--tls_dir=/etc/optimus-tls
{{- else -}}
--insecure_plaintext
{{- end -}}
{{- end -}}

{{/*
metrics.prometheusRule.selector, rendered (tpl) and checked: PromQL label
matchers without braces, e.g. namespace="training",cluster="a"; "" for none.
*/}}
{{- define "optimus.promSelector" -}}
{{- $sel := tpl (.Values.metrics.prometheusRule.selector | default "") . | trim -}}
{{- $m := `[a-zA-Z_][a-zA-Z0-9_]*\s*(=|!=|=~|!~)\s*"([^"\\]|\\.)*"` -}}
{{- if and $sel (not (regexMatch (printf `^%s(\s*,\s*%s)*$` $m $m) $sel)) -}}
{{- fail (printf "metrics.prometheusRule.selector must be PromQL label matchers without braces, such as namespace=\"training\",cluster=\"a\" (or empty), got %q" $sel) -}}
{{- end -}}
{{- $sel -}}
{{- end -}}

{{/* A PromQL matcher list from the non-empty strings in a list: {a="1",b="2"}, or nothing. */}}
{{- define "optimus.promMatch" -}}
{{- $parts := list -}}
{{- range . -}}
{{- if . -}}{{- $parts = append $parts . -}}{{- end -}}
{{- end -}}
{{- if $parts -}}{{- printf "{%s}" (join "," $parts) -}}{{- end -}}
{{- end -}}

{{/* An alert's labels. Call with (dict "root" $ "alert" .Values.metrics.prometheusRule.alerts.X). */}}
{{- define "optimus.alertLabels" -}}
severity: {{ .alert.severity | quote }}
{{- with .root.Values.metrics.prometheusRule.alertLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
shard.ucxTcpPortRange, checked: "FIRST-LAST", or "" when unset.
*/}}
{{- define "optimus.ucxTcpPortRange" -}}
{{- with .Values.shard.ucxTcpPortRange -}}
{{- if not (regexMatch "^[0-9]{1,5}-[0-9]{1,5}$" .) -}}
{{- fail (printf "shard.ucxTcpPortRange must be FIRST-LAST (e.g. 40000-40999), got %q" .) -}}
{{- end -}}
{{- $ends := splitList "-" . -}}
{{- $first := index $ends 0 | atoi -}}
{{- $last := index $ends 1 | atoi -}}
{{- if or (lt $first 1024) (gt $last 65535) (gt $first $last) -}}
{{- fail (printf "shard.ucxTcpPortRange %q: want 1024 <= FIRST <= LAST <= 65535" .) -}}
{{- end -}}
{{- printf "%d-%d" $first $last -}}
{{- end -}}
{{- end -}}

{{/* The Pod labels that select the release's shards, both kinds (as the shard Service does). */}}
{{- define "optimus.shardPodSelector" -}}
app.kubernetes.io/name: {{ include "optimus.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
optimus.dev/role: shard
{{- end -}}
