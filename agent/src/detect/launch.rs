//! Starts the logind and systemd detectors beside the eBPF one, with the
//! options `run` and `check` share.
use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Result;
use tokio::sync::mpsc;

use super::{
    logind::{self, LogindConfig, LogindDetector, StartError},
    systemd::{self, SystemdConfig, SystemdDetector},
};
use crate::{
    bus::{self, delay_lock::DelayLockHandle, logind::Host, LOGIND},
    health::Health,
    preflight::{Report, Status},
    signal::ShutdownSignal,
};

/// The options `run` and `check` share.
#[derive(clap::Args, Clone, Debug)]
pub struct DbusArgs {
    /// The shutdown delay graceful work needs; logind's InhibitDelayMaxSec is
    /// raised to it with a drop-in (default: take what logind allows).
    #[arg(long, value_parser = humantime::parse_duration, env = "LASTGASP_INHIBIT_DELAY")]
    pub inhibit_delay: Option<Duration>,
    /// Where logind's configuration lives: `ROOT/etc/systemd/logind.conf.d`
    /// gets the drop-in (tests point it at a scratch directory).
    #[arg(long, default_value = "/", env = "LASTGASP_LOGIND_ROOT")]
    pub logind_root: PathBuf,
    /// The system bus address (default: $DBUS_SYSTEM_BUS_ADDRESS, else the
    /// standard socket).
    #[arg(long, env = "LASTGASP_SYSTEM_BUS")]
    pub system_bus: Option<String>,
    /// `run`: do not start the logind and systemd detectors.
    #[arg(long, env = "LASTGASP_NO_DBUS")]
    pub no_dbus: bool,
    /// Act on logind's PrepareForShutdown from peers that do not own
    /// `org.freedesktop.login1`, as the kubelet does (its e2e tests fake the
    /// signal with `dbus-send`). For test rigs only: with it, any local
    /// process allowed on the system bus can start a drain. Off by default:
    /// such signals are audited, audit-only, with the sender named.
    #[arg(long, env = "LASTGASP_TRUST_UNOWNED_BUS_SIGNALS")]
    pub trust_unowned_bus_signals: bool,
}

impl DbusArgs {
    pub fn logind(&self) -> LogindConfig {
        LogindConfig {
            bus: self.system_bus.clone(),
            want_delay: self.inhibit_delay,
            logind_root: self.logind_root.clone(),
            trust_unowned: self.trust_unowned_bus_signals,
            ..LogindConfig::default()
        }
    }

    pub fn systemd(&self) -> SystemdConfig {
        SystemdConfig {
            bus: self.system_bus.clone(),
            ..SystemdConfig::default()
        }
    }
}

/// Starts the logind and systemd detectors as tasks sending on `tx`. One
/// that cannot start (no system bus, no logind, a refused call) keeps trying
/// in its task, and `health` is unready, naming why, until it is there: the
/// eBPF hooks see every shutdown meanwhile, but nothing holds one for the
/// pods. `--no-dbus` says the node has no such bus (then nothing is
/// expected of it).
pub(crate) async fn spawn_detectors(
    args: &DbusArgs,
    tx: mpsc::Sender<ShutdownSignal>,
    health: Arc<Health>,
) -> Result<Option<DelayLockHandle>> {
    if args.no_dbus {
        return Ok(None);
    }
    let (det, handle) = match LogindDetector::start(args.logind()).await {
        Ok((det, handle)) => {
            tracing::info!(
                inhibit_delay_max = ?det.inhibit_delay_max(),
                "logind: delay lock taken"
            );
            (det, handle)
        }
        Err(e) => {
            let (det, handle) = LogindDetector::pending(args.logind());
            health.lost(logind::PART, &not_armed(&e));
            (det, handle)
        }
    };
    health.bus_started(logind::PART);
    let det = det.report_to(health.clone());
    let (logind_tx, logind_health) = (tx.clone(), health.clone());
    tokio::spawn(async move {
        if let Err(e) = det.run(logind_tx).await {
            tracing::error!(error = format!("{e:#}"), "logind detector stopped");
            logind_health.lost(logind::PART, &format!("the detector stopped: {e:#}"));
        }
    });
    let det = match SystemdDetector::start(args.systemd()).await {
        Ok(det) => {
            tracing::info!("systemd: following shutdown jobs");
            det
        }
        Err(e) => {
            health.lost(
                systemd::PART,
                &format!("{e:#}: systemd's shutdown jobs are not followed; trying again"),
            );
            SystemdDetector::pending(args.systemd())
        }
    };
    health.bus_started(systemd::PART);
    let det = det.report_to(health.clone());
    tokio::spawn(async move {
        if let Err(e) = det.run(tx).await {
            tracing::error!(error = format!("{e:#}"), "systemd detector stopped");
            health.lost(systemd::PART, &format!("the detector stopped: {e:#}"));
        }
    });
    Ok(Some(handle))
}

/// Why the graceful path is not armed, for readiness and `check`.
fn not_armed(e: &StartError) -> String {
    format!(
        "{e}: the graceful path is NOT armed (no delay lock holds a shutdown for the pods; \
         the eBPF hooks still see it and the last gasp is sent); trying again. \
         A node without systemd runs the agent with --no-dbus"
    )
}

/// The bus, logind and systemd, as `run` would find them.
pub(crate) async fn preflight(r: &mut Report, args: &DbusArgs) {
    let address = args
        .system_bus
        .clone()
        .or_else(|| std::env::var("DBUS_SYSTEM_BUS_ADDRESS").ok())
        .unwrap_or_else(|| "unix:path=/run/dbus/system_bus_socket (default)".into());
    let conn = match bus::connect(args.system_bus.as_deref()).await {
        Ok(c) => {
            r.push(Status::Ok, "system bus", address);
            c
        }
        Err(e) => {
            // `run` goes on without it (unready, trying again): the eBPF
            // hooks still see every shutdown, but nothing holds one.
            r.push(
                Status::Fail,
                "system bus",
                format!("cannot connect to {address}: {e}: the graceful path would NOT be armed (no logind delay lock, no systemd jobs; eBPF hooks only). A node without systemd runs the agent with --no-dbus"),
            );
            return;
        }
    };
    let host = match Host::new(&conn).await {
        Ok(h) => h,
        Err(e) => {
            r.push(
                Status::Fail,
                "system bus",
                format!("the logind and systemd proxies: {e}"),
            );
            return;
        }
    };
    match bus::name_owner(&conn, LOGIND).await {
        Ok(Some(owner)) => {
            let who = match bus::peer_pid_uid(&conn, &owner).await {
                Some((pid, _)) => {
                    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                    format!(" (pid {pid} {})", comm.trim())
                }
                None => String::new(),
            };
            r.push(Status::Ok, "logind", format!("{LOGIND} is {owner}{who}"));
            logind::preflight::preflight(r, &host, &args.logind_root, args.inhibit_delay).await;
        }
        Ok(None) => r.push(
            Status::Fail,
            "logind",
            format!("nobody owns {LOGIND}: the graceful path would NOT be armed (no delay lock can hold a shutdown; only the eBPF hooks would see it). A node without logind runs the agent with --no-dbus"),
        ),
        Err(e) => r.push(Status::Fail, "logind", format!("asking the bus for {LOGIND}: {e}")),
    }
    systemd::preflight(r, &conn, &host).await;
}
