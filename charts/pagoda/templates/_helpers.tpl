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
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "pagoda.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- /* What the operator does, and nothing more:
  - read/watch LLMServices, write their status;
  - own the children it renders (Deployments, Services, the router's ServiceAccount/Role/RoleBinding,
    InferenceServices); it holds "pods get/list/watch" itself, so it may grant it to routers;
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
- apiGroups: ["serving.kserve.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
