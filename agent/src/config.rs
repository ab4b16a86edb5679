//! The agent's one typed configuration (YAML or JSON). Unknown fields, wrong
//! types and impossible values fail at start with the field named: the agent
//! never runs half-configured.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::{
    act::kube::graceful::Removal,
    grace::{Bucket, GraceConfig, PriorityGrace},
};

#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// This node's name (default: $NODE_NAME).
    #[serde(default)]
    pub node_name: Option<String>,
    /// Where the audit log and the graceful-shutdown state file live.
    #[serde(default = "default_audit_dir")]
    pub audit_dir: PathBuf,
    /// The audit log rotates at this size (MiB)...
    #[serde(default = "default_audit_max_file_mib", rename = "auditMaxFileMiB")]
    pub audit_max_file_mib: u64,
    /// ...and keeps this many files (the current one included).
    #[serde(default = "default_audit_files")]
    pub audit_files: u32,
    /// How pods are removed: `delete` (default), `evict` (honours PDBs), or
    /// `none` (announce only: mark and audit, remove no pod).
    #[serde(default)]
    pub pod_removal: Removal,
    /// Leave pods a DaemonSet owns where they are (it would recreate them).
    #[serde(default)]
    pub ignore_daemon_sets: bool,
    /// Leave pods in these namespaces where they are.
    #[serde(default)]
    pub exclude_namespaces: Vec<String>,
    /// Leave pods that carry all of these labels where they are.
    #[serde(default)]
    pub exclude_pod_labels: std::collections::BTreeMap<String, String>,
    // The kubelet's own field names.
    #[serde(default)]
    pub shutdown_grace_period: Option<String>,
    #[serde(default)]
    pub shutdown_grace_period_critical_pods: Option<String>,
    #[serde(default)]
    pub shutdown_grace_period_by_pod_priority: Option<Vec<PriorityGrace>>,
    /// The node's KubeletConfiguration (e.g. /var/lib/kubelet/config.yaml),
    /// read only to check that the kubelet's own graceful node shutdown is
    /// off: two drains racing for the same pods, each with its logind delay
    /// lock, is what lastgasp replaces. The agent logs an error at start, and
    /// `lastgasp check` fails, while it is on.
    #[serde(default)]
    pub kubelet_config_path: Option<PathBuf>,
    /// When a claim counts, and when an episode is given up.
    #[serde(default)]
    pub trust: Trust,
    /// How the agent reaches the API server. Default: the in-cluster
    /// configuration (in a pod: the `kubernetes` Service's VIP, which needs
    /// kube-proxy or the CNI) or $KUBECONFIG.
    #[serde(default)]
    pub api_server: ApiServer,
}

/// The API server's address, when it must not go through the Service VIP:
/// the last gasp leaves a dying node, whose kube-proxy and CNI may already
/// be gone. The credentials stay the agent's own (its ServiceAccount).
#[derive(Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiServer {
    /// The API server's URL, e.g. `https://10.0.0.10:6443` (its serving
    /// certificate must name that address).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Take the URL from this kubeconfig's current context (e.g. the
    /// kubelet's, `/etc/kubernetes/kubelet.conf`): only its `server`, never
    /// its credentials.
    #[serde(default)]
    pub server_from_kubeconfig: Option<PathBuf>,
}

impl ApiServer {
    /// The URL to use instead of the inferred one, if any.
    pub fn url(&self) -> Result<Option<String>> {
        let url = match (&self.endpoint, &self.server_from_kubeconfig) {
            (Some(_), Some(_)) => {
                bail!("apiServer: set endpoint or serverFromKubeconfig, not both")
            }
            (Some(e), None) => e.clone(),
            (None, Some(path)) => {
                let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                    anyhow::anyhow!("apiServer.serverFromKubeconfig: {}: {e}", path.display())
                })?;
                let cluster = kc
                    .current_context
                    .as_ref()
                    .and_then(|cur| kc.contexts.iter().find(|c| &c.name == cur))
                    .and_then(|c| c.context.as_ref())
                    .map(|c| c.cluster.clone());
                let named = kc
                    .clusters
                    .iter()
                    .find(|c| cluster.as_ref().is_none_or(|n| &c.name == n));
                named
                    .and_then(|c| c.cluster.as_ref())
                    .and_then(|c| c.server.clone())
                    .with_context(|| {
                        format!(
                            "apiServer.serverFromKubeconfig: {} names no server for its current context",
                            path.display()
                        )
                    })?
            }
            (None, None) => return Ok(None),
        };
        let parsed: http::Uri = url
            .parse()
            .map_err(|e| anyhow::anyhow!("apiServer: {url:?} is not a URL: {e}"))?;
        let Some(host) = parsed.host() else {
            bail!("apiServer: {url:?} is not an https URL with a host");
        };
        let loopback = host == "localhost"
            || host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        match parsed.scheme_str() {
            Some("https") => {}
            // The agent's credentials would cross the network in clear.
            Some("http") if loopback => {}
            Some("http") => bail!(
                "apiServer: {url:?}: plain http would send the agent's token in clear: https is required (http only on loopback)"
            ),
            _ => bail!("apiServer: {url:?} is not an https URL with a host"),
        }
        Ok(Some(url))
    }
}

/// The decision core's timings (`decide::DecisionPolicy`).
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Trust {
    /// How long a request (`systemctl poweroff` by anyone) waits for logind,
    /// systemd, PID 1 or a reboot(2) to confirm it before it expires,
    /// audit-only. Default 60s.
    #[serde(with = "humantime_serde")]
    pub pending_expiry: Duration,
    /// How long an immediate shutdown may take before the agent, still
    /// alive, asks the host whether one is under way. Default 30s.
    #[serde(with = "humantime_serde")]
    pub immediate_within: Duration,
    /// How far past a graceful deadline (or a scheduled time) the agent asks.
    /// Default 30s.
    #[serde(with = "humantime_serde")]
    pub graceful_margin: Duration,
    /// When the host says a shutdown is under way, ask again after this.
    /// Default 30s.
    #[serde(with = "humantime_serde")]
    pub recheck: Duration,
    /// How long a direct tool's exec (`poweroff -f`) stands as a proof of
    /// death without the tool's reboot(2) reaching the kernel; past it the
    /// proof is withdrawn. Default 5s; keep the controller's
    /// `--direct-tool-quiet` above it by the time a record's close takes to
    /// land.
    #[serde(with = "humantime_serde")]
    pub direct_tool_within: Duration,
}

impl Default for Trust {
    fn default() -> Self {
        let p = crate::decide::DecisionPolicy::default();
        Trust {
            pending_expiry: p.pending_expiry,
            immediate_within: p.immediate_end,
            graceful_margin: p.graceful_margin,
            recheck: p.recheck,
            direct_tool_within: p.direct_tool_within,
        }
    }
}

impl Trust {
    /// The decider's policy; `graceful_length` is the buckets' total time.
    /// Bus signals from peers that do not own the name stay untrusted.
    pub fn policy(&self, graceful_length: Duration) -> crate::decide::DecisionPolicy {
        crate::decide::DecisionPolicy {
            pending_expiry: self.pending_expiry,
            immediate_end: self.immediate_within,
            graceful_margin: self.graceful_margin,
            graceful_length,
            recheck: self.recheck,
            direct_tool_within: self.direct_tool_within,
            trust_unowned_bus_signals: false,
        }
    }

    fn check(&self) -> Result<()> {
        for (name, d, max) in [
            ("trust.pendingExpiry", self.pending_expiry, 3600),
            ("trust.immediateWithin", self.immediate_within, 3600),
            ("trust.gracefulMargin", self.graceful_margin, 3600),
            ("trust.recheck", self.recheck, 3600),
            ("trust.directToolWithin", self.direct_tool_within, 60),
        ] {
            if d.is_zero() || d > Duration::from_secs(max) {
                bail!(
                    "{name}: {} is out of range (more than 0, at most {max}s)",
                    humantime::format_duration(d)
                );
            }
        }
        Ok(())
    }
}

fn default_audit_dir() -> PathBuf {
    PathBuf::from("/var/lib/lastgasp")
}

fn default_audit_max_file_mib() -> u64 {
    crate::act::audit::Limits::default().max_file_bytes >> 20
}

fn default_audit_files() -> u32 {
    crate::act::audit::Limits::default().files
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_name: None,
            audit_dir: default_audit_dir(),
            audit_max_file_mib: default_audit_max_file_mib(),
            audit_files: default_audit_files(),
            pod_removal: Removal::Delete,
            ignore_daemon_sets: false,
            exclude_namespaces: Vec::new(),
            exclude_pod_labels: Default::default(),
            shutdown_grace_period: None,
            shutdown_grace_period_critical_pods: None,
            shutdown_grace_period_by_pod_priority: None,
            kubelet_config_path: None,
            trust: Trust::default(),
            api_server: ApiServer::default(),
        }
    }
}

/// The grace fields of a KubeletConfiguration; everything else in it is
/// the kubelet's business.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KubeletGrace {
    #[serde(default)]
    shutdown_grace_period: Option<String>,
    #[serde(default)]
    shutdown_grace_period_critical_pods: Option<String>,
    #[serde(default)]
    shutdown_grace_period_by_pod_priority: Option<Vec<PriorityGrace>>,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Config> {
        let cfg: Config = serde_norway::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        cfg.grace()?;
        cfg.trust.check()?;
        cfg.audit_limits()?;
        cfg.api_server.url()?;
        Ok(cfg)
    }

    /// The grace configuration.
    pub fn grace(&self) -> Result<GraceConfig> {
        let own = GraceConfig {
            shutdown_grace_period: self.shutdown_grace_period.clone(),
            shutdown_grace_period_critical_pods: self.shutdown_grace_period_critical_pods.clone(),
            shutdown_grace_period_by_pod_priority: self
                .shutdown_grace_period_by_pod_priority
                .clone(),
        };
        own.buckets()?;
        Ok(own)
    }

    /// Whether the kubelet's own graceful node shutdown is on, per
    /// `kubeletConfigPath`: `Some(what is set)` when it is, `None` when it is
    /// off or no path is given. An unreadable file is an error.
    pub fn kubelet_graceful_shutdown(&self) -> Result<Option<String>> {
        let Some(path) = &self.kubelet_config_path else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("kubeletConfigPath: reading {}", path.display()))?;
        let k: KubeletGrace = serde_norway::from_str(&text)
            .map_err(|e| anyhow::anyhow!("kubeletConfigPath: {}: {e}", path.display()))?;
        let nonzero = |v: &Option<String>| {
            v.as_deref().is_some_and(|d| {
                crate::grace::parse_duration("shutdownGracePeriod", d)
                    .map_or(true, |d| !d.is_zero())
            })
        };
        let mut on = Vec::new();
        if nonzero(&k.shutdown_grace_period) {
            on.push(format!(
                "shutdownGracePeriod: {}",
                k.shutdown_grace_period.unwrap_or_default()
            ));
        }
        if nonzero(&k.shutdown_grace_period_critical_pods) {
            on.push(format!(
                "shutdownGracePeriodCriticalPods: {}",
                k.shutdown_grace_period_critical_pods.unwrap_or_default()
            ));
        }
        if k.shutdown_grace_period_by_pod_priority
            .is_some_and(|l| l.iter().any(|p| p.shutdown_grace_period_seconds > 0))
        {
            on.push("shutdownGracePeriodByPodPriority".into());
        }
        Ok((!on.is_empty()).then(|| {
            format!(
                "{} sets {}: the kubelet's graceful node shutdown is on; set them to 0 (or remove them) and restart the kubelet",
                path.display(),
                on.join(", ")
            )
        }))
    }

    /// Pods the drain leaves where they are.
    pub fn keep(&self) -> crate::act::kube::graceful::Keep {
        crate::act::kube::graceful::Keep {
            daemonsets: self.ignore_daemon_sets,
            namespaces: self.exclude_namespaces.clone(),
            labels: self.exclude_pod_labels.clone(),
        }
    }

    /// The audit log's rotation: 1..=1024 MiB a file, 1..=100 files.
    pub fn audit_limits(&self) -> Result<crate::act::audit::Limits> {
        if !(1..=1024).contains(&self.audit_max_file_mib) {
            bail!(
                "auditMaxFileMiB: {} is out of range (1 to 1024)",
                self.audit_max_file_mib
            );
        }
        if !(1..=100).contains(&self.audit_files) {
            bail!(
                "auditFiles: {} is out of range (1 to 100)",
                self.audit_files
            );
        }
        Ok(crate::act::audit::Limits {
            max_file_bytes: self.audit_max_file_mib << 20,
            files: self.audit_files,
        })
    }

    pub fn buckets(&self) -> Result<Vec<Bucket>> {
        Ok(self.grace()?.buckets()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_config() {
        let c = Config::parse(
            "nodeName: n1\nauditDir: /tmp/x\npodRemoval: evict\nshutdownGracePeriod: 30s\nshutdownGracePeriodCriticalPods: 10s\n",
        )
        .unwrap();
        assert_eq!(c.pod_removal, Removal::Evict);
        let c = Config::parse("shutdownGracePeriod: 30s\npodRemoval: none\nignoreDaemonSets: true\nexcludeNamespaces: [kube-system]\nexcludePodLabels: {keep: \"yes\"}\n").unwrap();
        assert_eq!(c.pod_removal, Removal::None);
        let k = c.keep();
        assert!(k.daemonsets && k.namespaces == ["kube-system"] && k.labels["keep"] == "yes");
        assert_eq!(
            c.trust.pending_expiry,
            Duration::from_secs(60),
            "the default"
        );
        let c =
            Config::parse("shutdownGracePeriod: 30s\ntrust: {pendingExpiry: 2m, recheck: 10s}\n")
                .unwrap();
        assert_eq!(
            (
                c.trust.pending_expiry,
                c.trust.recheck,
                c.trust.immediate_within
            ),
            (
                Duration::from_secs(120),
                Duration::from_secs(10),
                Duration::from_secs(30)
            )
        );
        assert_eq!(c.buckets().unwrap().len(), 2);
    }

    #[test]
    fn bad_input_names_the_field() {
        for (text, field) in [
            ("shutdownGracePeriod: 30s\nfrobnicate: 1\n", "frobnicate"),
            ("shutdownGracePeriod: 30s\npodRemoval: shred\n", "shred"),
            ("shutdownGracePeriod: [1]\n", "shutdownGracePeriod"),
            ("shutdownGracePeriod: 0s\n", "shutdownGracePeriod"),
            ("shutdownGracePeriodByPodPriority: [{priority: x, shutdownGracePeriodSeconds: 1}]\n", "priority"),
            ("{}", "shutdownGracePeriod"),
            ("shutdownGracePeriod: 30s\ntrust: {pendingExpiry: 0s}\n", "trust.pendingExpiry"),
            ("shutdownGracePeriod: 30s\ntrust: {pendingExpiry: soon}\n", "pendingExpiry"),
            ("shutdownGracePeriod: 30s\ntrust: {later: 1s}\n", "later"),
            ("shutdownGracePeriod: 30s\nauditMaxFileMiB: 0\n", "auditMaxFileMiB"),
            ("shutdownGracePeriod: 30s\nauditFiles: 100000\n", "auditFiles"),
            ("shutdownGracePeriod: 30s\napiServer: {endpoint: \"not a url\"}\n", "apiServer"),
            ("shutdownGracePeriod: 30s\napiServer: {endpoint: \"ftp://x\"}\n", "apiServer"),
            ("shutdownGracePeriod: 30s\napiServer: {endpoint: \"https://a:6443\", serverFromKubeconfig: /x}\n", "not both"),
            ("shutdownGracePeriod: 30s\napiServer: {serverFromKubeconfig: /nonexistent/kubeconfig}\n", "/nonexistent/kubeconfig"),
        ] {
            let e = format!("{:#}", Config::parse(text).unwrap_err());
            assert!(e.contains(field), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_api_server_from_the_kubelets_kubeconfig_is_its_server_only() {
        let dir = std::env::temp_dir().join(format!("lastgasp-kc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = dir.join("kubelet.conf");
        std::fs::write(
            &k,
            "apiVersion: v1\nkind: Config\nclusters:\n- {name: other, cluster: {server: \"https://wrong:1\"}}\n- {name: k, cluster: {server: \"https://10.0.0.10:6443\"}}\n\
             users: [{name: node, user: {client-certificate: /x, client-key: /y}}]\n\
             contexts: [{name: c, context: {cluster: k, user: node}}]\ncurrent-context: c\n",
        )
        .unwrap();
        let c = Config::parse(&format!(
            "shutdownGracePeriod: 30s\napiServer: {{serverFromKubeconfig: {}}}\n",
            k.display()
        ))
        .unwrap();
        assert_eq!(
            c.api_server.url().unwrap().as_deref(),
            Some("https://10.0.0.10:6443")
        );
        assert_eq!(Config::default().api_server.url().unwrap(), None);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The agent's token never crosses the network in clear.
    #[test]
    fn a_plain_http_api_server_is_refused_off_loopback() {
        let url = |e: &str| {
            Config::parse(&format!(
                "shutdownGracePeriod: 30s\napiServer: {{endpoint: \"{e}\"}}\n"
            ))
            .and_then(|c| c.api_server.url())
            .map_err(|e| format!("{e:#}"))
        };
        assert!(url("http://10.0.0.10:6443").unwrap_err().contains("https"));
        assert!(url("http://api.example:6443")
            .unwrap_err()
            .contains("in clear"));
        assert!(url("ftp://10.0.0.10").is_err());
        for ok in [
            "https://10.0.0.10:6443",
            "http://127.0.0.1:8080",
            "http://[::1]:8080",
            "http://localhost:1",
        ] {
            assert_eq!(url(ok).unwrap().as_deref(), Some(ok));
        }
    }

    #[test]
    fn the_kubelet_config_is_read_only_to_say_whether_its_shutdown_is_on() {
        let dir = std::env::temp_dir().join(format!("lastgasp-kcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = dir.join("config.yaml");
        let cfg = |kubelet: &str| {
            std::fs::write(&k, format!("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nmaxPods: 110\n{kubelet}")).unwrap();
            Config::parse(&format!(
                "shutdownGracePeriod: 30s\nkubeletConfigPath: {}\n",
                k.display()
            ))
            .unwrap()
        };
        let on = cfg("shutdownGracePeriod: 2m\nshutdownGracePeriodCriticalPods: 30s\n")
            .kubelet_graceful_shutdown()
            .unwrap()
            .unwrap();
        assert!(
            on.contains("shutdownGracePeriod: 2m") && on.contains("set them to 0"),
            "{on}"
        );
        assert_eq!(
            cfg("shutdownGracePeriod: 0s\n")
                .kubelet_graceful_shutdown()
                .unwrap(),
            None
        );
        assert_eq!(cfg("").kubelet_graceful_shutdown().unwrap(), None);
        assert!(cfg(
            "shutdownGracePeriodByPodPriority: [{priority: 0, shutdownGracePeriodSeconds: 10}]\n"
        )
        .kubelet_graceful_shutdown()
        .unwrap()
        .is_some());
        // The agent's own grace periods are its own: never read from the kubelet's.
        assert_eq!(
            cfg("shutdownGracePeriod: 2m\n")
                .buckets()
                .unwrap()
                .iter()
                .map(|b| b.seconds)
                .sum::<i64>(),
            30
        );
        std::fs::remove_file(&k).unwrap();
        let missing = Config::parse(&format!(
            "shutdownGracePeriod: 30s\nkubeletConfigPath: {}\n",
            k.display()
        ))
        .unwrap();
        assert!(
            format!("{:#}", missing.kubelet_graceful_shutdown().unwrap_err())
                .contains("kubeletConfigPath")
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
