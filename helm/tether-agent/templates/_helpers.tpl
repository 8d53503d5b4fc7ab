{{/* Names */}}
{{- define "tether-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tether-agent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>", the full name truncated so that the result fits 63 characters. */}}
{{- define "tether-agent.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "tether-agent.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- end -}}

{{- define "tether-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tether-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "tether-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tether-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tether-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tether-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tether-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tether-agent.setupImage" -}}
{{- with .Values.hostAddress.setup.image -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{/* Whether a CA bundle for the gateway is configured. */}}
{{- define "tether-agent.hasCa" -}}
{{- with .Values.gateway.ca -}}
{{- if or .pem .existingConfigMap .existingSecret -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whether a proxy password is configured. */}}
{{- define "tether-agent.hasProxyPassword" -}}
{{- if .Values.proxy.passwordSecret.name -}}true{{- end -}}
{{- end -}}

{{/* Relations between values the schema cannot express; errors name the key and the fix. */}}
{{- define "tether-agent.validate" -}}
{{- $ca := .Values.gateway.ca -}}
{{- if gt (len (compact (list $ca.pem $ca.existingConfigMap $ca.existingSecret))) 1 -}}
{{- fail "gateway.ca: set one of pem, existingConfigMap or existingSecret" -}}
{{- end -}}
{{- if and .Values.proxy.passwordSecret.name (not .Values.proxy.username) -}}
{{- fail "proxy.username: proxy.passwordSecret holds a password; also set the proxy user" -}}
{{- end -}}
{{- if and (eq (toString .Values.gateway.systemRoots) "false") (not (include "tether-agent.hasCa" .)) -}}
{{- fail "gateway.systemRoots: false needs gateway.ca (pem, existingConfigMap or existingSecret), or nothing is trusted" -}}
{{- end -}}
{{- if and .Values.hostAddress.setup.enabled (not .Values.nodeToControlPlane.enabled) -}}
{{- fail "hostAddress.setup.enabled: the host-scoped address is for node -> control-plane listeners; also set nodeToControlPlane.enabled" -}}
{{- end -}}
{{- if .Values.nodeToControlPlane.enabled -}}
{{- if not .Values.nodeToControlPlane.listeners -}}
{{- fail "nodeToControlPlane.listeners: list at least one {bind, target}" -}}
{{- end -}}
{{- if .Values.hostAddress.setup.enabled -}}
{{- $address := .Values.hostAddress.setup.address -}}
{{- range $i, $l := .Values.nodeToControlPlane.listeners -}}
{{- if not (hasPrefix (printf "%s:" $address) $l.bind) -}}
{{- fail (printf "nodeToControlPlane.listeners[%d].bind: %s is not on hostAddress.setup.address %s; bind the listener to the address the init container configures" $i $l.bind $address) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The agent configuration file (YAML). Argument: (dict "root" $ "tokenFile" path "caFile" path-or-""
"passwordFile" path-or-""). identifiers.addresses is not in the file: it comes from the environment
(TETHER__IDENTIFIERS__ADDRESSES, the node IP from the downward API or agent.env).
*/}}
{{- define "tether-agent.config" -}}
{{- $v := .root.Values -}}
{{- $gateway := dict "url" $v.gateway.url "token_file" .tokenFile -}}
{{- with .caFile -}}{{- $_ := set $gateway "ca_file" . -}}{{- end -}}
{{- if not (kindIs "invalid" $v.gateway.systemRoots) -}}{{- $_ := set $gateway "system_roots" $v.gateway.systemRoots -}}{{- end -}}
{{- with $v.gateway.serverName -}}{{- $_ := set $gateway "server_name" . -}}{{- end -}}
{{- if $v.proxy.username -}}
{{- $proxy := dict "username" $v.proxy.username -}}
{{- with .passwordFile -}}{{- $_ := set $proxy "password_file" . -}}{{- end -}}
{{- $_ := set $gateway "proxy" $proxy -}}
{{- end -}}
{{- $userGateway := dict -}}
{{- with $v.config.gateway -}}{{- $userGateway = deepCopy . -}}{{- end -}}
{{- /* A deep merge: the chart's keys win (the schema keeps them out of config.gateway). */ -}}
{{- $gateway = merge $gateway $userGateway -}}
{{- $identifiers := dict "default_route" $v.identifiers.defaultRoute -}}
{{- with $v.identifiers.hosts -}}{{- $_ := set $identifiers "hosts" . -}}{{- end -}}
{{- with $v.identifiers.cidrs -}}{{- $_ := set $identifiers "cidrs" . -}}{{- end -}}
{{- $allow := list -}}
{{- if $v.allow.kubelet.enabled -}}
{{- $allow = append $allow (dict "own_addresses" true "ports" $v.allow.kubelet.ports) -}}
{{- end -}}
{{- range $v.allow.extra -}}{{- $allow = append $allow . -}}{{- end -}}
{{- $config := dict "gateway" $gateway "identifiers" $identifiers "allow" $allow "admin_listen" (printf (ternary "[%s]:%d" "%s:%d" (contains ":" $v.admin.address)) $v.admin.address (int $v.admin.port)) -}}
{{- with $v.agentId -}}{{- $_ := set $config "agent_id" . -}}{{- end -}}
{{- if $v.nodeToControlPlane.enabled -}}
{{- $_ := set $config "listeners" $v.nodeToControlPlane.listeners -}}
{{- end -}}
{{- range $key, $value := $v.config -}}
{{- if ne $key "gateway" -}}{{- $_ := set $config $key $value -}}{{- end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Proxy environment shared by the DaemonSet and the static pod (a YAML list, or nothing). */}}
{{- define "tether-agent.proxyEnv" -}}
{{- $env := list -}}
{{- with .Values.proxy.httpsProxy -}}{{- $env = append $env (dict "name" "HTTPS_PROXY" "value" .) -}}{{- end -}}
{{- with .Values.proxy.noProxy -}}{{- $env = append $env (dict "name" "NO_PROXY" "value" .) -}}{{- end -}}
{{- with $env -}}{{- toYaml . -}}{{- end -}}
{{- end -}}

{{/* Identity from the downward API, shared by the DaemonSet and the static pod. */}}
{{- define "tether-agent.downwardEnv" -}}
# The agent id defaults to the node name.
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
# The node's IP: identifiers.addresses (routing) and the own_addresses allow rule (the kubelet).
- name: TETHER__IDENTIFIERS__ADDRESSES
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end -}}
