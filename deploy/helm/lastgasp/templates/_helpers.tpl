{{/* A component's image (dict "root" $ "over" .Values.agent.image):
image.*, unless the component names its own tag or digest (an upgrade or
rollback one component at a time); its repository overrides alone. */}}
{{- define "lastgasp.image" -}}
{{- $g := .root.Values.image -}}
{{- $o := .over | default dict -}}
{{- $repo := $o.repository | default $g.repository -}}
{{- $pin := ternary $o $g (or (not (empty $o.tag)) (not (empty $o.digest))) -}}
{{- if $pin.digest -}}
{{ $repo }}@{{ $pin.digest }}
{{- else -}}
{{ $repo }}:{{ $pin.tag | default .root.Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The name every object starts with (nameOverride). */}}
{{- define "lastgasp.name" -}}
{{ default "lastgasp" .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end -}}

{{/* Labels only Helm can know: the release and the chart. */}}
{{- define "lastgasp.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* A Go duration ("1m30s", "500ms") in whole seconds, rounded up. */}}
{{- define "lastgasp.seconds" -}}
{{- $units := dict "ns" 1e-9 "us" 1e-6 "µs" 1e-6 "ms" 1e-3 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- range regexFindAll "[0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h)" (toString .) -1 -}}
{{- $unit := regexFind "(ns|us|µs|ms|s|m|h)$" . -}}
{{- $total = addf $total (mulf (float64 (trimSuffix $unit .)) (get $units $unit)) -}}
{{- end -}}
{{- ceil $total | int -}}
{{- end -}}

{{/* The agent's graceful path at most, in seconds, with a pool's config
(dict "root" $ "config" ...): the kubelet's semantics (the sum of the
priority buckets, or shutdownGracePeriod). */}}
{{- define "lastgasp.gracefulSeconds" -}}
{{- $buckets := .config.shutdownGracePeriodByPodPriority | default list -}}
{{- if $buckets -}}
{{- $sum := 0 -}}
{{- range $buckets }}{{ $sum = add $sum .shutdownGracePeriodSeconds }}{{ end -}}
{{- $sum -}}
{{- else -}}
{{- include "lastgasp.seconds" .root.Values.agent.shutdownGracePeriod -}}
{{- end -}}
{{- end -}}

{{/* The agent pools as JSON: without agent.pools, one (suffix "", on
agent.nodeSelector); else one per pool, its config merged over
agent.config and its extraArgs after agent.extraArgs. */}}
{{- define "lastgasp.pools" -}}
{{- $a := .Values.agent -}}
{{- $out := list -}}
{{- $seen := dict -}}
{{- range $a.pools -}}
{{- $key := toJson .nodeSelector -}}
{{- if hasKey $seen .name -}}
{{- fail (printf "agent.pools: the name %s is taken twice" .name) -}}
{{- end -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "agent.pools: %s selects the nodes %s does (%s): two agents on a node would race each other" .name (get $seen $key) $key) -}}
{{- end -}}
{{- $_ := set $seen .name true -}}
{{- $_ := set $seen $key .name -}}
{{- $cfg := mergeOverwrite (deepCopy ($a.config | default dict)) (deepCopy (.config | default dict)) -}}
{{- $sd := $a.systemd -}}
{{- if hasKey . "systemd" }}{{ $sd = .systemd }}{{ end -}}
{{- $out = append $out (dict "name" .name "suffix" (printf "-%s" .name) "nodeSelector" .nodeSelector "config" $cfg "args" (concat $a.extraArgs (.extraArgs | default list)) "systemd" $sd) -}}
{{- end -}}
{{- if not $a.pools -}}
{{- $out = list (dict "name" "" "suffix" "" "nodeSelector" $a.nodeSelector "config" ($a.config | default dict) "args" $a.extraArgs "systemd" $a.systemd) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
