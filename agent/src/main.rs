use std::{path::PathBuf, time::Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lastgasp::{
    act::audit::{self, AuditLog, BootFilter},
    detect::{actor, ebpf::EbpfDetector},
    node::{self, NodePidNs},
};
use lastgasp::{
    detect::dbus::{self, DbusArgs},
    signal::{Effect, ShutdownSignal, Source},
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
    /// Preflight: would graceful shutdown through logind work here? Exits 1
    /// with a report when something would make it fail.
    Check(DbusArgs),
}

const DEFAULT_AUDIT_DIR: &str = "/var/lib/lastgasp";

#[derive(clap::Args)]
struct RunArgs {
    /// Run without a cluster: print each signal as a JSON line and audit it.
    #[arg(long)]
    standalone: bool,
    /// The PID namespace that is "the node", as an ns/pid file
    /// (default: the initial namespace). Tests point it at a child namespace.
    #[arg(long)]
    node_pid_ns: Option<PathBuf>,
    #[arg(long, default_value = DEFAULT_AUDIT_DIR)]
    audit_dir: PathBuf,
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
        Command::Check(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            std::process::exit(rt.block_on(lastgasp::check::main(&args)))
        }
    }
}

async fn run(args: RunArgs) -> Result<()> {
    if !args.standalone {
        anyhow::bail!("cluster mode is not built yet: use `lastgasp run --standalone`");
    }
    let started = Instant::now();
    let node = match &args.node_pid_ns {
        Some(p) => NodePidNs::from_path(p)?,
        None => NodePidNs::initial()?,
    };
    let boot_id = node::boot_id()?;
    let mut audit = AuditLog::open(&args.audit_dir, &boot_id)?;
    let mut det = EbpfDetector::load(node.clone())?;
    let armed_ms = started.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "lastgasp: hooks (node pid namespace {}, init pid {}):",
        node.ino, node.init_pid
    );
    for r in &det.report {
        eprintln!("  {r}");
    }
    tracing::info!(armed_ms = format!("{armed_ms:.1}"), audit = %audit.path().display(), boot_id, "armed");
    // logind and systemd over D-Bus feed the same loop.
    let (dbus_tx, mut dbus_rx) = tokio::sync::mpsc::channel(64);
    let logind = dbus::spawn_detectors(&args.dbus, dbus_tx).await?;

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut drops = 0;
    loop {
        tokio::select! {
            // Records first: on SIGTERM mid-shutdown, what was seen is written out before exiting.
            biased;
            batch = det.next_batch() => {
                for s in batch? {
                    report(&mut audit, s)?;
                }
            }
            Some(s) = dbus_rx.recv() => {
                let graceful = s.source == Source::Logind && s.effect == Effect::Now;
                report(&mut audit, s)?;
                // Standalone, the graceful work is the audit record: let the shutdown go on.
                if let (true, Some(l)) = (graceful, &logind) {
                    l.release();
                }
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

fn report(audit: &mut AuditLog, mut s: ShutdownSignal) -> Result<()> {
    if let Some(a) = s.actor.as_mut() {
        actor::enrich(a);
    }
    if let Err(e) = audit.append(&s, None) {
        tracing::error!("audit record NOT written: {e:#}");
    }
    println!("{}", serde_json::to_string(&s)?);
    tracing::info!(source = ?s.source, kind = ?s.kind, forced = s.forced, scope = ?s.scope,
        pid = s.actor.as_ref().map(|a| a.pid), comm = s.actor.as_ref().map(|a| a.comm.as_str()), "shutdown signal");
    Ok(())
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
