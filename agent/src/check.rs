//! `lastgasp check`: the node preflight. Prints one table (kernel, hooks,
//! BTF, privileges, D-Bus and logind, API permissions) and exits 1 when
//! something required is missing; warnings say what works with less.
//!
//! It changes nothing that lasts: the eBPF programs are loaded with the real
//! loader and dropped again (which detaches them), the logind delay lock is
//! closed at once, the SelfSubjectAccessReviews are not stored by the API
//! server. Only tracefs is mounted if it was not, as `lastgasp run` would.
use crate::{
    act::kube::{self, graceful::Removal},
    detect::{
        ebpf,
        launch::{self, DbusArgs},
    },
    node,
    preflight::{Report, Status},
};

pub use crate::act::kube::preflight::{fence, PERMISSIONS};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Section {
    Kernel,
    Hooks,
    Privileges,
    Dbus,
    Cluster,
    /// What the agent writes on the host for its last word.
    Host,
    /// The per-node admission fence, asked to refuse two dry-run patches.
    Fence,
}

impl Section {
    fn name(self) -> &'static str {
        match self {
            Section::Kernel => "kernel",
            Section::Hooks => "hooks",
            Section::Privileges => "privileges",
            Section::Dbus => "dbus",
            Section::Cluster => "cluster",
            Section::Host => "host",
            Section::Fence => "fence",
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct CheckArgs {
    /// The node runs the agent standalone: skip the cluster permissions.
    #[arg(long, env = "LASTGASP_STANDALONE")]
    pub standalone: bool,
    /// Only these sections (comma-separated): kernel, hooks, privileges,
    /// dbus, host, cluster, fence.
    #[arg(long, value_enum, value_delimiter = ',', env = "LASTGASP_ONLY")]
    pub only: Vec<Section>,
    /// Do not load the eBPF programs: predict the hooks from tracefs, the
    /// kprobe PMU and BTF only.
    #[arg(long, env = "LASTGASP_NO_LOAD")]
    pub no_load: bool,
    /// The agent's configuration: the logind delay its grace periods need
    /// (unless --inhibit-delay is given).
    #[arg(long, env = "LASTGASP_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// systemd-shutdown's directory, as `run` is given it.
    #[arg(long, value_name = "DIR", env = "LASTGASP_SHUTDOWN_HOOK_DIR")]
    pub shutdown_hook_dir: Option<std::path::PathBuf>,
    /// `run` leaves no courier.
    #[arg(long, env = "LASTGASP_NO_COURIER")]
    pub no_courier: bool,
    /// systemd's runtime unit directory, as `run` is given it.
    #[arg(long, value_name = "DIR", env = "LASTGASP_UNIT_DIR")]
    pub unit_dir: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub dbus: DbusArgs,
}

/// Prints the report; the exit code is 1 when something required is missing.
pub async fn main(args: &CheckArgs) -> i32 {
    let report = check_node(args).await;
    print!("{report}");
    i32::from(report.failures() > 0)
}

pub async fn check_node(args: &CheckArgs) -> Report {
    let mut r = Report::default();
    let want = |s: Section| args.only.is_empty() || args.only.contains(&s);
    let caps = node::effective_caps().ok();
    let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    let config = config_section(&mut r, args);
    if want(Section::Kernel) {
        r.section(Section::Kernel.name());
        ebpf::preflight::kernel(&mut r);
    }
    if want(Section::Privileges) {
        r.section(Section::Privileges.name());
        ebpf::preflight::privileges(&mut r, caps, paranoid);
    }
    if want(Section::Hooks) {
        r.section(Section::Hooks.name());
        ebpf::preflight::hooks(&mut r, args.no_load, caps);
    }
    if want(Section::Dbus) {
        r.section(Section::Dbus.name());
        dbus_section(&mut r, args, config.as_ref()).await;
    }
    if want(Section::Host) {
        r.section(Section::Host.name());
        host_section(&mut r, args);
    }
    let node = config
        .as_ref()
        .and_then(|c| c.node_name.clone())
        .or_else(|| std::env::var("NODE_NAME").ok());
    let cluster = want(Section::Cluster) || want(Section::Fence);
    let client = match cluster && !args.standalone {
        true => Some(cluster_client().await),
        false => None,
    };
    if want(Section::Cluster) {
        r.section(Section::Cluster.name());
        cluster_section(
            &mut r,
            args,
            config.as_ref(),
            client.as_ref(),
            node.as_deref(),
        )
        .await;
    }
    if want(Section::Fence) {
        r.section(Section::Fence.name());
        match (&client, &node) {
            (None, _) => r.push(Status::Info, "fence", "--standalone: skipped"),
            (Some(Err(_)), _) => r.push(
                Status::Fail,
                "fence",
                "no client for the API server (see cluster)",
            ),
            (_, None) => r.push(
                Status::Fail,
                "fence",
                "no node name (nodeName in the config, or $NODE_NAME)",
            ),
            (Some(Ok((client, _))), Some(node)) => fence(&mut r, client, node).await,
        }
    }
    r
}

/// Whether the last word's files can be (or are) on the host: the hook
/// (or, where its directory is read-only, the final unit), the courier, or
/// the operator's opt-out. Writes nothing.
fn host_section(r: &mut Report, args: &CheckArgs) {
    let Some(dir) = &args.shutdown_hook_dir else {
        return r.push(Status::Warn, "shutdown hook", "none (no --shutdown-hook-dir; chart agent.shutdownHook=false): a shutdown through systemd is fenced only if the agent outlives the units' stop, never under the systemd cgroup driver");
    };
    let hook = dir.join(crate::hostio::HOOK_NAME);
    let hook_writable = match writable(dir) {
        Ok(target) => {
            let state = if hook.exists() {
                "installed"
            } else {
                "not installed yet"
            };
            r.push(
                Status::Ok,
                "shutdown hook",
                format!("{} writable ({state})", target.display()),
            );
            true
        }
        Err((target, e)) => {
            let (status, then) = match (&args.unit_dir, args.no_courier) {
                (Some(_), false) => (Status::Ok, "lastgasp's final unit runs the courier instead"),
                _ => (Status::Warn, "a shutdown through systemd is not fenced under the systemd cgroup driver (docs/compatibility.md)"),
            };
            r.push(
                status,
                "shutdown hook",
                format!(
                    "{} not writable ({e}; a read-only /usr?): {then}",
                    target.display()
                ),
            );
            false
        }
    };
    if args.no_courier {
        return r.push(Status::Warn, "courier", "off (--no-courier; chart agent.courier=false): a shutdown that stops the agent before the hook is not fenced");
    }
    if hook_writable {
        let installed = dir.join(crate::hostio::COURIER).exists();
        return r.push(
            Status::Ok,
            "courier",
            format!(
                "beside the hook ({})",
                if installed {
                    "installed"
                } else {
                    "not installed yet"
                }
            ),
        );
    }
    let Some(units) = &args.unit_dir else {
        return r.push(Status::Warn, "final unit", "none (no --unit-dir): with the hook's directory read-only, the courier has nothing to run it");
    };
    let unit = units.join(crate::act::final_unit::TEMPLATE);
    match writable(units) {
        Ok(_) => r.push(Status::Ok, "final unit", format!("{} ({}); its courier in the run directory, or the audit directory where /run is noexec", unit.display(), if unit.exists() { "installed" } else { "not installed yet" })),
        Err((target, e)) => r.push(Status::Warn, "final unit", format!("{} not writable ({e}): a shutdown through systemd is not fenced under the systemd cgroup driver", target.display())),
    }
}

/// `dir`, or where it is missing its parent (the agent creates it), when
/// writable.
fn writable(dir: &std::path::Path) -> Result<&std::path::Path, (&std::path::Path, nix::Error)> {
    let target = if dir.is_dir() {
        dir
    } else {
        dir.parent().unwrap_or(dir)
    };
    nix::unistd::access(target, nix::unistd::AccessFlags::W_OK)
        .map(|()| target)
        .map_err(|e| (target, e))
}

/// The config file, when given: whether it loads, and whether the
/// kubelet's own graceful node shutdown is off beside it.
fn config_section(r: &mut Report, args: &CheckArgs) -> Option<crate::config::Config> {
    let config = match crate::config::Config::load(args.config.as_ref()?) {
        Ok(c) => c,
        Err(e) => {
            r.section("config");
            r.push(Status::Fail, "file", format!("{e:#}"));
            return None;
        }
    };
    r.section("config");
    match config.kubelet_graceful_shutdown() {
        Ok(Some(on)) => r.push(Status::Fail, "kubelet", on),
        Ok(None) if config.kubelet_config_path.is_some() => r.push(
            Status::Ok,
            "kubelet",
            "the kubelet's graceful node shutdown is off",
        ),
        Ok(None) => {}
        Err(e) => r.push(Status::Fail, "kubelet", format!("{e:#}")),
    }
    Some(config)
}

/// The system bus, logind and its delay (the config's buckets ask for one
/// unless --inhibit-delay does).
async fn dbus_section(r: &mut Report, args: &CheckArgs, config: Option<&crate::config::Config>) {
    if args.dbus.no_dbus {
        r.push(Status::Info, "system bus", "--no-dbus: skipped");
        return;
    }
    let mut dbus = args.dbus.clone();
    if dbus.inhibit_delay.is_none() {
        if let Some(c) = config {
            match c.buckets() {
                Ok(b) => dbus.inhibit_delay = Some(crate::grace::requested_delay(&b)),
                Err(e) => r.push(Status::Fail, "config", format!("{e:#}")),
            }
        }
    }
    launch::preflight(r, &dbus).await;
}

/// The agent's permissions on the API server, and what cluster mode needs
/// to start.
async fn cluster_section(
    r: &mut Report,
    args: &CheckArgs,
    config: Option<&crate::config::Config>,
    client: Option<&Result<(::kube::Client, String), String>>,
    node: Option<&str>,
) {
    match client {
        None => r.push(Status::Info, "permissions", "--standalone: skipped"),
        Some(Err(e)) => r.push(Status::Fail, "cluster", e.clone()),
        Some(Ok((client, url))) => {
            let evict = config.is_some_and(|c| c.pod_removal == Removal::Evict);
            kube::preflight::preflight(r, client, url, evict).await;
        }
    }
    if !args.standalone && args.config.is_none() {
        r.push(
            Status::Fail,
            "config",
            "cluster mode cannot start: it needs --config (the grace periods, at least)",
        );
    }
    if !args.standalone && node.is_none() {
        r.push(
            Status::Fail,
            "node name",
            "cluster mode cannot start: no node name (nodeName in the config, or $NODE_NAME)",
        );
    }
}

/// A client as `lastgasp run` builds it (no retries: a check answers once),
/// and the API server's URL; or why there is none.
async fn cluster_client() -> Result<(::kube::Client, String), String> {
    let mut c = ::kube::Config::infer().await.map_err(|e| {
        format!(
            "cluster mode cannot start: no Kubernetes configuration (not in a pod, no $KUBECONFIG or \
             ~/.kube/config): {e}; run with --standalone for a node without a cluster"
        )
    })?;
    c.default_retry = false;
    let url = c.cluster_url.to_string();
    let client = ::kube::Client::try_from(c).map_err(|e| format!("a client for {url}: {e}"))?;
    Ok((client, url))
}

/// The graceful-shutdown part alone (D-Bus and logind), as before.
pub async fn check(args: &DbusArgs) -> Report {
    let mut r = Report::default();
    r.section(Section::Dbus.name());
    launch::preflight(&mut r, args).await;
    r
}
