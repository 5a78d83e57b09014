{{/* Names: "<release>" when the release name already contains "epd", else "<release>-epd". */}}
{{- define "epd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "epd.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "epd.labels" -}}
{{ include "epd.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "epd.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.torchVariant) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The connector both stores use; checks the combinations that cannot work. */}}
{{- define "epd.connector" -}}
{{- $c := .Values.connector | default (ternary "shm" "redis" (eq .Values.layout "single-node")) -}}
{{- if not (has .Values.layout (list "single-node" "multi-node")) -}}
{{- fail (printf "layout must be single-node or multi-node, not %q" .Values.layout) -}}
{{- end -}}
{{- if not (has $c (list "shm" "redis")) -}}
{{- fail (printf "connector must be shm or redis, not %q" $c) -}}
{{- end -}}
{{- if and (eq $c "shm") (eq .Values.layout "multi-node") -}}
{{- fail "layout multi-node needs connector redis: pods on different nodes cannot share /dev/shm" -}}
{{- end -}}
{{- if and (eq $c "shm") .Values.gpu.enabled -}}
{{- fail "gpu.enabled needs connector redis: each container gets its own GPU, and the shm connector's CUDA IPC needs one GPU shared by producer and consumer" -}}
{{- end -}}
{{- if and (eq $c "redis") (not .Values.redis.internal) (not .Values.redis.url) (not .Values.redis.existingSecret) -}}
{{- fail "redis.internal is false: set redis.url or redis.existingSecret" -}}
{{- end -}}
{{- $c -}}
{{- end -}}

{{- define "epd.redisUrl" -}}
{{- if .Values.redis.internal -}}
{{- printf "redis://%s-redis:6379/0" (include "epd.fullname" .) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by every epd pod. */}}
{{- define "epd.podSpecCommon" -}}
automountServiceAccountToken: false
# Service links would inject EPD_PORT=tcp://... (from the coordinator Service), colliding with epd settings.
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "epd.podAnnotations" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Does this role run on a GPU? (encode, prefill, decode when gpu.enabled) */}}
{{- define "epd.onGpu" -}}
{{- if and .root.Values.gpu.enabled (has .role (list "encode" "prefill" "decode")) -}}true{{- end -}}
{{- end -}}

{{/*
One role container.  dict: root, role, cfg (roles.<role> values), prefix (port names carry the role when
several roles share a pod).
*/}}
{{- define "epd.roleContainer" -}}
{{- $root := .root -}}
{{- $gpu := include "epd.onGpu" . -}}
{{- $grpcName := ternary (printf "%s-grpc" .role) "grpc" .prefix -}}
{{- $httpName := ternary (printf "%s-http" .role) "http" .prefix -}}
- name: {{ .role }}
  image: {{ include "epd.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args: [{{ .role | quote }}]
  envFrom:
    - configMapRef:
        name: {{ include "epd.fullname" $root }}-config
  env:
    - name: EPD_GRPC_PORT
      value: {{ .cfg.grpcPort | quote }}
    - name: EPD_HTTP_PORT
      value: {{ .cfg.httpPort | quote }}
    - name: OMP_NUM_THREADS
      value: {{ ternary $root.Values.gpu.threads .cfg.threads (eq $gpu "true") | quote }}
    {{- if $gpu }}
    - name: EPD_DEVICE
      value: cuda
    - name: EPD_DTYPE
      value: {{ $root.Values.gpu.dtype | quote }}
    {{- end }}
    {{- if .prefix }}
    # gRPC only inside the pod: the coordinator is its neighbour on 127.0.0.1.
    - name: EPD_GRPC_HOST
      value: 127.0.0.1
    {{- end }}
    {{- include "epd.secretEnv" $root | nindent 4 }}
    {{- if and (not .prefix) $root.Values.coordinator.registration }}
    # Announce this pod to the coordinator's admin API under its own IP (POST /v1/instances, every 10 s, with
    # the admin token).
    - name: EPD_COORDINATOR_URL
      value: {{ printf "http://%s-admin:%v" (include "epd.fullname" $root) $root.Values.coordinator.adminPort | quote }}
    - name: EPD_ADVERTISE_HOST
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- end }}
    {{- with include "epd.redisSecretEnv" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $root.Values.model.hfTokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: token
    {{- end }}
    {{- range $k, $v := .cfg.env }}
    - name: {{ $k }}
      value: {{ $v | quote }}
    {{- end }}
  ports:
    - name: {{ $grpcName }}
      containerPort: {{ .cfg.grpcPort }}
    - name: {{ $httpName }}
      containerPort: {{ .cfg.httpPort }}
  # Nothing listens until the model is loaded (or downloaded): allow up to 15 minutes.
  startupProbe:
    httpGet:
      path: /health
      port: {{ $httpName }}
    periodSeconds: 5
    failureThreshold: 180
  # 503 while a store it uses does not answer (Redis down) or while draining for shutdown.
  readinessProbe:
    httpGet:
      path: /ready
      port: {{ $httpName }}
    periodSeconds: 5
    timeoutSeconds: 3
    failureThreshold: 2
  # Liveness only: a Redis outage makes the role unready, never restarts it.
  livenessProbe:
    httpGet:
      path: /health
      port: {{ $httpName }}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 3
  resources:
    {{- if $gpu }}
    {{- $res := deepCopy $root.Values.gpu.resources }}
    {{- $_ := set $res.limits $root.Values.gpu.resourceName ($root.Values.gpu.count | toString) }}
    {{- toYaml $res | nindent 4 }}
    {{- else }}
    {{- toYaml .cfg.resources | nindent 4 }}
    {{- end }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
    {{- if has .role (list "encode" "prefill" "decode") }}
    {{- /* --linear-kernel auto's timed choices in the image's read-only EPD_CACHE_DIR (kernel_choices.py) */}}
    - name: kernel-choices
      mountPath: /opt/epd/models/kernel-choices
    {{- end }}
    {{- if and .prefix (has .role (list "encode" "prefill" "decode")) }}
    - name: shm
      mountPath: /dev/shm
    {{- end }}
{{- end -}}

{{/* API keys and the admin token, from the chart's Secret (or auth.existingSecret): every epd container. */}}
{{- define "epd.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-secrets" (include "epd.fullname" .)) -}}
{{- end -}}

{{- define "epd.secretEnv" -}}
- name: EPD_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "epd.secretName" . }}
      key: api-keys
- name: EPD_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "epd.secretName" . }}
      key: admin-token
{{- end -}}

{{- define "epd.redisSecretEnv" -}}
{{- if and (not .Values.redis.internal) .Values.redis.existingSecret -}}
- name: EPD_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.secretKey }}
{{- end -}}
{{- end -}}

{{/* The coordinator container; urls: dict role -> "host:port"; httpUrls (optional): role -> base URL
     listed by GET /cluster. */}}
{{- define "epd.coordinatorContainer" -}}
{{- $root := .root -}}
- name: coordinator
  image: {{ include "epd.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args: ["coordinator"]
  envFrom:
    - configMapRef:
        name: {{ include "epd.fullname" $root }}-config
  env:
    - name: EPD_PORT
      value: {{ $root.Values.coordinator.port | quote }}
    {{- include "epd.secretEnv" $root | nindent 4 }}
    {{- if eq $root.Values.layout "multi-node" }}
    # The admin API (instance registration, aborts) on its own port and Service, token required.
    - name: EPD_ADMIN_HOST
      value: 0.0.0.0
    - name: EPD_ADMIN_PORT
      value: {{ $root.Values.coordinator.adminPort | quote }}
    {{- end }}
    {{- range $role := list "render" "encode" "prefill" "decode" }}
    - name: EPD_{{ upper $role }}_URLS
      value: {{ get $.urls $role | quote }}
    {{- end }}
    {{- with .httpUrls }}
    {{- range $role := list "render" "encode" "prefill" "decode" }}
    - name: EPD_{{ upper $role }}_HTTP_URLS
      value: {{ get $.httpUrls $role | quote }}
    {{- end }}
    {{- end }}
    {{- range $k, $v := $root.Values.coordinator.env }}
    - name: {{ $k }}
      value: {{ $v | quote }}
    {{- end }}
  ports:
    - name: http
      containerPort: {{ $root.Values.coordinator.port }}
    {{- if eq $root.Values.layout "multi-node" }}
    - name: admin
      containerPort: {{ $root.Values.coordinator.adminPort }}
    {{- end }}
  startupProbe:
    tcpSocket:
      port: http
    periodSeconds: 2
    failureThreshold: 30
  # /ready: 503 while a role has no ready instance or while draining: the coordinator then leaves the Service.
  readinessProbe:
    httpGet:
      path: /ready
      port: http
    periodSeconds: 5
    timeoutSeconds: 3
    failureThreshold: 2
  # Liveness only (never the roles: a dead encoder must not restart the coordinator).
  livenessProbe:
    httpGet:
      path: /health
      port: http
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 3
  resources:
    {{- toYaml $root.Values.coordinator.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
{{- end -}}

{{- define "epd.cacheVolume" -}}
- name: cache
  {{- if .Values.model.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.existingClaim }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
  {{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: kernel-choices
  emptyDir:
    sizeLimit: 16Mi
{{- end -}}

{{/* PodDisruptionBudget + HorizontalPodAutoscaler for one Deployment. dict: root, name, component, cfg */}}
{{- define "epd.pdbAndHpa" -}}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "epd.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  maxUnavailable: {{ .cfg.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "epd.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
{{- if .cfg.autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels:
    {{- include "epd.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ .cfg.autoscaling.minReplicas }}
  maxReplicas: {{ .cfg.autoscaling.maxReplicas }}
  metrics:
    {{- /* the role's own signals (docs/deployment.md: a custom metrics adapter serves them); CPU as a floor */}}
    {{- with .cfg.autoscaling.targetBusyFraction }}
    - type: Pods
      pods:
        metric:
          name: epd_role_busy_fraction
          selector:
            matchLabels:
              role: {{ $.component }}
        target:
          type: AverageValue
          averageValue: {{ . | quote }}
    {{- end }}
    {{- with .cfg.autoscaling.targetQueuePerPod }}
    {{- $queue := get (dict "encode" "epd_encode_queued_items" "prefill" "epd_role_queue_depth" "decode" "epd_decode_queued") $.component }}
    {{- if not $queue }}
    {{- fail (printf "autoscaling.targetQueuePerPod applies to encode, prefill and decode, not %s" $.component) }}
    {{- end }}
    - type: Pods
      pods:
        metric:
          name: {{ $queue }}
          {{- if eq $.component "prefill" }}
          selector:
            matchLabels:
              role: prefill
          {{- end }}
        target:
          type: AverageValue
          averageValue: {{ . | quote }}
    {{- end }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .cfg.autoscaling.targetCPUUtilizationPercentage }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: 300
{{- end }}
{{- end -}}
