{{/* Chart name, truncated to fit Kubernetes name limits. */}}
{{- define "fluxjoin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, or the release name alone when it already contains the chart name. */}}
{{- define "fluxjoin.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fluxjoin.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "fluxjoin.labels" -}}
helm.sh/chart: {{ include "fluxjoin.chart" .ctx }}
{{ include "fluxjoin.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: fluxjoin
{{- end }}

{{- define "fluxjoin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fluxjoin.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "fluxjoin.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "fluxjoin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "fluxjoin.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fluxjoin.leaseName" -}}
{{- default (printf "%s-operator" (include "fluxjoin.fullname" .)) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{- define "fluxjoin.pipelineName" -}}
{{- default (include "fluxjoin.fullname" .) .Values.pipeline.name }}
{{- end }}

{{- define "fluxjoin.topicPrefix" -}}
{{- default (printf "%s.%s" .Release.Namespace (include "fluxjoin.pipelineName" .)) .Values.pipeline.topicPrefix }}
{{- end }}

{{- define "fluxjoin.kafkaName" -}}
{{- printf "%s-kafka" (include "fluxjoin.fullname" .) }}
{{- end }}

{{/* The Kafka bootstrap servers: the trial broker's Service, else kafka.bootstrapServers. */}}
{{- define "fluxjoin.bootstrapServers" -}}
{{- if .Values.kafka.trial.enabled }}
{{- printf "%s.%s.svc:9092" (include "fluxjoin.kafkaName" .) .Release.Namespace }}
{{- else }}
{{- .Values.kafka.bootstrapServers }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations for a pod template. */}}
{{- define "fluxjoin.scrapeAnnotations" -}}
{{- if .Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{- define "fluxjoin.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "fluxjoin.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* Cross-field checks the JSON schema cannot express; a failed check stops install and template. */}}
{{- define "fluxjoin.validate" -}}
{{- $needsKafka := or .Values.pipeline.create .Values.generator.enabled }}
{{- if and .Values.kafka.trial.enabled .Values.kafka.bootstrapServers }}
{{- fail "set either kafka.bootstrapServers (an existing Kafka) or kafka.trial.enabled=true (a trial broker), not both" }}
{{- end }}
{{- if and $needsKafka (not (include "fluxjoin.bootstrapServers" .)) }}
{{- fail "no Kafka: set kafka.bootstrapServers=HOST:PORT (an existing cluster) or kafka.trial.enabled=true (a single-node trial broker); or pipeline.create=false and generator.enabled=false to install only the operator" }}
{{- end }}
{{- if and .Values.pipeline.create (lt (int .Values.pipeline.partitions) (int .Values.pipeline.replicas)) }}
{{- fail (printf "pipeline.partitions (%d) must be >= pipeline.replicas (%d)" (int .Values.pipeline.partitions) (int .Values.pipeline.replicas)) }}
{{- end }}
{{- if and .Values.generator.enabled (not .Values.pipeline.create) }}
{{- fail "generator.enabled needs pipeline.create=true (the generator feeds the example pipeline's topics)" }}
{{- end }}
{{- if gt (len (include "fluxjoin.pipelineName" .)) 40 }}
{{- fail "the pipeline name (pipeline.name, else the release full name) must be at most 40 characters" }}
{{- end }}
{{- end }}

{{/* kafka.security with every key present (an upgrade with --reuse-values keeps an older release's
values, which may lack it): protocol, saslMechanism, username, and the Secret names and keys. */}}
{{- define "fluxjoin.kafkaSecurity" -}}
{{- $s := .Values.kafka.security | default dict }}
{{- toJson (dict
  "protocol" (dig "protocol" "PLAINTEXT" $s)
  "saslMechanism" (dig "saslMechanism" "" $s)
  "username" (dig "username" "" $s)
  "password" (dig "passwordSecret" "name" "" $s) "passwordKey" (dig "passwordSecret" "key" "password" $s)
  "ca" (dig "caSecret" "name" "" $s) "caKey" (dig "caSecret" "key" "ca.crt" $s)
  "client" (dig "clientCertSecret" "name" "" $s)
  "certKey" (dig "clientCertSecret" "certKey" "user.crt" $s) "keyKey" (dig "clientCertSecret" "keyKey" "user.key" $s)
) }}
{{- end }}

{{/* The FLUXJOIN_KAFKA_* variables of a container that logs in to Kafka as kafka.security says; the
files they name come from fluxjoin.kafkaCredentialsVolume, mounted at /etc/fluxjoin/kafka. The operator
renders the same for instance pods (controller.k8s.manifests.kafka_credentials; a test keeps them equal). */}}
{{- define "fluxjoin.kafkaCredentialsEnv" -}}
{{- $s := include "fluxjoin.kafkaSecurity" . | fromJson }}
{{- if ne $s.protocol "PLAINTEXT" }}
- name: FLUXJOIN_KAFKA_SECURITY_PROTOCOL
  value: {{ $s.protocol | quote }}
{{- with $s.saslMechanism }}
- name: FLUXJOIN_KAFKA_SASL_MECHANISM
  value: {{ . | quote }}
{{- end }}
{{- with $s.username }}
- name: FLUXJOIN_KAFKA_SASL_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- if $s.password }}
- name: FLUXJOIN_KAFKA_SASL_PASSWORD_FILE
  value: /etc/fluxjoin/kafka/password
{{- end }}
{{- if $s.ca }}
- name: FLUXJOIN_KAFKA_SSL_CA_FILE
  value: /etc/fluxjoin/kafka/ca.crt
{{- end }}
{{- if $s.client }}
- name: FLUXJOIN_KAFKA_SSL_CERT_FILE
  value: /etc/fluxjoin/kafka/user.crt
- name: FLUXJOIN_KAFKA_SSL_KEY_FILE
  value: /etc/fluxjoin/kafka/user.key
{{- end }}
{{- end }}
{{- end }}

{{/* Whether kafka.security names any Secret to mount. */}}
{{- define "fluxjoin.kafkaCredentialsMounted" -}}
{{- $s := include "fluxjoin.kafkaSecurity" . | fromJson }}
{{- if and (ne $s.protocol "PLAINTEXT") (or $s.password $s.ca $s.client) }}true{{ end }}
{{- end }}

{{/* The projected volume of the Secrets kafka.security names (see fluxjoin.kafkaCredentialsEnv). */}}
{{- define "fluxjoin.kafkaCredentialsVolume" -}}
{{- $s := include "fluxjoin.kafkaSecurity" . | fromJson }}
{{- if include "fluxjoin.kafkaCredentialsMounted" . }}
- name: kafka-credentials
  projected:
    defaultMode: 288
    sources:
      {{- if $s.password }}
      - secret:
          name: {{ $s.password | quote }}
          items: [{key: {{ $s.passwordKey | quote }}, path: password}]
      {{- end }}
      {{- if $s.ca }}
      - secret:
          name: {{ $s.ca | quote }}
          items: [{key: {{ $s.caKey | quote }}, path: ca.crt}]
      {{- end }}
      {{- if $s.client }}
      - secret:
          name: {{ $s.client | quote }}
          items: [{key: {{ $s.certKey | quote }}, path: user.crt}]
      - secret:
          name: {{ $s.client | quote }}
          items: [{key: {{ $s.keyKey | quote }}, path: user.key}]
      {{- end }}
{{- end }}
{{- end }}

{{/* The mount of fluxjoin.kafkaCredentialsVolume in a container. */}}
{{- define "fluxjoin.kafkaCredentialsMount" -}}
{{- if include "fluxjoin.kafkaCredentialsMounted" . }}
- name: kafka-credentials
  mountPath: /etc/fluxjoin/kafka
  readOnly: true
{{- end }}
{{- end }}
