//! `lastgasp run`: starts the detectors, the endpoint and the cluster
//! clients, then turns the agent's one loop.
use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use super::{turn, Agent, Inputs};
use crate::act::Cluster;
use crate::{
    act::{
        audit::AuditLog,
        kube::{graceful::GracefulOptions, NodeClient},
        last_gasp::LastGasp,
        metrics::Metrics,
    },
    apiserver::{self, Use},
    config::Config,
    detect::{
        ebpf::EbpfDetector,
        hooks::HookState,
        host::HostProbe,
        launch::{self, DbusArgs},
        shutdown_hook,
    },
    health::Health,
    http::{self, Listen},
    node::{self, NodePidNs},
};
use anyhow::{Context, Result};

#[derive(clap::Args)]
pub struct RunArgs {
    /// Run without a cluster: print each signal as a JSON line and audit it.
    #[arg(long, env = "LASTGASP_STANDALONE")]
    pub standalone: bool,
    /// The agent's configuration file (YAML); required in cluster mode.
    #[arg(long, env = "LASTGASP_CONFIG")]
    pub config: Option<PathBuf>,
    /// The PID namespace that is "the node", as an ns/pid file
    /// (default: the initial namespace). Tests point it at a child namespace.
    #[arg(long, env = "LASTGASP_NODE_PID_NS")]
    pub node_pid_ns: Option<PathBuf>,
    /// Overrides the config's auditDir (default /var/lib/lastgasp).
    #[arg(long, env = "LASTGASP_AUDIT_DIR")]
    pub audit_dir: Option<PathBuf>,
    /// Serve /metrics, /readyz and /healthz on ADDR:PORT, or `off` (default:
    /// 127.0.0.1:9850 standalone, $POD_IP:9850 in cluster mode). A given
    /// address that cannot be bound stops the start; the standalone default
    /// only logs a warning.
    #[arg(long, value_name = "ADDR:PORT", env = "LASTGASP_METRICS_LISTEN")]
    pub metrics_listen: Option<Listen>,
    /// Start as `@lastgasp` (argv[0] beginning with `@`) when running as
    /// root, so that systemd-shutdown's final kill spares the agent: it then
    /// lives until the kernel's own power-off and sends its last word (the
    /// proof the controller fences on). `false`: killed with everything else.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "LASTGASP_OUTLIVE_FINAL_KILL")]
    pub outlive_final_kill: bool,
    /// Install a hook into systemd-shutdown's directory (the node's
    /// `/usr/lib/systemd/system-shutdown`, as mounted here): right before the
    /// final reboot(2), with every process stopped and the file systems
    /// unmounted, it waits for the agent's last word. Default: none.
    #[arg(long, value_name = "DIR", env = "LASTGASP_SHUTDOWN_HOOK_DIR")]
    pub shutdown_hook_dir: Option<PathBuf>,
    /// No courier (a copy of the agent's binary beside the hook, and a kit
    /// with its token in the run directory while a shutdown is under way):
    /// for operators who would rather lose the fence of a shutdown that
    /// stops the agent before the hook than have those on the host.
    #[arg(long, env = "LASTGASP_NO_COURIER")]
    pub no_courier: bool,
    /// systemd's runtime unit directory (the node's `/run/systemd/system`,
    /// as mounted here): where the hook's directory is read-only, the
    /// courier runs from a unit systemd starts right before its final
    /// service (`act::final_unit`), after every unit stopped. Default: none.
    #[arg(long, value_name = "DIR", env = "LASTGASP_UNIT_DIR")]
    pub unit_dir: Option<PathBuf>,
    /// Where the hook and the agent meet (a FIFO, the agent's pid): the same
    /// path on the node and here.
    #[arg(long, default_value = "/run/lastgasp", env = "LASTGASP_RUN_DIR")]
    pub run_dir: PathBuf,
    /// A lost bus part (logind, its delay lock, systemd: the graceful path)
    /// makes /readyz 503. Default: Ready but degraded (`ok, degraded: ...`,
    /// `lastgasp_graceful_path_armed` 0, the Node's `LastgaspDegraded`
    /// condition and an Event), so that rollouts go on.
    #[arg(long, env = "LASTGASP_UNREADY_UNLESS_ARMED")]
    pub unready_unless_armed: bool,
    #[command(flatten)]
    pub dbus: DbusArgs,
}

/// systemd-shutdown's final SIGTERM/SIGKILL sweep spares root processes
/// whose argv[0] begins with `@` (systemd's "root storage daemons"): the
/// process execs itself once more under that name, before any thread or
/// file is opened. Returns only when there is nothing to do (not root,
/// already `@`, or turned off); on an exec failure, says why and goes on
/// under its own name.
pub fn outlive_final_kill(args: &RunArgs) {
    use std::os::unix::process::CommandExt;
    let mut argv = std::env::args_os();
    let Some(arg0) = argv.next() else { return };
    if !args.outlive_final_kill
        || arg0.as_encoded_bytes().starts_with(b"@")
        || !nix::unistd::geteuid().is_root()
    {
        return;
    }
    let name = std::path::Path::new(&arg0)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "lastgasp".into());
    // By its path, so that comm stays the binary's name (not "exe").
    let exe = std::env::current_exe()
        .ok()
        .filter(|p| p.exists())
        .unwrap_or_else(|| "/proc/self/exe".into());
    let err = std::process::Command::new(exe)
        .arg0(format!("@{name}"))
        .args(argv)
        .exec();
    eprintln!("lastgasp: could not exec itself as @{name} ({err}): systemd-shutdown's final kill will end it with the rest");
}

/// `lastgasp run`: arms everything, then turns the loop until SIGTERM (a
/// graceful run under way is finished first).
pub async fn run(mut args: RunArgs, json_logs: bool) -> Result<()> {
    let started = Instant::now();
    let cfg = load_config(&args)?;
    let metrics = Metrics::default();
    let health = Health::new("arming the hooks");
    health.unready_when_degraded(args.unready_unless_armed);
    let _endpoint = start_endpoint(&args, &metrics, &health).await?;
    let audit_dir = args
        .audit_dir
        .clone()
        .unwrap_or_else(|| cfg.audit_dir.clone());
    let node = match &args.node_pid_ns {
        Some(p) => NodePidNs::from_path(p)?,
        None => NodePidNs::initial()?,
    };
    let boot_id = node::boot_id()?;
    metrics.set_boot(&boot_id);
    let audit = AuditLog::open_with(&audit_dir, &boot_id, cfg.audit_limits()?)?;
    let det = arm(&node, &metrics, json_logs)?;
    let armed_ms = started.elapsed().as_secs_f64() * 1e3;
    // Target "lastgasp": "lastgasp: armed" is what readiness probes and the VM runner wait for.
    tracing::info!(target: "lastgasp", armed_ms = format!("{armed_ms:.1}"), audit = %audit.path().display(), boot_id, "armed");

    // Standalone needs no grace periods: a graceful episode is then given
    // the default length before the host is asked.
    let buckets = match cfg.buckets() {
        Ok(b) => b,
        Err(_) if args.standalone && args.config.is_none() => Vec::new(),
        Err(e) => return Err(e),
    };
    let graceful_length = graceful_length(&buckets);
    // Local first: detection, the audit and the delay lock never wait for
    // the API server; the cluster half joins the loop when it answers.
    let (cluster_tx, joined) = tokio::sync::watch::channel::<Option<Arc<Cluster>>>(None);
    if !args.standalone {
        // logind must give the graceful path the buckets' whole time.
        args.dbus
            .inhibit_delay
            .get_or_insert(crate::grace::requested_delay(&buckets));
        start_cluster_half(&cfg, &audit_dir, buckets, &health, cluster_tx).await?;
    }
    // logind and systemd over D-Bus, and systemd-shutdown's hook, feed the same loop.
    let (dbus_tx, dbus_rx) = tokio::sync::mpsc::channel(64);
    let (hook, courier) = start_shutdown_hook(&args, &audit_dir, &node, &dbus_tx, &metrics);
    // No hook to wait for the agent's word: the sweep's end is read instead.
    let sweep = hook
        .is_none()
        .then(|| crate::detect::final_sweep::Reader::of(&node, dbus_tx.clone()));
    if sweep.is_some() {
        metrics.set_last_word("final-sweep", true);
    }
    let logind = launch::spawn_detectors(&args.dbus, dbus_tx, health.clone()).await?;
    let policy = crate::decide::DecisionPolicy {
        trust_unowned_bus_signals: args.dbus.trust_unowned_bus_signals,
        ..cfg.trust.policy(graceful_length)
    };
    let mut agent = Agent::new(audit, None, logind, metrics.clone())
        .with_policy(policy)
        .with_host(
            HostProbe::query(&args.dbus),
            host_reachable(&args.dbus, &health),
        );
    agent = if args.standalone {
        agent.printing()
    } else {
        agent.with_cluster_coming(joined.clone())
    };
    if let Some(run_dir) = courier {
        agent = agent.with_courier(run_dir, cfg.api_server.url()?);
    }
    agent.after_boot(&boot_id).await?;
    // Arming parsed the kernel's BTF and the start read the audit log
    // (megabytes, freed again): give the freed heap back to the kernel
    // rather than keep it resident while the agent idles.
    release_freed_heap();
    health.beat();
    health.ready();
    let inputs = Inputs {
        det,
        dbus_rx,
        joined: (!args.standalone).then_some(joined.clone()),
        hook,
        sweep,
    };
    let episode_open = turn(agent, inputs, &metrics, &health).await?;
    let cluster = joined.borrow().clone();
    if let Some(c) = cluster {
        leave_host_if_uninstalled(&args, &audit_dir, &c, episode_open).await;
    }
    Ok(())
}

/// The agent's DaemonSet is deleted (an uninstall): the host is left as it
/// was (`host_files`). The DaemonSet's name comes from the pod's
/// environment; without it nothing is removed.
async fn leave_host_if_uninstalled(args: &RunArgs, audit_dir: &Path, c: &Cluster, open: bool) {
    let (Ok(ns), Ok(ds)) = (
        std::env::var("POD_NAMESPACE"),
        std::env::var("LASTGASP_DAEMONSET"),
    ) else {
        return;
    };
    let paths = crate::host_files::HostPaths {
        hook_dir: args.shutdown_hook_dir.clone(),
        run_dir: args.run_dir.clone(),
        unit_dir: args.unit_dir.clone(),
        logind_root: args.dbus.logind_root.clone(),
        audit_dir: audit_dir.to_path_buf(),
        audit: false,
    };
    let bus = args.dbus.system_bus.as_deref();
    let left = crate::host_files::leave_if_uninstalled(
        c.node.client.clone(),
        (&ns, &ds),
        &paths,
        open,
        bus,
    );
    use crate::host_files::Left;
    // Within the pod's termination grace (45 s): systemd's reload after the
    // final unit's removal took over 5 s on a busy node.
    let left = tokio::time::timeout(Duration::from_secs(30), left).await;
    match &left {
        Ok(Ok(Some(Left::Cleaned(said)))) => {
            tracing::info!(target: "lastgasp", "uninstalled: {}", said.trim_end().replace('\n', "; "));
        }
        Ok(Ok(Some(Left::NotClean(e)))) => {
            tracing::warn!(error = %e, "the DaemonSet is deleted, but the host was NOT left clean (`lastgasp clean-host` does it)");
        }
        Ok(Ok(Some(Left::OtherAgent(said)))) => tracing::info!(target: "lastgasp", "{said}"),
        Ok(Ok(None)) => {}
        Ok(Err(e)) => tracing::warn!(
            error = format!("{e:#}"),
            "whether the DaemonSet is deleted is not known: the host's files stay"
        ),
        Err(_) => {
            tracing::warn!("the host NOT left clean within 30 s (`lastgasp clean-host` does it)");
        }
    }
    // Uninstalled, whatever the host allowed: the conditions go.
    if let Ok(Ok(Some(Left::Cleaned(_) | Left::NotClean(_)))) = left {
        if let Err(e) = c.node.remove_own_conditions().await {
            tracing::warn!(
                error = format!("{e:#}"),
                "the agent's conditions NOT removed from its Node"
            );
        }
    }
}

/// A graceful run's length: the buckets' sum, or the default without them.
fn graceful_length(buckets: &[crate::grace::Bucket]) -> Duration {
    match buckets
        .iter()
        .map(|b| u64::try_from(b.seconds).unwrap_or(0))
        .fold(0u64, u64::saturating_add)
    {
        0 => crate::decide::DecisionPolicy::default().graceful_length,
        secs => Duration::from_secs(secs),
    }
}

fn load_config(args: &RunArgs) -> Result<Config> {
    let cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None if args.standalone => Config::default(),
        None => anyhow::bail!("cluster mode needs --config (the grace periods, at least)"),
    };
    match cfg.kubelet_graceful_shutdown() {
        Ok(Some(on)) => tracing::error!("{on}: two drains would race for the same pods"),
        Ok(None) => {}
        Err(e) => tracing::error!(error = format!("{e:#}"), "the kubelet's config NOT read"),
    }
    Ok(cfg)
}

/// /metrics, /readyz and /healthz.
async fn start_endpoint(
    args: &RunArgs,
    metrics: &Metrics,
    health: &Arc<Health>,
) -> Result<Option<(std::net::SocketAddr, tokio::task::JoinHandle<()>)>> {
    let listen = http::resolve(
        args.metrics_listen,
        args.standalone,
        http::AGENT_PORT,
        std::env::var("POD_IP").ok().as_deref(),
    )?;
    let m = metrics.clone();
    http::start(
        listen,
        args.metrics_listen.is_some() || !args.standalone,
        move || m.encode(),
        health.clone(),
    )
    .await
}

/// The eBPF hooks loaded and attached, each hook's state said (metrics, and
/// the log or stderr).
fn arm(node: &NodePidNs, metrics: &Metrics, json_logs: bool) -> Result<EbpfDetector> {
    let det = EbpfDetector::load(node.clone())?;
    for r in &det.report {
        metrics.set_hook(
            &r.hook,
            &r.attach,
            !matches!(r.state, HookState::Unavailable(_)),
        );
    }
    let drops = det.drops_by_cause();
    metrics.set_ringbuf_drops(&drops.by_label());
    metrics.set_hook_errors(drops.hook_errors_by_label());
    if json_logs {
        for r in &det.report {
            tracing::info!(
                hook = r.hook,
                attach = r.attach,
                state = r.state.name(),
                why = r.state.why(),
                node_pidns = node.ino,
                "hook"
            );
        }
    } else {
        eprintln!(
            "lastgasp: hooks (node pid namespace {}, init pid {}):",
            node.ino, node.init_pid
        );
        for r in &det.report {
            eprintln!("  {r}");
        }
    }
    Ok(det)
}

/// The cluster half, started beside the loop: it joins through `joined`
/// once the API server answers (retried with backoff, said in /readyz).
/// A configuration error (no kubeconfig, a bad apiServer) stops the start.
async fn start_cluster_half(
    cfg: &Config,
    audit_dir: &std::path::Path,
    buckets: Vec<crate::grace::Bucket>,
    health: &Arc<Health>,
    joined: tokio::sync::watch::Sender<Option<Arc<Cluster>>>,
) -> Result<()> {
    let node = node_name(cfg)?;
    let clients = Clients::new(cfg).await?;
    let (cfg, audit_dir, health) = (cfg.clone(), audit_dir.to_path_buf(), health.clone());
    health.lost(
        "api-server",
        "not reached yet (the warm watches of the node and its pods have not listed); detection and the audit run meanwhile",
    );
    tokio::spawn(async move {
        let mut wait = Duration::from_secs(1);
        loop {
            match cluster(&cfg, &clients, &node, &audit_dir, buckets.clone()).await {
                Ok(c) => {
                    health.regained("api-server");
                    let _ = joined.send(Some(Arc::new(c)));
                    return;
                }
                Err(e) => {
                    health.lost("api-server", &format!("{e:#}; trying again"));
                    tracing::warn!(
                        error = format!("{e:#}"),
                        again_in = ?wait,
                        "the cluster half cannot start yet"
                    );
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(30));
        }
    });
    Ok(())
}

/// systemd-shutdown's hook, when asked for (its paths once installed), and
/// in cluster mode its courier (the run directory where the courier's kit
/// goes): beside the hook, or where the hook's directory is read-only,
/// under the audit directory with the final unit to run it
/// (`act::final_unit`).
fn start_shutdown_hook(
    args: &RunArgs,
    audit_dir: &Path,
    node: &NodePidNs,
    tx: &tokio::sync::mpsc::Sender<crate::signal::ShutdownSignal>,
    metrics: &Metrics,
) -> (Option<shutdown_hook::HookPaths>, Option<PathBuf>) {
    let Some(paths) = args
        .shutdown_hook_dir
        .clone()
        .map(|hook_dir| shutdown_hook::HookPaths {
            hook_dir,
            run_dir: args.run_dir.clone(),
        })
    else {
        tracing::info!("no systemd-shutdown hook (no --shutdown-hook-dir): a shutdown through systemd is fenced only if the agent outlives the units' stop");
        return (None, None);
    };
    let installed = shutdown_hook::start(&paths, node, tx.clone());
    metrics.set_last_word("shutdown-hook", installed.is_ok());
    let armed = installed.is_ok();
    let courier_dir = match &installed {
        Ok(()) => Ok(paths.hook_dir.join(crate::hostio::COURIER)),
        Err(_) => std::fs::read_to_string("/proc/1/mountinfo")
            .map_err(anyhow::Error::from)
            .and_then(|m| crate::act::courier::home(&m, &args.run_dir, audit_dir)),
    };
    if args.standalone {
        return (armed.then_some(paths), None);
    }
    if args.no_courier {
        let _ = crate::host_files::remove_courier(&paths.hook_dir, &paths.run_dir);
        let _ = std::fs::remove_dir_all(audit_dir.join(crate::act::courier::BESIDE_AUDIT));
        let _ = std::fs::remove_dir_all(args.run_dir.join(crate::act::courier::IN_RUN));
        tracing::info!("no courier (--no-courier): a shutdown that stops the agent before systemd-shutdown's hook is not fenced");
        return (armed.then_some(paths), None);
    }
    let unit_dir = match (installed, &args.unit_dir) {
        (Ok(()), _) => None,
        (Err(e), None) => {
            tracing::warn!(error = format!("{e:#}"), "systemd-shutdown's hook NOT installed and no --unit-dir: a shutdown through systemd is fenced only if the agent's last word outruns the kernel's power-off (never under the systemd cgroup driver)");
            return (armed.then_some(paths), None);
        }
        (Err(e), Some(d)) => {
            tracing::warn!(error = format!("{e:#}"), unit_dir = %d.display(), "systemd-shutdown's hook NOT installed: the courier runs from lastgasp's final unit instead");
            Some(d.clone())
        }
    };
    let courier_dir = match courier_dir {
        Ok(d) => d,
        Err(e) => {
            metrics.set_last_word("courier", false);
            metrics.set_last_word("final-unit", false);
            tracing::warn!(error = format!("{e:#}"), "no courier: a shutdown that stops the agent before systemd's end (every shutdown through systemd under the systemd cgroup driver) loses its last word");
            return (armed.then_some(paths), None);
        }
    };
    let run_dir = paths.run_dir.clone();
    tokio::spawn(arm_courier(
        courier_dir,
        run_dir.clone(),
        unit_dir,
        args.dbus.system_bus.clone(),
        metrics.clone(),
    ));
    (armed.then_some(paths), Some(run_dir))
}

/// The courier's copy (megabytes: beside the loop, not before it), then
/// where there is no hook the final unit that runs it.
async fn arm_courier(
    courier_dir: PathBuf,
    run_dir: PathBuf,
    unit_dir: Option<PathBuf>,
    bus: Option<String>,
    metrics: Metrics,
) {
    use crate::act::{courier, final_unit};
    let (dir, kits) = (courier_dir.clone(), run_dir.clone());
    let installed = tokio::task::spawn_blocking(move || courier::install(&dir, &kits))
        .await
        .unwrap_or_else(|e| Err(e.into()));
    metrics.set_last_word("courier", installed.is_ok());
    if let Err(e) = installed {
        return tracing::warn!(error = format!("{e:#}"), dir = %courier_dir.display(), "no courier: a shutdown that stops or kills the agent before systemd-shutdown's hook (every shutdown through systemd under the systemd cgroup driver) loses its last word");
    }
    let Some(unit_dir) = unit_dir else { return };
    let entry = courier::entry(&courier_dir);
    let armed = match final_unit::install(&unit_dir, &entry, &courier::dir(&run_dir)) {
        Ok(()) => final_unit::reload(bus.as_deref()).await,
        Err(e) => Err(e),
    };
    metrics.set_last_word("final-unit", armed.is_ok());
    match armed {
        Ok(()) => tracing::info!(unit = %unit_dir.join(final_unit::TEMPLATE).display(), courier = %entry.display(), "lastgasp's final unit installed: systemd runs the courier right before its power-off, reboot, halt or kexec"),
        Err(e) => tracing::warn!(error = format!("{e:#}"), "lastgasp's final unit NOT installed: a shutdown through systemd is not fenced under the systemd cgroup driver"),
    }
}

/// Cluster mode: the clients (kube's own retries off: ours know the
/// deadlines), the warm watches and the last gasp's connections.
/// The node's name: a missing one is a configuration error, not a wait.
fn node_name(cfg: &Config) -> Result<String> {
    cfg.node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok())
        .context("cluster mode needs the node's name: nodeName in the config, or $NODE_NAME")
}

/// Watches (long reads), the node's other requests, and the last gasp's
/// own connections (nothing queues before them). Made from the config
/// alone: nothing is asked of the API server yet.
struct Clients {
    watch: ::kube::Client,
    requests: ::kube::Client,
    patch: ::kube::Client,
}

impl Clients {
    async fn new(cfg: &Config) -> Result<Self> {
        let server = cfg.api_server.url()?;
        if let Some(url) = &server {
            tracing::info!(
                url,
                "reaching the API server directly (apiServer), not through the Service VIP"
            );
        }
        Ok(Clients {
            watch: apiserver::client(Use::Watch, server.as_deref()).await?,
            requests: apiserver::client(Use::Requests, server.as_deref()).await?,
            patch: apiserver::client(Use::Requests, server.as_deref()).await?,
        })
    }
}

/// The cluster half, once its warm watches (the node, its pods) listed.
async fn cluster(
    cfg: &Config,
    clients: &Clients,
    node: &str,
    audit_dir: &std::path::Path,
    buckets: Vec<crate::grace::Bucket>,
) -> Result<Cluster> {
    let Clients {
        watch,
        requests,
        patch,
    } = clients;
    let own_pod = match (std::env::var("POD_NAMESPACE"), std::env::var("POD_NAME")) {
        (Ok(ns), Ok(name)) => Some((ns, name)),
        _ => None,
    };
    Ok(Cluster {
        node: NodeClient::start_with(watch.clone(), requests.clone(), node).await?,
        lastgasp: LastGasp::start(watch.clone(), patch.clone(), node).await?,
        graceful: Arc::new(GracefulOptions {
            buckets,
            removal: cfg.pod_removal,
            own_pod,
            state_file: audit_dir.join("graceful_node_shutdown_state"),
            keep: cfg.keep(),
        }),
    })
}

/// Whether logind or systemd can be reached now: requests wait for their
/// confirmation only then.
fn host_reachable(args: &DbusArgs, health: &Arc<Health>) -> Arc<dyn Fn() -> bool + Send + Sync> {
    if args.no_dbus {
        return Arc::new(|| false);
    }
    let health = health.clone();
    Arc::new(move || health.bus_reachable())
}

/// glibc keeps freed memory in its arenas; `malloc_trim` returns what it
/// can to the kernel (the agent idles for days after a burst at start).
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)] // FFI into glibc, which has no safe wrapper
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}
