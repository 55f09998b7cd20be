{{- define "pagoda.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.labels" -}}
app.kubernetes.io/name: pagoda
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagoda.selector" -}}
app.kubernetes.io/name: pagoda
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagoda.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pagoda.redisSecretName" -}}
{{- default (printf "%s-redis" (include "pagoda.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "pagoda.redisUrl" -}}
{{- printf "%s://%s-redis.%s.svc:6379/0" (ternary "rediss" "redis" .Values.redis.tls.enabled) (include "pagoda.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- /* The URL a pagoda client of the chart's Redis is given: the password as an env reference
  (the kubelet expands $(PAGODA_REDIS_PASSWORD) in args) and, with TLS, the mounted CA. */}}
{{- define "pagoda.redisClientUrl" -}}
{{- $auth := ternary ":$(PAGODA_REDIS_PASSWORD)@" "" .Values.redis.auth.enabled -}}
{{- $url := printf "%s://%s%s-redis.%s.svc:6379/0" (ternary "rediss" "redis" .Values.redis.tls.enabled) $auth (include "pagoda.fullname" .) .Release.Namespace -}}
{{- if .Values.redis.tls.enabled -}}
{{- $url = printf "%s?ssl_ca_certs=%s/ca.crt" $url (include "pagoda.redisCaMount" .) -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{- define "pagoda.redisCaMount" -}}/etc/pagoda/redis-tls{{- end -}}

{{- /* Pod and container hardening shared by the chart's pagoda pods. */}}
{{- define "pagoda.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pagoda.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- /* The Redis CA volume (TLS only), mounted at pagoda.redisCaMount. */}}
{{- define "pagoda.redisCaVolume" -}}
{{- if .Values.redis.tls.enabled }}
- name: redis-ca
  secret:
    secretName: {{ required "redis.tls.existingSecret is required when redis.tls.enabled" .Values.redis.tls.existingSecret }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{- define "pagoda.redisCaMountEntry" -}}
{{- if .Values.redis.tls.enabled }}
- name: redis-ca
  mountPath: {{ include "pagoda.redisCaMount" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- /* What the operator does, and nothing more:
  - read/watch LLMServices, write their status;
  - own the children it renders (Deployments, Services, the replicas' NetworkPolicy and
    PodDisruptionBudget, the router's ServiceAccount/Role/RoleBinding, InferenceServices, and the
    LeaderWorkerSets of multi-node replicas); it holds "pods get/list/watch" itself, so it may grant it to routers;
  - patch a pod's deletion cost before a drained scale-in; read a Redis password Secret;
  - post events. */}}
{{- define "pagoda.operatorRules" }}
- apiGroups: ["pagoda.dev"]
  resources: ["llmservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pagoda.dev"]
  resources: ["llmservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["serving.kserve.io"]
  resources: ["inferenceservices", "llminferenceservices"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
