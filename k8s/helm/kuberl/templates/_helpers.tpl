{{/* The prefix of every object name: <name>-actor, <name>-buffer, ... */}}
{{- define "kuberl.name" -}}
{{- default "kuberl" .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* gRPC port and health service of each role: the services' defaults (tests/deploy checks them). */}}
{{- define "kuberl.roles" -}}
actor: {port: 50053, service: kuberl.v1.Actor}
buffer: {port: 50051, service: kuberl.v1.Buffer}
learner: {port: 50052, service: kuberl.v1.Learner}
planner: {port: 50054, service: kuberl.v1.Planner}
{{- end -}}

{{- define "kuberl.metricsPort" -}}9400{{- end -}}

{{/* Where rank 0 of the learner group hosts its rendezvous (the learner container's port "rendezvous"). */}}
{{- define "kuberl.rendezvousPort" -}}29500{{- end -}}

{{/* Labels of one role's objects; the selector is the first three. Call with (dict "ctx" $ "role" "actor");
one policy's learners of a run of several add "policy" (and select by it). */}}
{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: kuberl
app.kubernetes.io/component: {{ .role }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .policy }}
kuberl.io/policy: {{ . }}
{{- end }}
{{- end -}}

{{/* The learner groups, as JSON: [{"policy": "", "name": "<name>-learner"}] for a run of one policy; for a
run of several (config.policies) one per policy, in name order, {"policy": P, "name": "<name>-learner-P"}:
each its own StatefulSet, headless Services <name>-learner-P and <name>-learner-P-group, Role and
disruption budget (services/planner/kube.py finds them by these names). */}}
{{- define "kuberl.learnerGroups" -}}
{{- $name := include "kuberl.name" . -}}
{{- $policies := get .Values.config "policies" | default dict -}}
{{- if eq (len $policies) 1 -}}
{{- fail (printf "config.policies: name two or more policies, each with its agents (without `policies`, one policy plays every agent); got only %s" (keys $policies | first)) -}}
{{- end -}}
{{- $groups := list -}}
{{- range $policy := keys $policies | sortAlpha -}}
{{- $group := printf "%s-learner-%s" $name $policy -}}
{{- /* A StatefulSet's pods carry controller-revision-hash: <statefulset>-<10 characters>, a label value of 63 at most. */ -}}
{{- if gt (len $group) 52 -}}
{{- fail (printf "config.policies.%s: the learner StatefulSet %s would be %d characters long; Kubernetes allows 52 (a shorter nameOverride or policy name)" $policy $group (len $group)) -}}
{{- end -}}
{{- $groups = append $groups (dict "policy" $policy "name" $group) -}}
{{- end -}}
{{- toJson ($groups | default (list (dict "policy" "" "name" (printf "%s-learner" $name)))) -}}
{{- end -}}

{{/* The actors' --learner: the learner Service; for several policies POLICY=ADDRESS for each. */}}
{{- define "kuberl.learnerAddresses" -}}
{{- $out := list -}}
{{- range $g := include "kuberl.learnerGroups" . | fromJsonArray -}}
{{- $address := printf "dns:///%s:50052" $g.name -}}
{{- $out = append $out (ternary (printf "%s=%s" $g.policy $address) $address (ne $g.policy "")) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "kuberl.labels" -}}
{{ include "kuberl.selectorLabels" . }}
app.kubernetes.io/part-of: kuberl
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
{{- end -}}

{{- define "kuberl.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .ctx.Values.image.tag -}}
{{- if and (eq .role "learner") .ctx.Values.learner.gpu.enabled -}}{{- $tag = printf "%s-cuda" $tag -}}{{- end -}}
{{ printf "%s/%s:%s" .ctx.Values.image.repository .role $tag }}
{{- end -}}

{{/* "true" when the planner scales the buffer shards (config.planner.buffer is set), else "". */}}
{{- define "kuberl.bufferScaled" -}}
{{- $planner := get .Values.config "planner" | default dict -}}
{{- if get $planner "buffer" -}}true{{- end -}}
{{- end -}}

{{/* The --buffer address list every actor and learner is given: the buffer Service alone for one shard
(as before shards existed), else each shard's pod by its stable name, in shard order (also for one
shard when the planner scales them: it names the shards it adds the same way). */}}
{{- define "kuberl.bufferAddresses" -}}
{{- $name := include "kuberl.name" . -}}
{{- $n := int .Values.buffer.shards -}}
{{- if and (eq $n 1) (not (include "kuberl.bufferScaled" .)) -}}
{{- printf "dns:///%s-buffer:50051" $name -}}
{{- else -}}
{{- $out := list -}}
{{- range $i := until $n -}}
{{- $out = append $out (printf "dns:///%s-buffer-%d.%s-buffer:50051" $name $i $name) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}
{{- end -}}

{{/* The experiment config with the planner's Kubernetes names filled in from this release's objects. */}}
{{- define "kuberl.config" -}}
{{- $name := include "kuberl.name" . -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $planner := get $cfg "planner" | default dict -}}
{{- $k8s := get $planner "kubernetes" | default dict -}}
{{- $_ := set $k8s "actor_deployment" (printf "%s-actor" $name) -}}
{{- $_ = set $k8s "learner_statefulset" (printf "%s-learner" $name) -}}
{{- $_ = set $k8s "actor_service" (printf "%s-actor" $name) -}}
{{- $_ = set $k8s "learner_service" (printf "%s-learner" $name) -}}
{{- $_ = set $k8s "buffer_service" (printf "%s-buffer" $name) -}}
{{- if include "kuberl.bufferScaled" . -}}
{{- /* The planner adds and drains shards: the buffer StatefulSet, its pods named as actors are told. */ -}}
{{- $_ = set $k8s "buffer_statefulset" (printf "%s-buffer" $name) -}}
{{- $_ = set $k8s "buffer_address" (printf "dns:///%s-buffer-{i}.%s-buffer:50051" $name $name) -}}
{{- end -}}
{{- $_ = set $k8s "grpc_port_name" "grpc" -}}
{{- $_ = set $k8s "lease_name" (printf "%s-planner" $name) -}}
{{- $_ = set $planner "kubernetes" $k8s -}}
{{- $_ = set $planner "backend" "kubernetes" -}}
{{- $_ = set $cfg "planner" $planner -}}
{{- /* The buffer's checkpoint settings come from buffer.checkpoint (one place, next to the volume). */ -}}
{{- $buffer := get $cfg "buffer" | default dict -}}
{{- range $key, $value := dict "checkpoint_dir" "buffer.checkpoint.enabled (the chart mounts the volume and passes --checkpoint-dir)" "checkpoint_interval_s" "buffer.checkpoint.intervalSeconds" "keep_checkpoints" "buffer.checkpoint.keep" -}}
{{- if hasKey $buffer $key -}}
{{- fail (printf "config.buffer.%s: the chart sets it; use %s" $key $value) -}}
{{- end -}}
{{- end -}}
{{- /* The number of buffer shards comes from buffer.shards (it also sets the buffer StatefulSet's replicas). */ -}}
{{- $topology := get $cfg "topology" | default dict -}}
{{- if and (hasKey $topology "buffers") (ne (int (get $topology "buffers")) (int .Values.buffer.shards)) -}}
{{- fail (printf "config.topology.buffers: the chart sets it from buffer.shards (%d); set that instead" (int .Values.buffer.shards)) -}}
{{- end -}}
{{- if gt (int .Values.buffer.shards) 1 -}}
{{- $_ = set $topology "buffers" (int .Values.buffer.shards) -}}
{{- $_ = set $cfg "topology" $topology -}}
{{- end -}}
{{- $ckpt := .Values.buffer.checkpoint -}}
{{- if $ckpt.enabled -}}
{{- $_ = set $buffer "checkpoint_interval_s" $ckpt.intervalSeconds -}}
{{- $_ = set $buffer "keep_checkpoints" $ckpt.keep -}}
{{- $_ = set $cfg "buffer" $buffer -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
The pod template shared by every role. Call with (dict "ctx" $ "role" "learner" "args" (list ...)
"env" (list ...) "mounts" (list ...) "volumes" (list ...) "token" false), and optionally "ports" (container ports
after grpc and metrics), "grace" (seconds, in place of <role>.terminationGracePeriodSeconds) and "fsGroup" true
(a writable volume: the learner always).
*/}}
{{- define "kuberl.podTemplate" -}}
{{- $r := index (include "kuberl.roles" . | fromYaml) .role -}}
{{- $v := index .ctx.Values .role -}}
{{- $name := include "kuberl.name" .ctx -}}
{{- $args := .args | default list -}}
{{- $env := .env | default list -}}
{{- $mounts := .mounts | default list -}}
{{- $volumes := .volumes | default list -}}
{{- /* TLS (values tls): the role's Secret as a directory, and $KUBERL_TLS_* over the config (as k8s/components/tls). */ -}}
{{- with .ctx.Values.tls -}}
{{- if .enabled -}}
{{- $dir := "/var/run/secrets/kuberl/tls" -}}
{{- $env = concat (list (dict "name" "KUBERL_TLS_CERT" "value" (printf "%s/tls.crt" $dir)) (dict "name" "KUBERL_TLS_KEY" "value" (printf "%s/tls.key" $dir)) (dict "name" "KUBERL_TLS_CA" "value" (printf "%s/ca.crt" $dir)) (dict "name" "KUBERL_TLS_SERVER_NAME" "value" .serverName)) $env -}}
{{- $mounts = append $mounts (dict "name" "tls" "mountPath" $dir "readOnly" true) -}}
{{- $volumes = append $volumes (dict "name" "tls" "secret" (dict "secretName" (printf "%s-%s-tls" $name $.role))) -}}
{{- if and .authorizeRoles (has $.role (list "buffer" "learner")) -}}
{{- $env = append $env (dict "name" "KUBERL_TLS_ROLE_NAMES" "value" (printf "actor=%s-actor,learner=%s-learner" $name $name)) -}}
{{- end -}}
{{- if and (eq $.role "actor") (eq .actorClientAuth "none") -}}
{{- $args = append $args "--tls-client-auth=none" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* Tokens (values auth): the Secret as a directory, $KUBERL_AUTH_TOKEN_FILES and the planner's $KUBERL_TOKEN_FILE (as k8s/components/tokens). */ -}}
{{- if .ctx.Values.auth.enabled -}}
{{- $dir := "/var/run/secrets/kuberl/tokens" -}}
{{- $env = prepend $env (dict "name" "KUBERL_AUTH_TOKEN_FILES" "value" (printf "%s/tokens" $dir)) -}}
{{- if eq .role "planner" -}}
{{- $env = append $env (dict "name" "KUBERL_TOKEN_FILE" "value" (printf "%s/planner" $dir)) -}}
{{- end -}}
{{- $mounts = append $mounts (dict "name" "tokens" "mountPath" $dir "readOnly" true) -}}
{{- $volumes = append $volumes (dict "name" "tokens" "secret" (dict "secretName" (.ctx.Values.auth.secretName | default (printf "%s-tokens" $name)))) -}}
{{- end -}}
metadata:
  labels:
    {{- include "kuberl.labels" . | nindent 4 }}
  annotations:
    prometheus.io/scrape: "true"
    prometheus.io/port: "{{ include "kuberl.metricsPort" . }}"
    prometheus.io/path: /metrics
    checksum/config: {{ include "kuberl.config" .ctx | sha256sum }}
spec:
  serviceAccountName: {{ include "kuberl.name" .ctx }}-{{ .role }}
  automountServiceAccountToken: {{ .token }}
  terminationGracePeriodSeconds: {{ .grace | default $v.terminationGracePeriodSeconds }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 10001
    runAsGroup: 10001
    {{- if or (eq .role "learner") .fsGroup }}
    fsGroup: 10001
    {{- end }}
    seccompProfile: {type: RuntimeDefault}
  {{- with .ctx.Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := $v.tolerations | default list }}
  {{- if and (eq .role "learner") .ctx.Values.learner.gpu.enabled }}
  {{- $tolerations = append $tolerations (dict "key" .ctx.Values.learner.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}
  {{- end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .role }}
      image: {{ include "kuberl.image" . }}
      imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
      args:
        - --config=/etc/kuberl/config.yaml
        - --listen=0.0.0.0:{{ $r.port }}
        - --metrics-listen=0.0.0.0:{{ include "kuberl.metricsPort" . }}
        {{- range $args }}
        - {{ . }}
        {{- end }}
      {{- with $env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - {name: grpc, containerPort: {{ $r.port }}, protocol: TCP}
        - {name: metrics, containerPort: {{ include "kuberl.metricsPort" . }}, protocol: TCP}
        {{- range .ports }}
        - {{ toJson . }}
        {{- end }}
      # HTTP probes of the metrics port (services/common/service/prometheus.py): /readyz is the gRPC health of
      # the role's service (NOT_SERVING from the start of shutdown), /livez that its event loop
      # answers. A native gRPC probe could not present the client certificate mutual TLS asks for.
      startupProbe:
        httpGet: {path: /readyz, port: metrics}
        timeoutSeconds: 4
        periodSeconds: 2
        failureThreshold: {{ ternary 30 (ternary 60 90 (eq .role "buffer")) (eq .role "planner") }}
      readinessProbe:
        httpGet: {path: /readyz, port: metrics}
        timeoutSeconds: 4
        periodSeconds: 5
        failureThreshold: 1
      livenessProbe:
        httpGet: {path: /livez, port: metrics}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 3
      resources:
        {{- $res := deepCopy $v.resources }}
        {{- if and (eq .role "learner") .ctx.Values.learner.gpu.enabled }}
        {{- $limits := get $res "limits" | default dict }}
        {{- $_ := set $limits .ctx.Values.learner.gpu.resourceName .ctx.Values.learner.gpu.count }}
        {{- $_ = set $res "limits" $limits }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities: {drop: [ALL]}
      volumeMounts:
        - {name: config, mountPath: /etc/kuberl, readOnly: true}
        {{- range $mounts }}
        - {{ toJson . }}
        {{- end }}
        - {name: tmp, mountPath: /tmp}
  volumes:
    - name: config
      configMap: {name: {{ include "kuberl.name" .ctx }}-config}
    {{- range $volumes }}
    - {{ toJson . }}
    {{- end }}
    - name: tmp
      emptyDir: {}
{{- end -}}
