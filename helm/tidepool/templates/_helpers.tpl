{{/* Names. */}}
{{- define "tidepool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tidepool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tidepool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tidepool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tidepool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include with (list $ "node"). */}}
{{- define "tidepool.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "tidepool.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tidepool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tidepool.etcdImage" -}}
{{- printf "%s:%s" .Values.etcd.image.repository (default .Chart.AppVersion .Values.etcd.image.tag) -}}
{{- end -}}

{{/* Secrets. */}}
{{- define "tidepool.caSecret" -}}
{{- default (printf "%s-ca" (include "tidepool.fullname" .)) .Values.tls.ca.secretName -}}
{{- end -}}

{{- define "tidepool.tokenSecret" -}}
{{- default (printf "%s-admin-token" (include "tidepool.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "tidepool.clientSecret" -}}
{{- printf "%s-client-%s" (include "tidepool.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{/*
The name etcd requires in a client certificate (`--client-cert-allowed-hostname`):
only the coordinators' certificates (and the members' own) carry it, so a
certificate of the cluster's CA held by a node, the gateway or an
application (`tls.clients`) cannot read or write the cluster map in etcd.
`.invalid` never resolves: it is a marker, not an address.
*/}}
{{- define "tidepool.etcdClientHost" -}}
{{- printf "%s-etcd-client.invalid" (include "tidepool.fullname" .) -}}
{{- end -}}

{{/* DNS. */}}
{{- define "tidepool.svcSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "tidepool.coordinatorUrl" -}}
{{- printf "https://%s-coordinator.%s:7400" (include "tidepool.fullname" .) (include "tidepool.svcSuffix" .) -}}
{{- end -}}

{{- define "tidepool.etcdUrls" -}}
{{- if .Values.etcd.enabled -}}
{{- $full := include "tidepool.fullname" . -}}
{{- $suffix := include "tidepool.svcSuffix" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $urls = append $urls (printf "https://%s-etcd-%d.%s-etcd-headless.%s:2379" $full $i $full $suffix) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/*
The CA volumes of a pod: `ca` (certificate only, for the main container)
and `ca-signing` (certificate and key, for the init container that issues
the pod's own certificate; the main container never mounts it).
*/}}
{{- define "tidepool.caVolumes" -}}
- name: ca
  secret:
    secretName: {{ include "tidepool.caSecret" . }}
    items:
      - {key: {{ .Values.tls.ca.certKey | quote }}, path: ca.pem}
- name: ca-signing
  secret:
    secretName: {{ include "tidepool.caSecret" . }}
    defaultMode: 0440
    items:
      - {key: {{ .Values.tls.ca.certKey | quote }}, path: ca.pem}
      - {key: {{ .Values.tls.ca.keyKey | quote }}, path: ca-key.pem}
- name: tls
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- end -}}

{{/*
An init container issuing the pod's certificate into /tls (tls.pem,
tls-key.pem): include with (dict "root" $ "kind" "node" "hosts" (list ...)).
The pod's name is its identity; POD_NAME and POD_IP come from the downward
API.
*/}}
{{- define "tidepool.certsInit" -}}
{{- $ := .root -}}
- name: certs
  image: {{ include "tidepool.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  args:
    - certs
    - issue
    - --dir=/tls
    - --ca-dir=/ca-signing
    - --out=tls
    - --days={{ $.Values.tls.certificateDays }}
    {{- range .hosts }}
    - --host={{ . }}
    {{- end }}
    - --host=$(POD_IP)
    - {{ .kind }}
    - $(POD_NAME)
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
  securityContext:
    {{- toYaml $.Values.containerSecurityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - {name: ca-signing, mountPath: /ca-signing, readOnly: true}
    - {name: tls, mountPath: /tls}
{{- end -}}

{{/* A root init container chowning a data volume (volumePermissions). */}}
{{- define "tidepool.volumePermissions" -}}
{{- $ := .root -}}
{{- if $.Values.volumePermissions.enabled }}
- name: volume-permissions
  image: {{ .image }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  # The volume's root only: what the service writes under it is its own.
  command: [/bin/chown, {{ printf "%d:%d" (int .uid) (int .uid) | quote }}, {{ .path | quote }}]
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: [ALL]
      add: [CHOWN]
  volumeMounts:
    - {name: data, mountPath: {{ .path }}}
{{- end }}
{{- end -}}

{{/* Refuse values that cannot work. */}}
{{- define "tidepool.validate" -}}
{{- if lt (int .Values.nodes.replicas) (int .Values.cluster.replicationFactor) -}}
{{- fail (printf "nodes.replicas (%d) must be at least cluster.replicationFactor (%d)" (int .Values.nodes.replicas) (int .Values.cluster.replicationFactor)) -}}
{{- end -}}
{{- if and (not .Values.etcd.enabled) (empty .Values.etcd.external.endpoints) -}}
{{- fail "etcd.enabled is false: give etcd.external.endpoints" -}}
{{- end -}}
{{- if and .Values.tls.certManager.enabled .Values.tls.ca.create -}}
{{- fail "tls.certManager.enabled: set tls.ca.create=false (cert-manager makes the CA Secret)" -}}
{{- end -}}
{{- if not (has "admin" .Values.tls.clients) -}}
{{- fail "tls.clients must include admin (helm test and the node pods' tidectl use it)" -}}
{{- end -}}
{{- /* etcd's members are named once, at its first start
(--initial-cluster-state=new): a changed member count would start a second,
empty etcd cluster beside the first (1 -> 3) or leave it without a quorum
(3 -> 1). (lookup finds nothing under `helm template`.) */ -}}
{{- if .Values.etcd.enabled -}}
{{- $etcd := lookup "apps/v1" "StatefulSet" .Release.Namespace (printf "%s-etcd" (include "tidepool.fullname" .)) -}}
{{- if and $etcd (ne (int $etcd.spec.replicas) (int .Values.etcd.replicas)) -}}
{{- fail (printf "etcd.replicas cannot change on an installed release (it runs %d member(s), asked %d): etcd's members are fixed at its first start; keep %d" (int $etcd.spec.replicas) (int .Values.etcd.replicas) (int $etcd.spec.replicas)) -}}
{{- end -}}
{{- end -}}
{{- /* A StatefulSet's volume claim templates cannot change: an upgrade
changing a volume's size failed with the API server's "forbidden" after
rendering. Said here, with what to do instead. */ -}}
{{- $full := include "tidepool.fullname" . -}}
{{- range $set := list (list "node" .Values.nodes.persistence.size "nodes") (list "etcd" .Values.etcd.persistence.size "etcd") -}}
{{- $found := lookup "apps/v1" "StatefulSet" $.Release.Namespace (printf "%s-%s" $full (index $set 0)) -}}
{{- if $found -}}
{{- $claim := index $found.spec.volumeClaimTemplates 0 -}}
{{- $size := toString $claim.spec.resources.requests.storage -}}
{{- if ne $size (toString (index $set 1)) -}}
{{- fail (printf "%s.persistence.size cannot change on an installed release (its volumes were made with %s, asked %s): a StatefulSet's volume claims are fixed. Keep %s here, and grow each PersistentVolumeClaim (data-%s-%s-N) with kubectl where its StorageClass allows expansion (helm/README.md)" (index $set 2) $size (toString (index $set 1)) $size $full (index $set 0)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}


{{/* Telemetry flags of every Tidepool container (logs, traces). */}}
{{- define "tidepool.telemetryArgs" -}}
- --log-format={{ .Values.telemetry.logFormat }}
{{- with .Values.telemetry.otlpEndpoint }}
- --otlp-endpoint={{ . }}
{{- end }}
{{- if ne (toString .Values.telemetry.traceSampling) "" }}
- --trace-sampling={{ .Values.telemetry.traceSampling }}
{{- end }}
{{- end -}}
