{{/*
The agent's pod spec: the DaemonSet's (serve: true, `lastgasp run`) and the
`helm test` pod's (serve: false, `lastgasp check`) are one, so the check
runs with exactly the agent's privileges, mounts and settings. Called with
(dict "root" $ "args" (list ...) "serve" bool "pool" ...), the pool one of
"lastgasp.pools" (default: the first).
*/}}
{{- define "lastgasp.agentPodSpec" -}}
{{- $root := .root -}}
{{- $pool := .pool | default (first (include "lastgasp.pools" $root | fromJsonArray)) -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
serviceAccountName: {{ include "lastgasp.name" $root }}-agent
# The node's processes: the actor's /proc/PID (exe, cgroup, parents),
# the initial PID namespace that is "the node" (/proc/1/ns/pid), and
# the node's boot id.
hostPID: true
# The last gasp must reach the API server while the node is going down,
# when the CNI (its daemon, its routes) may already be gone; the host's
# network is the last to go. So the pod IP is the node IP, and the
# metrics/health endpoint (cluster-mode default $POD_IP:9850) binds the
# node's address.
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
priorityClassName: {{ $root.Values.agent.priorityClassName }}
# Linux nodes only: on Windows the kubelet's own graceful shutdown applies.
nodeSelector:
  {{- toYaml $pool.nodeSelector | nindent 2 }}
{{- with $root.Values.agent.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
# Every taint: the agent must run on every node, cordoned, NotReady or
# already shutting down (its own lastgasp.dev/shutting-down taint).
tolerations:
  {{- toYaml $root.Values.agent.tolerations | nindent 2 }}
# The agent must outlive the pods it stops. It reads SIGTERM only
# between signals: a graceful run under way (up to shutdownGracePeriod,
# 30s in the ConfigMap) finishes first. 45 = 30s of graceful path + 15s
# for the audit fsync, the final node patches and exit; a kubelet doing
# its own graceful node shutdown gives the agent (system-node-critical)
# min(its critical bucket, 45s). Raise it with shutdownGracePeriod.
terminationGracePeriodSeconds: {{ $root.Values.agent.terminationGracePeriodSeconds }}
securityContext:
  seccompProfile:
    # The runtime's default profile allows bpf(2) and perf_event_open(2)
    # to a container holding CAP_SYS_ADMIN (older profiles know no
    # other gate; newer ones also accept CAP_BPF/CAP_PERFMON), so no
    # custom or Unconfined profile is needed.
    type: RuntimeDefault
containers:
  - name: agent
    image: {{ include "lastgasp.image" (dict "root" $root "over" $root.Values.agent.image) }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      {{- toYaml .args | nindent 6 }}
    # The settings as environment, not arguments: `kubectl exec ...
    # -- lastgasp check` in this container reads the same ones.
    env:
      - name: LASTGASP_CONFIG
        value: /etc/lastgasp/config.yaml
      {{- if $pool.systemd }}
      # logind's configuration as the host has it (mounted under
      # /host): the drop-in raising InhibitDelayMaxSec goes to
      # /host/etc/systemd/logind.conf.d/99-lastgasp.conf, and the other
      # files decide which setting wins.
      - name: LASTGASP_LOGIND_ROOT
        value: /host
      {{- if $root.Values.agent.shutdownHook }}
      # systemd-shutdown's hook: right before the final reboot(2), with
      # every process stopped, it waits for the agent's last word.
      - name: LASTGASP_SHUTDOWN_HOOK_DIR
        value: /host/usr/lib/systemd/system-shutdown
      {{- if $root.Values.agent.courier }}
      # Where that directory is read-only: a unit systemd runs right
      # before its power-off, after every unit stopped, runs the courier.
      - name: LASTGASP_UNIT_DIR
        value: /host/run/systemd/system
      {{- end }}
      {{- end }}
      {{- if not $root.Values.agent.courier }}
      - name: LASTGASP_NO_COURIER
        value: "true"
      {{- end }}
      {{- else }}
      # No systemd on these nodes: no bus, logind or systemd-shutdown.
      - name: LASTGASP_NO_DBUS
        value: "true"
      {{- end }}
      # Its DaemonSet: deleted (an uninstall), the agent leaves the host
      # clean as it stops.
      - name: LASTGASP_DAEMONSET
        value: {{ include "lastgasp.name" $root }}-agent{{ $pool.suffix }}
      - name: NODE_NAME
        valueFrom:
          fieldRef:
            fieldPath: spec.nodeName
      - name: POD_NAME
        valueFrom:
          fieldRef:
            fieldPath: metadata.name
      - name: POD_NAMESPACE
        valueFrom:
          fieldRef:
            fieldPath: metadata.namespace
      # With hostNetwork this is the node's IP: the metrics and health
      # endpoint listens on $POD_IP:9850 in cluster mode.
      - name: POD_IP
        valueFrom:
          fieldRef:
            fieldPath: status.podIP
      {{- if $root.Values.agent.unreadyUnlessArmed }}
      # A graceful path that cannot arm makes the agent unready (a rollout
      # then stops at that node); else Ready but degraded.
      - name: LASTGASP_UNREADY_UNLESS_ARMED
        value: "true"
      {{- end }}
      {{- with $root.Values.agent.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if .serve }}
    # Not 9808: that is the CSI livenessprobe sidecar's default, often
    # on the host network too.
    ports:
      - name: metrics
        containerPort: 9850
        protocol: TCP
    # 200 once the hooks are armed and the watches warm.
    readinessProbe:
      httpGet:
        path: /readyz
        port: metrics
      periodSeconds: 5
      failureThreshold: 3
    livenessProbe:
      httpGet:
        path: /healthz
        port: metrics
      initialDelaySeconds: 10
      periodSeconds: 10
      failureThreshold: 6
    {{- end }}
    # About 30 MiB resident once armed. No CPU limit: throttling would
    # delay the last gasp; BPF maps are charged to this cgroup.
    resources:
      {{- toYaml $root.Values.agent.resources | nindent 6 }}
    securityContext:
      privileged: false
      # uid 0: logind grants a delay inhibitor lock ("delay" mode) and
      # systemd's KillUnit (logind's reload) to root without polkit, and
      # the drop-in directory /etc/systemd/logind.conf.d and the audit
      # directory are root's.
      runAsUser: 0
      runAsNonRoot: false
      readOnlyRootFilesystem: true
      # allowPrivilegeEscalation is left unset: the API rejects `false`
      # together with CAP_SYS_ADMIN.
      {{- with $root.Values.agent.appArmorProfile }}
      appArmorProfile:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.agent.seLinuxOptions }}
      seLinuxOptions:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      capabilities:
        drop: ["ALL"]
        add:
          # Load the eBPF programs and create their maps (bpf(2)).
          - BPF
          # Attach tracing programs: perf_event_open(2) for the
          # tracepoints, fentry/kprobe on the kernel's power-off paths.
          - PERFMON
          {{- if not (has "SYS_ADMIN" $root.Values.agent.dropCapabilities) }}
          # Where kernel.perf_event_paranoid=3 (Debian, Ubuntu:
          # CONFIG_SECURITY_PERF_EVENTS_RESTRICT), perf_event_open(2) is
          # refused with EACCES without it and no tracepoint arms (the
          # VM harness's `privileges` scenario shows it). On nodes with
          # paranoid <= 2 it can be dropped (agent.dropCapabilities).
          - SYS_ADMIN
          {{- end }}
          {{- if not (has "SYS_PTRACE" $root.Values.agent.dropCapabilities) }}
          # Read other processes' /proc/PID/exe (and /proc/1/ns/pid) for
          # the actor of a shutdown; without it `exe` is left out.
          - SYS_PTRACE
          {{- end }}
    volumeMounts:
      - name: config
        mountPath: /etc/lastgasp
        readOnly: true
      # The fsync'd audit log and graceful_node_shutdown_state; it must
      # survive the pod and the reboot.
      - name: audit
        mountPath: /var/lib/lastgasp
      {{- if $pool.systemd }}
      # logind (delay lock, PrepareForShutdown) and systemd (jobs,
      # KillUnit) on the system bus, /run/dbus/system_bus_socket. The
      # directory, not the socket: a restarted dbus-daemon makes a new
      # socket, which a bind mount of the old one would never see.
      - name: dbus
        mountPath: /run/dbus
      {{- end }}
      # The kernel's BTF: field offsets for the exec hook, fentry.
      - name: btf
        mountPath: /sys/kernel/btf
        readOnly: true
      # tracefs: the tracepoints' ids. The host's own mount, so the
      # agent never mounts one itself.
      - name: tracefs
        mountPath: /sys/kernel/tracing
        readOnly: true
      {{- if $pool.systemd }}
      # logind's configuration, read to find the InhibitDelayMaxSec in
      # force; only logind.conf.d is writable (the agent's drop-in).
      - name: etc-systemd
        mountPath: /host/etc/systemd
        readOnly: true
      - name: logind-conf-d
        mountPath: /host/etc/systemd/logind.conf.d
      - name: run-systemd
        mountPath: /host/run/systemd
        readOnly: true
      # systemd's runtime units (tmpfs): lastgasp's final unit, where /usr
      # is read-only; nothing else there is written.
      - name: run-systemd-system
        mountPath: /host/run/systemd/system
      # systemd-shutdown runs the executables in system-shutdown/ before
      # its reboot(2): the agent installs its hook and courier there, and
      # creates the directory where it is missing. Writable as a whole so
      # that the pod starts where that directory is missing and /usr is
      # read-only (the agent then says the last word is not armed).
      - name: usr-lib-systemd
        mountPath: /host/usr/lib/systemd
      {{- end }}
      # Where the hook and the agent meet: a FIFO and the agent's pid
      # (tmpfs: gone at the next boot).
      - name: run-lastgasp
        mountPath: /run/lastgasp
      {{- if $root.Values.agent.kubeletConfigPath }}
      # The kubelet's configuration, for the grace periods.
      - name: kubelet-config
        mountPath: {{ $root.Values.agent.kubeletConfigPath }}
        readOnly: true
      {{- end }}
      {{- with ((($pool.config).apiServer).serverFromKubeconfig) }}
      # The kubeconfig whose server the agent reaches (never its
      # credentials), at the path the config names.
      - name: server-kubeconfig
        mountPath: {{ . }}
        readOnly: true
      {{- end }}
      {{- with $root.Values.agent.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  - name: config
    configMap:
      name: {{ include "lastgasp.name" $root }}-agent{{ $pool.suffix }}
  - name: audit
    hostPath:
      path: /var/lib/lastgasp
      type: DirectoryOrCreate
  {{- if $pool.systemd }}
  - name: dbus
    hostPath:
      path: /run/dbus
      type: DirectoryOrCreate
  {{- end }}
  - name: btf
    hostPath:
      path: /sys/kernel/btf
      type: Directory
  - name: tracefs
    hostPath:
      path: /sys/kernel/tracing
      type: Directory
  {{- if $pool.systemd }}
  - name: etc-systemd
    hostPath:
      path: /etc/systemd
      type: DirectoryOrCreate
  - name: logind-conf-d
    hostPath:
      path: /etc/systemd/logind.conf.d
      type: DirectoryOrCreate
  - name: run-systemd
    hostPath:
      path: /run/systemd
      type: DirectoryOrCreate
  - name: run-systemd-system
    hostPath:
      path: /run/systemd/system
      type: DirectoryOrCreate
  - name: usr-lib-systemd
    hostPath:
      path: /usr/lib/systemd
      type: DirectoryOrCreate
  {{- end }}
  - name: run-lastgasp
    hostPath:
      path: /run/lastgasp
      type: DirectoryOrCreate
  {{- if $root.Values.agent.kubeletConfigPath }}
  - name: kubelet-config
    hostPath:
      path: {{ $root.Values.agent.kubeletConfigPath }}
      type: File
  {{- end }}
  {{- with ((($pool.config).apiServer).serverFromKubeconfig) }}
  - name: server-kubeconfig
    hostPath:
      path: {{ . }}
      type: File
  {{- end }}
  {{- with $root.Values.agent.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}
