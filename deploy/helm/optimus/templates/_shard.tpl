{{/*
One shard DaemonSet. Call with (dict "root" $ "kind" "dpu"|"host" "values" .Values.dpu|.Values.host).
*/}}
{{- define "optimus.shardDaemonSet" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $s := $root.Values.shard -}}
{{- $component := printf "shard-%s" .kind -}}
{{- $fullname := include "optimus.fullname" $root -}}
{{- include "optimus.checkShardMemory" (dict "root" $root "name" .kind "values" $v) -}}
{{- $resources := deepCopy ($v.resources | default dict) -}}
{{- if $v.rdma.enabled -}}
{{- $limits := get $resources "limits" | default dict -}}
{{- $requests := get $resources "requests" | default dict -}}
{{- $_ := set $limits $v.rdma.resourceName (int $v.rdma.count) -}}
{{- $_ := set $requests $v.rdma.resourceName (int $v.rdma.count) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- $_ := set $resources "requests" $requests -}}
{{- end -}}
{{- $flags := include "optimus.shardFlags" (dict "root" $root "kind" .kind "values" $v) -}}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: {{ $fullname }}-{{ $component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "optimus.labels" (dict "root" $root "component" $component) | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- include "optimus.selectorLabels" (dict "root" $root "component" $component) | nindent 6 }}
  updateStrategy:
    {{- toYaml $s.updateStrategy | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "optimus.labels" (dict "root" $root "component" $component) | nindent 8 }}
        optimus.dev/role: shard
        optimus.dev/shard-kind: {{ .kind }}
        {{- with $s.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        checksum/flags: {{ $flags | sha256sum }}
        {{- with (include "optimus.scrapeAnnotations" (dict "root" $root "port" $s.metricsPort)) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $s.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "optimus.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- if $v.hostNetwork }}
      hostNetwork: true
      # Keeps cluster DNS (the coordinator's Service name) in the host's network namespace.
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      terminationGracePeriodSeconds: {{ int $s.terminationGracePeriodSeconds }}
      {{- if not $v.rdma.enabled }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        {{- if $root.Values.checkpoints.enabled }}
        fsGroup: 65532
        {{- end }}
      {{- end }}
      containers:
        - name: optimus-shard
          image: {{ include "optimus.image" (dict "root" $root "image" $v.image "fallback" $s.image) | quote }}
          imagePullPolicy: {{ $s.image.pullPolicy }}
          command: ["/usr/local/bin/optimus-shard"]
          # The node is the shard's failure domain: the coordinator puts a
          # chunk's backup on another node than its primary where one has room.
          args: ["--flagfile=/etc/optimus/shard-{{ .kind }}.flags", "--failure_domain=$(OPTIMUS_NODE_NAME)"]
          env:
            - name: OPTIMUS_NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
            {{- with include "optimus.ucxTcpPortRange" $root }}
            # UCX's tcp transport listens in this range (shard.ucxTcpPortRange),
            # which the NetworkPolicy opens.
            - name: UCX_TCP_PORT_RANGE
              value: {{ . | quote }}
            {{- end }}
          ports:
            - name: metrics
              containerPort: {{ int $s.metricsPort }}
              protocol: TCP
          livenessProbe:
            httpGet:
              path: /healthz
              port: metrics
            {{- toYaml $s.livenessProbe | nindent 12 }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: metrics
            {{- toYaml $s.readinessProbe | nindent 12 }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
              {{- if $v.rdma.enabled }}
              # Pinning (registering) memory for RDMA needs IPC_LOCK, which only
              # takes effect for root in a container.
              add: ["IPC_LOCK"]
              {{- end }}
          volumeMounts:
            - name: flags
              mountPath: /etc/optimus
              readOnly: true
            - name: shm
              mountPath: /dev/shm
            - name: tmp
              mountPath: /tmp
            {{- if $root.Values.tls.enabled }}
            - name: tls
              mountPath: /etc/optimus-tls
              readOnly: true
            {{- end }}
            {{- if $root.Values.checkpoints.enabled }}
            - name: checkpoints
              mountPath: {{ $root.Values.checkpoints.mountPath }}
            {{- end }}
      volumes:
        - name: flags
          configMap:
            name: {{ $fullname }}-flags
            items:
              - key: shard-{{ .kind }}.flags
                path: shard-{{ .kind }}.flags
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $s.shmSizeLimit }}
        - name: tmp
          emptyDir: {}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ $root.Values.tls.shardSecret }}
            defaultMode: 0440  # group: the pods run as fsGroup 65532
        {{- end }}
        {{- if $root.Values.checkpoints.enabled }}
        - name: checkpoints
          persistentVolumeClaim:
            claimName: {{ include "optimus.checkpointClaim" $root }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
