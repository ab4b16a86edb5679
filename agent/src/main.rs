//! The `lastgasp` command: parses the command line, sets up logging and the
//! runtime, and hands over. Wiring only.
#![warn(clippy::too_many_lines)]
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use lastgasp::{
    act::audit::{self, BootFilter},
    agent::{self, RunArgs},
    check::{self, CheckArgs},
    controller::{self, ControllerArgs},
};

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
        #[arg(long, default_value = audit::DEFAULT_DIR, env = "LASTGASP_AUDIT_DIR")]
        audit_dir: PathBuf,
        /// `current`, `previous`, `all` or a boot id.
        #[arg(long, default_value = "all", env = "LASTGASP_BOOT")]
        boot: BootFilter,
        /// The whole cluster's shutdowns instead, from the controller's
        /// ledger (NodeShutdown objects; in-cluster or $KUBECONFIG).
        #[arg(long, env = "LASTGASP_CLUSTER")]
        cluster: bool,
        /// With --cluster: the window, back from now.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "7d", env = "LASTGASP_SINCE")]
        since: std::time::Duration,
    },
    /// Completes the non-graceful shutdown procedure in the cluster (one
    /// active replica, elected through a Lease).
    Controller(ControllerArgs),
    /// Node preflight: kernel, hooks, BTF, privileges, D-Bus and logind, and
    /// the API permissions. Prints a table; exits 1 when something required
    /// is missing (warnings alone exit 0).
    Check(CheckArgs),
    /// Removes what the agent left on this host: systemd-shutdown's hook and
    /// the courier, logind's drop-in (then logind re-reads its
    /// configuration), the run directory; the audit log only with --audit.
    /// The agent does this itself when its DaemonSet is deleted.
    CleanHost {
        #[command(flatten)]
        paths: lastgasp::host_files::HostPaths,
        /// The system bus address (default: $DBUS_SYSTEM_BUS_ADDRESS, else
        /// the standard socket), to have logind re-read its configuration.
        #[arg(long, env = "LASTGASP_SYSTEM_BUS")]
        system_bus: Option<String>,
    },
    /// Run by systemd-shutdown's hook when the agent is gone, or by
    /// lastgasp's final unit: sends the last word the agent prepared
    /// (act/courier.rs).
    #[command(hide = true)]
    Courier {
        #[arg(long, env = "LASTGASP_COURIER_DIR")]
        dir: PathBuf,
        /// The verb systemd-shutdown gave its hooks (`poweroff`, `reboot`, ...).
        #[arg(long)]
        verb: String,
        /// Run by lastgasp's final unit (act/final_unit.rs), not the hook.
        #[arg(long)]
        final_unit: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Command::Run(args) = &cli.command {
        agent::outlive_final_kill(args);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs never stall the agent: a thread of their own writes them, and
    // drops lines when stderr does not drain (a container's log pipe whose
    // reader, containerd, a shutdown has already stopped).
    let (stderr, flush) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(10_000)
        .finish(std::io::stderr());
    // Colour only on a terminal: journald and kubectl logs get plain text.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(stderr);
    if cli.json_logs {
        logs.json().init();
    } else {
        logs.init();
    }
    // The agent's loop is one thread (the eBPF rings, the buses, the API);
    // the controller's passes and the check may use more.
    let current = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    match cli.command {
        Command::Run(args) => current()?.block_on(agent::run(args, cli.json_logs)),
        Command::History {
            cluster: true,
            since,
            ..
        } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(controller::ledger_writer::print_history(since)),
        Command::History {
            audit_dir, boot, ..
        } => audit::history(&audit_dir, &boot),
        Command::Controller(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(controller::run(args)),
        Command::Courier {
            dir,
            verb,
            final_unit,
        } => {
            use lastgasp::act::courier;
            let pid1 = std::fs::read_to_string("/proc/1/comm")?;
            let cgroups = std::path::Path::new("/sys/fs/cgroup");
            let said = current()?.block_on(async {
                match final_unit {
                    true => courier::deliver_final_unit(&dir, &verb, cgroups).await,
                    false => courier::deliver(&dir, &verb, pid1.trim()).await,
                }
            });
            // The final unit's output has no journal left to go to: the
            // kernel's log, as the hook's.
            if final_unit {
                let line = match &said {
                    Ok(s) => format!("lastgasp: final unit ({verb}): {s}\n"),
                    Err(e) => format!("lastgasp: final unit ({verb}): {e:#}\n"),
                };
                let _ = std::fs::write("/dev/kmsg", line);
            }
            println!("{}", said?);
            Ok(())
        }
        Command::CleanHost { paths, system_bus } => {
            let said =
                current()?.block_on(lastgasp::host_files::clean(&paths, system_bus.as_deref()))?;
            print!("{said}");
            Ok(())
        }
        Command::Check(args) => {
            let code = current()?.block_on(check::main(&args));
            // The logs first: exit does not run destructors.
            drop(flush);
            std::process::exit(code)
        }
    }
}
