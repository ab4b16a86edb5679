use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lastgasp::{
    act::{
        audit::{self, AuditLog, BootFilter},
        kube::{graceful::GracefulOptions, lastgasp::LastGasp, NodeClient},
        metrics::{ControllerMetrics, Metrics},
    },
    agent::{Agent, Cluster},
    config::Config,
    controller::{Controller, ControllerConfig, Policy},
    decide::HostAnswer,
    detect::{
        dbus::{self, DbusArgs},
        ebpf::EbpfDetector,
    },
    http::{self, Health, Listen},
    node::{self, NodePidNs},
};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser)]
#[command(
    name = "lastgasp",
    version,
    about = "Sees every way a Linux node shuts down, and tells the cluster"
)]
struct Cli {
    /// Log as JSON lines (to stderr), the start report's hook lines included.
    #[arg(long, global = true, env = "LASTGASP_JSON_LOGS")]
    json_logs: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Arm the detectors and report every shutdown signal.
    Run(RunArgs),
    /// Print the audit log, by boot.
    History {
        #[arg(long, default_value = DEFAULT_AUDIT_DIR, env = "LASTGASP_AUDIT_DIR")]
        audit_dir: PathBuf,
        /// `current`, `previous`, `all` or a boot id.
        #[arg(long, default_value = "all", env = "LASTGASP_BOOT")]
        boot: BootFilter,
    },
    /// Completes the non-graceful shutdown procedure in the cluster (one
    /// active replica, elected through a Lease).
    Controller(ControllerArgs),
    /// Node preflight: kernel, hooks, BTF, privileges, D-Bus and logind, and
    /// the API permissions. Prints a table; exits 1 when something required
    /// is missing (warnings alone exit 0).
    Check(lastgasp::check::CheckArgs),
}

const DEFAULT_AUDIT_DIR: &str = "/var/lib/lastgasp";

#[derive(clap::Args)]
struct ControllerArgs {
    /// When to apply node.kubernetes.io/out-of-service.
    #[arg(
        long,
        value_enum,
        default_value = "poweroff-only",
        env = "LASTGASP_POLICY"
    )]
    policy: Policy,
    /// With `also-reboots`: how long a reboot may stay down before the taint.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m", env = "LASTGASP_REBOOT_TIMEOUT")]
    reboot_timeout: std::time::Duration,
    #[arg(long, default_value_t = 3, env = "LASTGASP_MAX_TAINTS_PER_HOUR")]
    max_taints_per_hour: usize,
    #[arg(long, default_value = "kube-system", env = "LASTGASP_LEASE_NAMESPACE")]
    lease_namespace: String,
    #[arg(
        long,
        default_value = "lastgasp-controller",
        env = "LASTGASP_LEASE_NAME"
    )]
    lease_name: String,
    /// This replica's name in the Lease (default: $POD_NAME).
    #[arg(long, env = "LASTGASP_IDENTITY")]
    identity: Option<String>,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s", env = "LASTGASP_INTERVAL")]
    interval: std::time::Duration,
    /// Serve /metrics, /readyz and /healthz on ADDR:PORT, or `off`
    /// (default: $POD_IP:9851).
    #[arg(long, value_name = "ADDR:PORT", env = "LASTGASP_METRICS_LISTEN")]
    metrics_listen: Option<Listen>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Run without a cluster: print each signal as a JSON line and audit it.
    #[arg(long, env = "LASTGASP_STANDALONE")]
    standalone: bool,
    /// The agent's configuration file (YAML); required in cluster mode.
    #[arg(long, env = "LASTGASP_CONFIG")]
    config: Option<PathBuf>,
    /// The PID namespace that is "the node", as an ns/pid file
    /// (default: the initial namespace). Tests point it at a child namespace.
    #[arg(long, env = "LASTGASP_NODE_PID_NS")]
    node_pid_ns: Option<PathBuf>,
    /// Overrides the config's auditDir (default /var/lib/lastgasp).
    #[arg(long, env = "LASTGASP_AUDIT_DIR")]
    audit_dir: Option<PathBuf>,
    /// Serve /metrics, /readyz and /healthz on ADDR:PORT, or `off` (default:
    /// 127.0.0.1:9850 standalone, $POD_IP:9850 in cluster mode). A given
    /// address that cannot be bound stops the start; the standalone default
    /// only logs a warning.
    #[arg(long, value_name = "ADDR:PORT", env = "LASTGASP_METRICS_LISTEN")]
    metrics_listen: Option<Listen>,
    #[command(flatten)]
    dbus: DbusArgs,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only on a terminal: journald and kubectl logs get plain text.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if cli.json_logs {
        logs.json().init();
    } else {
        logs.init();
    }
    match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(run(args, cli.json_logs)),
        Command::History { audit_dir, boot } => history(&audit_dir, &boot),
        Command::Controller(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(controller(args)),
        Command::Check(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            std::process::exit(rt.block_on(lastgasp::check::main(&args)))
        }
    }
}

async fn run(mut args: RunArgs, json_logs: bool) -> Result<()> {
    let started = Instant::now();
    let cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None if args.standalone => Config::default(),
        None => anyhow::bail!("cluster mode needs --config (the grace periods, at least)"),
    };
    match cfg.kubelet_graceful_shutdown() {
        Ok(Some(on)) => tracing::error!("{on}: two drains would race for the same pods"),
        Ok(None) => {}
        Err(e) => tracing::error!("{e:#}"),
    }
    let listen = http::resolve(
        args.metrics_listen,
        args.standalone,
        http::AGENT_PORT,
        std::env::var("POD_IP").ok().as_deref(),
    )?;
    let metrics = Metrics::default();
    let health = Health::new("arming the hooks");
    let m = metrics.clone();
    let _endpoint = http::start(
        listen,
        args.metrics_listen.is_some() || !args.standalone,
        move || m.encode(),
        health.clone(),
    )
    .await?;
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
    let mut det = EbpfDetector::load(node.clone())?;
    let armed_ms = started.elapsed().as_secs_f64() * 1e3;
    metrics.set_hooks(&det.report);
    metrics.set_ringbuf_drops(det.drops_by_cause());
    if json_logs {
        for r in &det.report {
            let (state, why) = match &r.state {
                lastgasp::detect::ebpf::HookState::Armed => ("armed", None),
                lastgasp::detect::ebpf::HookState::Degraded(w) => ("degraded", Some(w.as_str())),
                lastgasp::detect::ebpf::HookState::Unavailable(w) => {
                    ("unavailable", Some(w.as_str()))
                }
            };
            tracing::info!(
                hook = r.hook,
                attach = r.attach,
                state,
                why,
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
    tracing::info!(armed_ms = format!("{armed_ms:.1}"), audit = %audit.path().display(), boot_id, "armed");

    // Standalone needs no grace periods: a graceful episode is then given
    // the default length before the host is asked.
    let buckets = match cfg.buckets() {
        Ok(b) => b,
        Err(_) if args.standalone && args.config.is_none() => Vec::new(),
        Err(e) => return Err(e),
    };
    let graceful_length = match buckets
        .iter()
        .map(|b| u64::try_from(b.seconds).unwrap_or(0))
        .fold(0u64, u64::saturating_add)
    {
        0 => lastgasp::decide::Policy::default().graceful_length,
        secs => Duration::from_secs(secs),
    };
    let cluster = if args.standalone {
        None
    } else {
        // logind must give the graceful path the buckets' whole time.
        args.dbus
            .inhibit_delay
            .get_or_insert(lastgasp::grace::requested_delay(&buckets));
        health.not_ready("hooks armed; waiting for the warm watches (node, pods) to list");
        Some(std::sync::Arc::new(
            cluster(&cfg, &audit_dir, buckets).await?,
        ))
    };
    // logind and systemd over D-Bus feed the same loop.
    let (dbus_tx, mut dbus_rx) = tokio::sync::mpsc::channel(64);
    let logind = dbus::spawn_detectors(&args.dbus, dbus_tx, health.clone()).await?;
    let policy = cfg
        .trust
        .policy(graceful_length, args.dbus.trust_unowned_bus_signals);
    let mut agent = Agent::new(audit, cluster, logind, metrics.clone(), args.standalone)
        .with_policy(policy)
        .with_host(host_query(&args.dbus), host_reachable(&args.dbus, &health));
    agent.after_boot(&boot_id).await?;
    // Arming parsed the kernel's BTF and the start read the audit log
    // (megabytes, freed again): give the freed heap back to the kernel
    // rather than keep it resident while the agent idles (~31 -> ~14 MiB).
    release_freed_heap();
    health.beat();
    health.ready();

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut drops = lastgasp::detect::ebpf::Drops::default();
    let (mut stopping, mut told) = (false, false);
    loop {
        if stopping && !agent.graceful_running() {
            break;
        }
        // Fair: a flood of records (bounded per batch, node scope first) cannot
        // starve the buses, the host's answers or the heartbeat.
        tokio::select! {
            batch = det.next_batch() => {
                for s in batch? {
                    agent.handle(s).await?;
                }
            }
            Some(s) = dbus_rx.recv() => {
                agent.handle(s).await?;
            }
            answer = agent.next_answer() => agent.host_answer(answer).await,
            _ = tick.tick() => {
                health.beat();
                agent.tick(std::time::SystemTime::now()).await;
                let now = det.drops_by_cause();
                if now != drops {
                    tracing::warn!(
                        node_full = now.node_full,
                        container_full = now.container_full,
                        container_rate_limited = now.container_rate_limited,
                        "kernel records lost (totals)"
                    );
                    metrics.set_ringbuf_drops(now);
                    drops = now;
                }
            }
            // A graceful run under way is finished first (the pod's
            // terminationGracePeriodSeconds bounds it); signals are still
            // handled meanwhile, so an escalation still sends the last gasp.
            _ = term.recv() => stopping = true,
            _ = int.recv() => stopping = true,
        }
        if stopping && agent.graceful_running() && !told {
            tracing::info!("asked to stop: finishing the graceful run first");
            told = true;
        }
    }
    tracing::info!(ring_buffer_drops = det.drops(), "stopping");
    Ok(())
}

/// Cluster mode: the clients (kube's own retries off: ours know the
/// deadlines), the warm watches and the last gasp's connections.
async fn cluster(
    cfg: &Config,
    audit_dir: &std::path::Path,
    buckets: Vec<lastgasp::grace::Bucket>,
) -> Result<Cluster> {
    let node = cfg
        .node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok())
        .context("cluster mode needs the node's name: nodeName in the config, or $NODE_NAME")?;
    let server = cfg.api_server.url()?;
    if let Some(url) = &server {
        tracing::info!(
            url,
            "reaching the API server directly (apiServer), not through the Service VIP"
        );
    }
    // Watches (long reads), the node's other requests, and the last gasp's
    // own connections (nothing queues before them).
    let (watch, requests, patch) = (
        kube_client(Use::Watch, server.as_deref()).await?,
        kube_client(Use::Requests, server.as_deref()).await?,
        kube_client(Use::Requests, server.as_deref()).await?,
    );
    let own_pod = match (std::env::var("POD_NAMESPACE"), std::env::var("POD_NAME")) {
        (Ok(ns), Ok(name)) => Some((ns, name)),
        _ => None,
    };
    Ok(Cluster {
        node: NodeClient::start_with(watch.clone(), requests, &node).await?,
        lastgasp: LastGasp::start(watch, patch, &node).await?,
        graceful: std::sync::Arc::new(GracefulOptions {
            buckets,
            removal: cfg.pod_removal,
            own_pod,
            state_file: audit_dir.join("graceful_node_shutdown_state"),
            keep: cfg.keep(),
        }),
    })
}

/// How long a client may wait on the API server: watches hold their
/// requests open for minutes; every other request is short, and bounded.
#[derive(Clone, Copy)]
enum Use {
    Watch,
    Requests,
}

async fn kube_client(usage: Use, server: Option<&str>) -> Result<kube::Client> {
    let mut config = kube::Config::infer()
        .await
        .context("no Kubernetes configuration (in-cluster or $KUBECONFIG)")?;
    if let Some(url) = server {
        // Only the address changes: the credentials stay the agent's own.
        config.cluster_url = url.parse().with_context(|| format!("apiServer: {url}"))?;
    }
    config.default_retry = false;
    config.connect_timeout = Some(Duration::from_secs(3));
    config.write_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(match usage {
        // The watcher asks for 290 s windows; kube's own default is 295 s.
        Use::Watch => Duration::from_secs(295),
        Use::Requests => Duration::from_secs(10),
    });
    Ok(kube::Client::try_from(config)?)
}

/// Asks logind and systemd whether a shutdown is under way.
fn host_query(args: &DbusArgs) -> lastgasp::agent::HostQuery {
    let probe = (!args.no_dbus).then(|| dbus::HostProbe::new(args.system_bus.clone()));
    std::sync::Arc::new(move || {
        let probe = probe.clone();
        Box::pin(async move {
            let Some(probe) = probe else {
                return HostAnswer::Unknown("D-Bus detection is off (--no-dbus)".into());
            };
            match probe.shutdown_under_way().await {
                Ok(Some(evidence)) => HostAnswer::UnderWay(evidence),
                Ok(None) => HostAnswer::NotUnderWay,
                Err(e) => HostAnswer::Unknown(format!("{e:#}")),
            }
        })
    })
}

/// Whether logind or systemd can be reached now: requests wait for their
/// confirmation only then.
fn host_reachable(
    args: &DbusArgs,
    health: &std::sync::Arc<Health>,
) -> std::sync::Arc<dyn Fn() -> bool + Send + Sync> {
    if args.no_dbus {
        return std::sync::Arc::new(|| false);
    }
    let health = health.clone();
    std::sync::Arc::new(move || health.bus_reachable())
}

async fn controller(args: ControllerArgs) -> Result<()> {
    let identity = args
        .identity
        .or_else(|| std::env::var("POD_NAME").ok())
        .unwrap_or_else(|| format!("lastgasp-controller-{}", std::process::id()));
    let cfg = ControllerConfig {
        policy: args.policy,
        reboot_timeout: args.reboot_timeout,
        max_taints_per_hour: args.max_taints_per_hour,
        lease_namespace: args.lease_namespace,
        lease_name: args.lease_name,
        identity,
        lease_duration: std::time::Duration::from_secs(15),
    };
    let listen = http::resolve(
        args.metrics_listen,
        false,
        http::CONTROLLER_PORT,
        std::env::var("POD_IP").ok().as_deref(),
    )?;
    let health = Health::new("starting: the node watch has not listed yet");
    let metrics = ControllerMetrics::default();
    let m = metrics.clone();
    let _endpoint = http::start(listen, true, move || m.encode(), health.clone()).await?;
    let mut c = Controller::start(kube_client(Use::Watch, None).await?, cfg).await?;
    c.metrics = metrics;
    health.not_ready("the first controller pass has not finished");
    let mut tick = tokio::time::interval(args.interval);
    let mut term = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                health.beat();
                match c.tick().await {
                    Ok(_) => health.ready(),
                    Err(e) => tracing::warn!("controller pass: {e:#}"),
                }
            }
            _ = term.recv() => return Ok(()),
        }
    }
}

fn history(dir: &std::path::Path, boot: &BootFilter) -> Result<()> {
    let path = dir.join(audit::FILE_NAME);
    let contents = audit::read(&path)?;
    let current = node::boot_id().context("reading the current boot id")?;
    for (line, err) in &contents.unreadable {
        eprintln!("{}:{line}: unreadable record: {err}", path.display());
    }
    for r in audit::select(&contents.records, boot, &current) {
        println!("{}", serde_json::to_string(r)?);
    }
    Ok(())
}

/// glibc keeps freed memory in its arenas; `malloc_trim` returns what it
/// can to the kernel (the agent idles for days after a burst at start).
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}
