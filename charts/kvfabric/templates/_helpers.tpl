{{/* Object names. KubeRay derives pod and service names from the RayCluster's name: it must be a
DNS-1035 label of at most 53 characters, and a RayJob's at most 47; both objects carry this name. */}}
{{- define "kvfabric.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfabric.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvfabric.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfabric.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfabric.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object; pass a dict with "ctx" (the root) and "component". */}}
{{- define "kvfabric.labels" -}}
{{ include "kvfabric.selectorLabels" .ctx }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvfabric
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ include "kvfabric.chart" .ctx }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvfabric.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvfabric.configMapName" -}}{{ include "kvfabric.fullname" . }}-config{{- end -}}
{{- define "kvfabric.dashboardName" -}}{{ include "kvfabric.fullname" . }}-dashboard{{- end -}}
{{- define "kvfabric.metricsServiceName" -}}{{ include "kvfabric.fullname" . }}-metrics{{- end -}}

{{/* Paths inside every Ray container. */}}
{{- define "kvfabric.configDir" -}}/etc/kvfabric{{- end -}}
{{- define "kvfabric.configPath" -}}/etc/kvfabric/kvfabric.toml{{- end -}}
{{/* cert_dir is an in-memory folder of links, made by the tls-setup init container under the names
cluster/node_actor.py opens: ca.pem and <pod name>.pem/.key from the pod's own certificate (cert-manager
csi-driver, issued for this pod when it starts), crl.pem from the revocation-list Secret. Links, so a
renewed certificate or a new list is seen; no pod ever sees the CA key. */}}
{{- define "kvfabric.certDir" -}}/var/run/kvfabric-tls{{- end -}}
{{- define "kvfabric.nodeTlsDir" -}}/etc/kvfabric-node-tls{{- end -}}
{{- define "kvfabric.crlDir" -}}/etc/kvfabric-crl{{- end -}}
{{- define "kvfabric.nodesServiceName" -}}{{ include "kvfabric.fullname" . }}-nodes{{- end -}}
{{- define "kvfabric.issuerName" -}}{{ include "kvfabric.fullname" . }}-ca{{- end -}}
{{- define "kvfabric.crlSecretName" -}}
{{- default (printf "%s-crl" (include "kvfabric.fullname" .)) .Values.tls.revocationListSecret -}}
{{- end -}}

{{/* The Secret holding the cluster CA (tls.crt, tls.key), read only by cert-manager's CA Issuer: cert-manager's
CA Certificate writes it, or the operator made it. */}}
{{- define "kvfabric.caSecretName" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- include "kvfabric.fullname" . }}-ca
{{- else -}}
{{- .Values.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* A TOML value from a YAML value. Helm reads YAML numbers as float64, so whole numbers are printed as
integers (fabric/config.py accepts an integer where it expects a float, never the reverse). */}}
{{- define "kvfabric.tomlValue" -}}
{{- if kindIs "string" . -}}
{{- toJson . -}}
{{- else if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if kindIs "slice" . -}}
{{- toJson . -}}
{{- else if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* Render-time checks the values schema cannot express. Failing here names the value to change. */}}
{{- define "kvfabric.validate" -}}
{{- $fullname := include "kvfabric.fullname" . -}}
{{- if gt (len $fullname) 47 -}}
{{- fail (printf "name %q is %d characters; KubeRay needs at most 47 for the RayJob and its RayCluster (53): use a shorter release name or set fullnameOverride" $fullname (len $fullname)) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $fullname) -}}
{{- fail (printf "name %q is not a DNS-1035 label (lowercase letters, digits and '-', starting with a letter), which KubeRay requires: use another release name or set fullnameOverride" $fullname) -}}
{{- end -}}
{{- if and (not .Values.tls.certManager.enabled) (not .Values.tls.existingSecret) -}}
{{- fail "tls: the transports use mutual TLS and need the cluster CA to issue node certificates: set tls.existingSecret (the CA Secret cert-manager signs with) or tls.certManager.enabled=true" -}}
{{- end -}}
{{- if and .Values.gcsFaultTolerance.enabled (not .Values.gcsFaultTolerance.redisAddress) -}}
{{- fail "gcsFaultTolerance.enabled needs gcsFaultTolerance.redisAddress (host:port of an external Redis)" -}}
{{- end -}}
{{- $names := dict -}}
{{- range .Values.workerGroups -}}
{{- $g := mergeOverwrite (deepCopy $.Values.workerDefaults) . -}}
{{- if hasKey $names $g.name -}}
{{- fail (printf "workerGroups: the name %q is used twice" $g.name) -}}
{{- end -}}
{{- $_ := set $names $g.name true -}}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) -}}
{{- fail (printf "workerGroups[%s]: minReplicas (%d) > maxReplicas (%d)" $g.name (int $g.minReplicas) (int $g.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "workerGroups[%s]: replicas (%d) must lie in [minReplicas, maxReplicas] = [%d, %d]" $g.name (int $g.replicas) (int $g.minReplicas) (int $g.maxReplicas)) -}}
{{- end -}}
{{- if or (hasKey (default dict $g.resources.requests) $g.gpuResource) (hasKey (default dict $g.resources.limits) $g.gpuResource) -}}
{{- fail (printf "workerGroups[%s]: set GPUs with `gpus`, not in resources (%s)" $g.name $g.gpuResource) -}}
{{- end -}}
{{- end -}}
{{- if or (eq (int .Values.ports.tcp) (int .Values.metrics.port)) (eq (int .Values.ports.quic) (int .Values.metrics.port)) -}}
{{- fail (printf "metrics.port (%d) collides with a transport port (ports.tcp %d, ports.quic %d)" (int .Values.metrics.port) (int .Values.ports.tcp) (int .Values.ports.quic)) -}}
{{- end -}}
{{- end -}}

{{/* Volumes shared by the head and worker pods. */}}
{{- define "kvfabric.volumes" -}}
- name: config
  configMap:
    name: {{ include "kvfabric.configMapName" .ctx }}
# This pod's own certificate and key, issued by the chart's CA Issuer when the pod starts (cert-manager
# csi-driver): the first DNS name is the node name (the pod name), the second the name it advertises.
- name: node-tls
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ include "kvfabric.issuerName" .ctx }}
      csi.cert-manager.io/issuer-kind: Issuer
      csi.cert-manager.io/issuer-group: cert-manager.io
      csi.cert-manager.io/dns-names: "${POD_NAME},${POD_NAME}.{{ include "kvfabric.nodesServiceName" .ctx }}.${POD_NAMESPACE}.svc"
      csi.cert-manager.io/key-usages: "digital signature,server auth,client auth"
      csi.cert-manager.io/key-encoding: PKCS8
      csi.cert-manager.io/duration: {{ .ctx.Values.tls.nodeCertificateDuration }}
      csi.cert-manager.io/certificate-file: tls.crt
      csi.cert-manager.io/privatekey-file: tls.key
      csi.cert-manager.io/ca-file: ca.crt
# The CA's revocation list (`kvfabric certs revoke`), when the operator has published one.
- name: crl
  secret:
    secretName: {{ include "kvfabric.crlSecretName" .ctx }}
    optional: true
    items:
      - {key: crl.pem, path: crl.pem}
- name: certs
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
- name: ssd
{{- $ssd := .ctx.Values.ssd }}
{{- if eq $ssd.type "hostPath" }}
  hostPath:
    path: {{ $ssd.hostPath.path }}
    type: DirectoryOrCreate
{{- else if eq $ssd.type "ephemeralVolume" }}
  ephemeral:
    volumeClaimTemplate:
      metadata:
        labels:
          {{- include "kvfabric.labels" (dict "ctx" .ctx "component" "ssd") | nindent 10 }}
      spec:
        accessModes: {{ toJson $ssd.ephemeralVolume.accessModes }}
        {{- with $ssd.ephemeralVolume.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $ssd.ephemeralVolume.size }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $ssd.emptyDir.sizeLimit }}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- end -}}

{{- define "kvfabric.volumeMounts" -}}
- {name: config, mountPath: {{ include "kvfabric.configDir" . }}, readOnly: true}
- {name: node-tls, mountPath: {{ include "kvfabric.nodeTlsDir" . }}, readOnly: true}
- {name: crl, mountPath: {{ include "kvfabric.crlDir" . }}, readOnly: true}
- {name: certs, mountPath: {{ include "kvfabric.certDir" . }}}
- {name: ssd, mountPath: {{ .Values.ssd.mountPath }}}
- {name: dshm, mountPath: /dev/shm}
{{- end -}}

{{- define "kvfabric.env" -}}
# Default paths of anything not named in the config land on the SSD volume (fabric/config.py).
- {name: KVFABRIC_HOME, value: {{ .Values.ssd.mountPath | quote }}}
- {name: KVFABRIC_CONFIG, value: {{ include "kvfabric.configPath" . | quote }}}
{{ include "kvfabric.identityEnv" . }}
{{- end -}}

{{/* The node's identity: its pod name (the certificate's first DNS name) and the DNS name it advertises. */}}
{{- define "kvfabric.identityEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- {name: KVFABRIC_NODE_NAME, value: "$(POD_NAME)"}
- {name: KVFABRIC_ADVERTISE_HOST, value: "$(POD_NAME).{{ include "kvfabric.nodesServiceName" . }}.$(POD_NAMESPACE).svc"}
{{- end -}}

{{/* Container ports of a Ray pod that runs a NodeActor; the metrics Service and PodMonitor select kvf-metrics. */}}
{{- define "kvfabric.fabricPorts" -}}
- {name: kvf-tls, containerPort: {{ .Values.ports.tcp }}, protocol: TCP}
- {name: kvf-quic, containerPort: {{ .Values.ports.quic }}, protocol: UDP}
- {name: kvf-metrics, containerPort: {{ .Values.metrics.port }}, protocol: TCP}
{{- end -}}

{{- define "kvfabric.initContainers" -}}
initContainers:
  # The node reads <cert_dir>/ca.pem, <cert_dir>/<node name>.pem/.key and, when published, crl.pem
  # (transports/trust/certs.py): link them to the pod's own certificate and the revocation-list Secret.
  - name: tls-setup
    image: {{ include "kvfabric.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    env:
      {{- include "kvfabric.identityEnv" . | nindent 6 }}
    command: ["sh", "-c", "ln -sfn {{ include "kvfabric.nodeTlsDir" . }}/ca.crt {{ include "kvfabric.certDir" . }}/ca.pem && ln -sfn {{ include "kvfabric.nodeTlsDir" . }}/tls.crt {{ include "kvfabric.certDir" . }}/$KVFABRIC_NODE_NAME.pem && ln -sfn {{ include "kvfabric.nodeTlsDir" . }}/tls.key {{ include "kvfabric.certDir" . }}/$KVFABRIC_NODE_NAME.key && ln -sfn {{ include "kvfabric.crlDir" . }}/crl.pem {{ include "kvfabric.certDir" . }}/crl.pem"]
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {cpu: 100m, memory: 64Mi}
    volumeMounts:
      - {name: node-tls, mountPath: {{ include "kvfabric.nodeTlsDir" . }}, readOnly: true}
      - {name: crl, mountPath: {{ include "kvfabric.crlDir" . }}, readOnly: true}
      - {name: certs, mountPath: {{ include "kvfabric.certDir" . }}}
{{- if and (eq .Values.ssd.type "hostPath") .Values.ssd.hostPath.fixPermissions }}
  - name: ssd-permissions
    image: {{ include "kvfabric.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["sh", "-c", "chown 1000:100 {{ .Values.ssd.mountPath }} && chmod 0770 {{ .Values.ssd.mountPath }}"]
    securityContext:
      runAsUser: 0
      runAsNonRoot: false
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {cpu: 100m, memory: 64Mi}
    volumeMounts:
      - {name: ssd, mountPath: {{ .Values.ssd.mountPath }}}
{{- end }}
{{- end -}}
