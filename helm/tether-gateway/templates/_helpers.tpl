{{/* Names */}}
{{- define "tether-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tether-gateway.fullname" -}}
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

{{/* A derived name: fullname truncated so that "<fullname>-<suffix>" fits 63 characters. */}}
{{- define "tether-gateway.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "tether-gateway.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- end -}}

{{- define "tether-gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tether-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "tether-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tether-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tether-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tether-gateway.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tether-gateway.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Whether the gateway terminates TLS itself: not behind a TLS-terminating Ingress. */}}
{{- define "tether-gateway.terminatesTls" -}}
{{- if and .Values.tls.enabled (not .Values.ingress.enabled) -}}true{{- end -}}
{{- end -}}

{{- define "tether-gateway.tlsSecretName" -}}
{{- default (include "tether-gateway.suffixed" (list . "tls")) .Values.tls.secretName -}}
{{- end -}}

{{/* "host:port" for a bind address, with brackets for IPv6. */}}
{{- define "tether-gateway.bind" -}}
{{- $address := index . 0 -}}
{{- $port := index . 1 -}}
{{- if contains ":" $address -}}
{{- printf "[%s]:%d" $address (int $port) -}}
{{- else -}}
{{- printf "%s:%d" $address (int $port) -}}
{{- end -}}
{{- end -}}

{{/* The port of a "host:port" listen address. */}}
{{- define "tether-gateway.portOf" -}}
{{- regexFind "[0-9]+$" . -}}
{{- end -}}

{{/* The TCP frontend port of a tenant, or nothing. */}}
{{- define "tether-gateway.frontendPort" -}}
{{- with .frontend -}}
{{- with .tcp -}}
{{- include "tether-gateway.portOf" .listen -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tether-gateway.terminationGracePeriodSeconds" -}}
{{- add (int .Values.drain.gracePeriodSeconds) (int .Values.drain.terminationExtraSeconds) (int .Values.drain.preStopSleepSeconds) -}}
{{- end -}}

{{/*
Checks what the schema cannot: relations between values. Fails the install with the key and the
fix, like the binaries do.
*/}}
{{- define "tether-gateway.validate" -}}
{{- if and .Values.ingress.enabled (not .Values.listen.trustedProxies) -}}
{{- fail "listen.trustedProxies: with ingress.enabled, list the ingress controller pods' network (e.g. the cluster's pod CIDR) so the gateway believes X-Forwarded-For" -}}
{{- end -}}
{{- if and .Values.ingress.enabled .Values.listen.proxyProtocol -}}
{{- fail "listen.proxyProtocol: an Ingress (L7) sends no PROXY header; use it only behind an L4 load balancer with send-proxy" -}}
{{- end -}}
{{- if and .Values.existingConfig.configMap .Values.existingConfig.secret -}}
{{- fail "existingConfig: set configMap or secret, not both" -}}
{{- end -}}
{{- if and .Values.sharedFrontend.enabled (not .Values.sharedFrontend.secretName) -}}
{{- fail "sharedFrontend.secretName: name the Secret with the shared frontend's tls.crt, tls.key and client CA" -}}
{{- end -}}
{{- $ports := dict (toString (int .Values.listen.agentsPort)) "listen.agentsPort" -}}
{{- if hasKey $ports (toString (int .Values.listen.adminPort)) -}}
{{- fail "listen.adminPort: must differ from listen.agentsPort" -}}
{{- end -}}
{{- $_ := set $ports (toString (int .Values.listen.adminPort)) "listen.adminPort" -}}
{{- if .Values.sharedFrontend.enabled -}}
{{- $port := toString (int .Values.sharedFrontend.port) -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "sharedFrontend.port: %s is already used by %s" $port (get $ports $port)) -}}
{{- end -}}
{{- $_ := set $ports $port "sharedFrontend.port" -}}
{{- end -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peers.enabled) -}}
{{- fail "replicaCount: more than one replica needs peers.enabled, so replicas forward dials to the one holding the agent and agents keep a session to every replica" -}}
{{- end -}}
{{- if .Values.peers.enabled -}}
{{- if not .Values.peers.secretName -}}
{{- fail "peers.secretName: name the Secret with the peer certificate (tls.crt, tls.key, valid for peers.serverName) and the CA that signs it" -}}
{{- end -}}
{{- $port := toString (int .Values.peers.port) -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "peers.port: %s is already used by %s" $port (get $ports $port)) -}}
{{- end -}}
{{- $_ := set $ports $port "peers.port" -}}
{{- end -}}
{{- $socketDir := printf "%s/" (trimSuffix "/" .Values.sockets.mountPath) -}}
{{- $names := dict -}}
{{- range $i, $tenant := .Values.tenants -}}
{{- if hasKey $names $tenant.name -}}
{{- fail (printf "tenants[%d].name: tenant %q is listed twice" $i $tenant.name) -}}
{{- end -}}
{{- $_ := set $names $tenant.name true -}}
{{- with $tenant.auth -}}
{{- $sources := 0 -}}
{{- if .jwks_file -}}{{- $sources = add1 $sources -}}{{- end -}}
{{- if .jwks_url -}}{{- $sources = add1 $sources -}}{{- end -}}
{{- if .oidc_discovery -}}{{- $sources = add1 $sources -}}{{- end -}}
{{- if .token_review -}}{{- $sources = add1 $sources -}}{{- end -}}
{{- if .hmac_secret_file -}}{{- $sources = add1 $sources -}}{{- end -}}
{{- if ne (int $sources) 1 -}}
{{- fail (printf "tenants[%d].auth: set exactly one of jwks_file, jwks_url, oidc_discovery: true, token_review or hmac_secret_file" $i) -}}
{{- end -}}
{{- end -}}
{{- $frontend := $tenant.frontend | default dict -}}
{{- with $frontend.uds -}}
{{- if not (hasPrefix $socketDir .) -}}
{{- fail (printf "tenants[%d].frontend.uds: %s must be inside sockets.mountPath (%s), the only writable socket directory" $i . $socketDir) -}}
{{- end -}}
{{- end -}}
{{- $port := include "tether-gateway.frontendPort" $tenant -}}
{{- if $port -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "tenants[%d].frontend.tcp.listen: port %s is already used by %s" $i $port (get $ports $port)) -}}
{{- end -}}
{{- $_ := set $ports $port (printf "tenants[%d]" $i) -}}
{{- if and $.Values.networkPolicy.enabled (not $tenant.kas) -}}
{{- fail (printf "tenants[%d].kas: set namespaceSelector and/or podSelector of tenant %s's kube-apiserver pods, the only clients its TCP frontend accepts (or set networkPolicy.enabled: false)" $i $tenant.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $.Values.networkPolicy.enabled .Values.sharedFrontend.enabled -}}
{{- $any := false -}}
{{- range .Values.tenants -}}{{- if .kas -}}{{- $any = true -}}{{- end -}}{{- end -}}
{{- if not $any -}}
{{- fail "tenants[].kas: the shared frontend accepts the kube-apiserver pods of the tenants' kas selectors; set kas on the tenants that use it" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The gateway configuration file (YAML). */}}
{{- define "tether-gateway.config" -}}
{{- $listen := dict "agents" (include "tether-gateway.bind" (list .Values.listen.address .Values.listen.agentsPort)) "admin" (include "tether-gateway.bind" (list .Values.listen.address .Values.listen.adminPort)) -}}
{{- if .Values.listen.proxyProtocol -}}
{{- $_ := set $listen "proxy_protocol" true -}}
{{- end -}}
{{- with .Values.listen.trustedProxies -}}
{{- $_ := set $listen "trusted_proxies" . -}}
{{- end -}}
{{- $config := dict "listen" $listen "drain_grace_period" (printf "%ds" (int .Values.drain.gracePeriodSeconds)) -}}
{{- if include "tether-gateway.terminatesTls" . -}}
{{- $_ := set $config "tls" (dict "cert_file" "/etc/tether/tls/tls.crt" "key_file" "/etc/tether/tls/tls.key") -}}
{{- end -}}
{{- if .Values.sharedFrontend.enabled -}}
{{- $shared := dict "listen" (include "tether-gateway.bind" (list .Values.listen.address .Values.sharedFrontend.port)) "tls" (dict "cert_file" "/etc/tether/shared/tls.crt" "key_file" "/etc/tether/shared/tls.key") "client_ca_file" (printf "/etc/tether/shared/%s" .Values.sharedFrontend.clientCaKey) -}}
{{- $_ := set $config "shared_frontend" $shared -}}
{{- end -}}
{{- if .Values.peers.enabled -}}
{{- $p := .Values.peers -}}
{{- $tls := dict "cert_file" "/etc/tether/peers/tls.crt" "key_file" "/etc/tether/peers/tls.key" "ca_file" (printf "/etc/tether/peers/%s" $p.caKey) "server_name" $p.serverName -}}
{{- $dns := printf "%s.%s.svc.%s" (include "tether-gateway.suffixed" (list . "peers")) .Release.Namespace $p.clusterDomain -}}
{{- $_ := set $config "peers" (dict "listen" (include "tether-gateway.bind" (list .Values.listen.address $p.port)) "tls" $tls "dns" $dns "refresh_interval" $p.refreshInterval "max_inventory_entries" (int $p.maxInventoryEntries)) -}}
{{- end -}}
{{- range $key, $value := .Values.config -}}
{{- $_ := set $config $key $value -}}
{{- end -}}
{{- $tenants := list -}}
{{- range .Values.tenants -}}
{{- $tenants = append $tenants (omit . "secretName" "kas" "egress") -}}
{{- end -}}
{{- $_ := set $config "tenants" $tenants -}}
{{- toYaml $config -}}
{{- end -}}

{{/* An egress rule to the host of an https:// URL, when that host is an IP literal: (list url what). */}}
{{- define "tether-gateway.urlEgress" -}}
{{- $url := index . 0 -}}
{{- $what := index . 1 -}}
{{- $rest := trimPrefix "https://" $url -}}
{{- $authority := regexReplaceAll "/.*$" $rest "" -}}
{{- $host := "" -}}
{{- $port := "443" -}}
{{- if hasPrefix "[" $authority -}}
{{- $host = regexReplaceAll "^\\[([^\\]]+)\\].*$" $authority "${1}" -}}
{{- if regexMatch "\\]:[0-9]+$" $authority -}}{{- $port = regexFind "[0-9]+$" $authority -}}{{- end -}}
{{- else -}}
{{- $host = regexReplaceAll ":[0-9]+$" $authority "" -}}
{{- if regexMatch ":[0-9]+$" $authority -}}{{- $port = regexFind "[0-9]+$" $authority -}}{{- end -}}
{{- end -}}
{{- $cidr := "" -}}
{{- if regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" $host -}}
{{- $cidr = printf "%s/32" $host -}}
{{- else if contains ":" $host -}}
{{- $cidr = printf "%s/128" $host -}}
{{- end -}}
{{- if $cidr -}}
# {{ $what }}: {{ $url }}
- to:
    - ipBlock:
        cidr: {{ $cidr }}
  ports:
    - protocol: TCP
      port: {{ $port }}
{{- end -}}
{{- end -}}

{{/* A NetworkPolicy peer for a tenant's kube-apiserver pods (tenants[].kas). */}}
{{- define "tether-gateway.kasPeer" -}}
{{- $peer := dict -}}
{{- with .namespaceSelector -}}{{- $_ := set $peer "namespaceSelector" . -}}{{- end -}}
{{- with .podSelector -}}{{- $_ := set $peer "podSelector" . -}}{{- end -}}
{{- toYaml $peer -}}
{{- end -}}
