use std::{path::PathBuf, time::Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lastgasp::{
    act::{
        audit::{self, AuditLog, BootFilter},
        kube::{graceful::GracefulOptions, lastgasp::LastGasp, NodeClient},
        metrics::Metrics,
    },
    agent::{Agent, Cluster},
    config::Config,
    controller::{Controller, ControllerConfig, Policy},
    detect::{
        dbus::{self, DbusArgs},
        ebpf::EbpfDetector,
    },
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
    /// Log as JSON lines (to stderr).
    #[arg(long, global = true)]
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
        #[arg(long, default_value = DEFAULT_AUDIT_DIR)]
        audit_dir: PathBuf,
        /// `current`, `previous`, `all` or a boot id.
        #[arg(long, default_value = "all")]
        boot: BootFilter,
    },
    /// Completes the non-graceful shutdown procedure in the cluster (one
    /// active replica, elected through a Lease).
    Controller(ControllerArgs),
    /// Preflight: would graceful shutdown through logind work here? Exits 1
    /// with a report when something would make it fail.
    Check(DbusArgs),
}

const DEFAULT_AUDIT_DIR: &str = "/var/lib/lastgasp";

#[derive(clap::Args)]
struct ControllerArgs {
    /// When to apply node.kubernetes.io/out-of-service.
    #[arg(long, value_enum, default_value = "poweroff-only")]
    policy: Policy,
    /// With `also-reboots`: how long a reboot may stay down before the taint.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m")]
    reboot_timeout: std::time::Duration,
    #[arg(long, default_value_t = 3)]
    max_taints_per_hour: usize,
    #[arg(long, default_value = "kube-system")]
    lease_namespace: String,
    #[arg(long, default_value = "lastgasp-controller")]
    lease_name: String,
    /// This replica's name in the Lease (default: $POD_NAME).
    #[arg(long)]
    identity: Option<String>,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    interval: std::time::Duration,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Run without a cluster: print each signal as a JSON line and audit it.
    #[arg(long)]
    standalone: bool,
    /// The agent's configuration file (YAML); required in cluster mode.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The PID namespace that is "the node", as an ns/pid file
    /// (default: the initial namespace). Tests point it at a child namespace.
    #[arg(long)]
    node_pid_ns: Option<PathBuf>,
    /// Overrides the config's auditDir (default /var/lib/lastgasp).
    #[arg(long)]
    audit_dir: Option<PathBuf>,
    #[command(flatten)]
    dbus: DbusArgs,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
            .block_on(run(args)),
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

async fn run(mut args: RunArgs) -> Result<()> {
    let started = Instant::now();
    let cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None if args.standalone => Config::default(),
        None => anyhow::bail!("cluster mode needs --config (the grace periods, at least)"),
    };
    let audit_dir = args.audit_dir.clone().unwrap_or_else(|| cfg.audit_dir.clone());
    let node = match &args.node_pid_ns {
        Some(p) => NodePidNs::from_path(p)?,
        None => NodePidNs::initial()?,
    };
    let boot_id = node::boot_id()?;
    let audit = AuditLog::open(&audit_dir, &boot_id)?;
    let mut det = EbpfDetector::load(node.clone())?;
    let armed_ms = started.elapsed().as_secs_f64() * 1e3;
    eprintln!("lastgasp: hooks (node pid namespace {}, init pid {}):", node.ino, node.init_pid);
    for r in &det.report {
        eprintln!("  {r}");
    }
    tracing::info!(armed_ms = format!("{armed_ms:.1}"), audit = %audit.path().display(), boot_id, "armed");

    let cluster = if args.standalone {
        None
    } else {
        let buckets = cfg.buckets()?;
        // logind must give the graceful path the buckets' whole time.
        args.dbus.inhibit_delay.get_or_insert(lastgasp::grace::requested_delay(&buckets));
        Some(std::sync::Arc::new(cluster(&cfg, &audit_dir, buckets).await?))
    };
    // logind and systemd over D-Bus feed the same loop.
    let (dbus_tx, mut dbus_rx) = tokio::sync::mpsc::channel(64);
    let logind = dbus::spawn_detectors(&args.dbus, dbus_tx).await?;
    let mut agent = Agent::new(audit, cluster, logind, Metrics::default(), args.standalone);
    agent.after_boot(&boot_id).await?;

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut drops = 0;
    loop {
        tokio::select! {
            // Records first: on SIGTERM mid-shutdown, what was seen is handled before exiting.
            biased;
            batch = det.next_batch() => {
                for s in batch? {
                    agent.handle(s).await?;
                }
            }
            Some(s) = dbus_rx.recv() => {
                agent.handle(s).await?;
            }
            _ = tick.tick() => {
                let now = det.drops();
                if now > drops {
                    tracing::warn!(dropped = now - drops, total = now, "ring buffer full: records lost");
                    drops = now;
                }
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    tracing::info!(ring_buffer_drops = det.drops(), "stopping");
    Ok(())
}

/// Cluster mode: the clients (kube's own retries off: ours know the
/// deadlines), the warm watches and the last gasp's connections.
async fn cluster(cfg: &Config, audit_dir: &std::path::Path, buckets: Vec<lastgasp::grace::Bucket>) -> Result<Cluster> {
    let node = cfg
        .node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok())
        .context("cluster mode needs the node's name: nodeName in the config, or $NODE_NAME")?;
    let (watch, patch) = (kube_client().await?, kube_client().await?);
    let own_pod = match (std::env::var("POD_NAMESPACE"), std::env::var("POD_NAME")) {
        (Ok(ns), Ok(name)) => Some((ns, name)),
        _ => None,
    };
    Ok(Cluster {
        node: NodeClient::start(watch.clone(), &node).await?,
        lastgasp: LastGasp::start(watch, patch, &node).await?,
        graceful: std::sync::Arc::new(GracefulOptions {
            buckets,
            removal: cfg.pod_removal,
            own_pod,
            state_file: audit_dir.join("graceful_node_shutdown_state"),
        }),
    })
}

async fn kube_client() -> Result<kube::Client> {
    let mut config = kube::Config::infer().await.context("no Kubernetes configuration (in-cluster or $KUBECONFIG)")?;
    config.default_retry = false;
    Ok(kube::Client::try_from(config)?)
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
    let mut c = Controller::start(kube_client().await?, cfg).await?;
    let mut tick = tokio::time::interval(args.interval);
    let mut term = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = c.tick().await {
                    tracing::warn!("controller pass: {e:#}");
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
