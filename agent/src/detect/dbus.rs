//! What the logind and systemd detectors and `lastgasp check` share: bus
//! names, connecting, property reads, signal streams, and starting both
//! detectors beside the eBPF one.
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::Result;
use tokio::sync::mpsc;
use zbus::{
    connection, message::Type as MsgType, wire::OwnedVariant, Connection, MatchRule, MessageStream,
};

use super::{
    logind::{self, LogindConfig, LogindDetector, LogindHandle, StartError},
    systemd::{self, SystemdConfig, SystemdDetector},
};
use crate::{http::Health, signal::ShutdownSignal};

pub const LOGIND: &str = "org.freedesktop.login1";
pub const LOGIND_PATH: &str = "/org/freedesktop/login1";
pub const LOGIND_MANAGER: &str = "org.freedesktop.login1.Manager";
pub const SYSTEMD: &str = "org.freedesktop.systemd1";
pub const SYSTEMD_PATH: &str = "/org/freedesktop/systemd1";
pub const SYSTEMD_MANAGER: &str = "org.freedesktop.systemd1.Manager";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";

/// No reply within this is treated as a broken bus.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Starts the logind and systemd detectors as tasks sending on `tx`. A node
/// without a system bus, logind or systemd runs on without them (the eBPF
/// hooks still see every shutdown); a logind that cannot give the delay the
/// grace period needs is an error. A connection lost later makes `health`
/// unready until it is back.
pub async fn spawn_detectors(
    args: &DbusArgs,
    tx: mpsc::Sender<ShutdownSignal>,
    health: Arc<Health>,
) -> Result<Option<LogindHandle>> {
    if args.no_dbus {
        return Ok(None);
    }
    let handle = match LogindDetector::start(args.logind()).await {
        Ok((det, handle)) => {
            tracing::info!(
                inhibit_delay_max = ?det.inhibit_delay_max(),
                "logind: delay lock taken"
            );
            let (tx, health) = (tx.clone(), health.clone());
            health.bus_started(logind::PART);
            let det = det.report_to(health.clone());
            tokio::spawn(async move {
                if let Err(e) = det.run(tx).await {
                    tracing::error!("logind detector stopped: {e:#}");
                    health.lost(logind::PART, &format!("the detector stopped: {e:#}"));
                }
            });
            Some(handle)
        }
        Err(e @ (StartError::NoBus(_) | StartError::NoLogind)) => {
            tracing::warn!("logind detection off: {e}");
            None
        }
        Err(e) => return Err(e.into()),
    };
    match SystemdDetector::start(args.systemd()).await {
        Ok(det) => {
            tracing::info!("systemd: following shutdown jobs");
            health.bus_started(systemd::PART);
            let det = det.report_to(health.clone());
            tokio::spawn(async move {
                if let Err(e) = det.run(tx).await {
                    tracing::error!("systemd detector stopped: {e:#}");
                    health.lost(systemd::PART, &format!("the detector stopped: {e:#}"));
                }
            });
        }
        Err(e) => tracing::warn!("systemd job detection off: {e:#}"),
    }
    Ok(handle)
}

/// Asks the host whether a shutdown is under way: logind's
/// `PreparingForShutdown`, and systemd's job list. Its own connection, made
/// afresh for each question (asked rarely: once an episode outlives its
/// expected end).
#[derive(Clone, Debug)]
pub struct HostProbe {
    bus: Option<String>,
}

impl HostProbe {
    pub fn new(bus: Option<String>) -> Self {
        HostProbe { bus }
    }

    /// `Some(evidence)` when a shutdown is under way, `None` when neither
    /// logind nor systemd has one, an error when neither could be asked.
    pub async fn shutdown_under_way(&self) -> Result<Option<String>> {
        let conn = tokio::time::timeout(CALL_TIMEOUT, connect(self.bus.as_deref()))
            .await
            .map_err(|_| anyhow::anyhow!("connecting to the system bus timed out"))??;
        let (preparing, jobs) = tokio::join!(
            logind_property::<bool>(&conn, "PreparingForShutdown"),
            shutdown_jobs(&conn)
        );
        match (preparing, jobs) {
            (Ok(true), _) => Ok(Some("logind is preparing for shutdown".into())),
            (_, Ok(jobs)) if !jobs.is_empty() => Ok(Some(format!(
                "systemd has shutdown jobs: {}",
                jobs.join(", ")
            ))),
            (Ok(false), Ok(_)) | (Ok(false), Err(_)) | (Err(_), Ok(_)) => Ok(None),
            (Err(l), Err(s)) => Err(anyhow::anyhow!(
                "neither logind ({l}) nor systemd ({s}) answered"
            )),
        }
    }
}

/// systemd's queued start jobs: (id, unit).
pub async fn start_jobs(conn: &Connection) -> zbus::Result<Vec<(u32, String)>> {
    type Job = (
        u32,
        String,
        String,
        String,
        zbus::OwnedObjectPath,
        zbus::OwnedObjectPath,
    );
    let jobs: Vec<Job> = conn
        .call_method(
            Some(SYSTEMD),
            SYSTEMD_PATH,
            Some(SYSTEMD_MANAGER),
            "ListJobs",
            &(),
        )
        .await?
        .body()
        .deserialize()?;
    Ok(jobs
        .into_iter()
        .filter(|(_, _, job_type, ..)| job_type == "start")
        .map(|(id, unit, ..)| (id, unit))
        .collect())
}

/// systemd's queued start jobs for units that shut the node down.
async fn shutdown_jobs(conn: &Connection) -> zbus::Result<Vec<String>> {
    Ok(start_jobs(conn)
        .await?
        .into_iter()
        .filter(|(_, unit)| systemd::unit_kind(unit).is_some())
        .map(|(_, unit)| unit)
        .collect())
}

/// The system bus, or the bus at `address`.
pub async fn connect(address: Option<&str>) -> zbus::Result<Connection> {
    let builder = match address {
        Some(a) => connection::Builder::address(a),
        None => connection::Builder::system(),
    };
    builder.method_timeout(CALL_TIMEOUT).build().await
}

/// One property, read afresh (no cache: logind's InhibitDelayMaxUSec is
/// "const" on the bus, yet changes on reload).
pub async fn get_property<T>(
    conn: &Connection,
    dest: &str,
    path: &str,
    iface: &str,
    name: &str,
) -> zbus::Result<T>
where
    T: TryFrom<OwnedVariant>,
    T::Error: Into<zbus::Error>,
{
    let reply = conn
        .call_method(Some(dest), path, Some(PROPERTIES), "Get", &(iface, name))
        .await?;
    let v: OwnedVariant = reply.body().deserialize()?;
    T::try_from(v).map_err(Into::into)
}

pub async fn logind_property<T>(conn: &Connection, name: &str) -> zbus::Result<T>
where
    T: TryFrom<OwnedVariant>,
    T::Error: Into<zbus::Error>,
{
    get_property(conn, LOGIND, LOGIND_PATH, LOGIND_MANAGER, name).await
}

/// The unique name owning `name`, `None` when nobody does.
pub async fn name_owner(conn: &Connection, name: &str) -> zbus::Result<Option<String>> {
    let r = conn
        .call_method(
            Some("org.freedesktop.DBus"),
            "/org/freedesktop/DBus",
            Some("org.freedesktop.DBus"),
            "GetNameOwner",
            &(name,),
        )
        .await;
    match r {
        Ok(m) => Ok(Some(m.body().deserialize::<String>()?)),
        Err(zbus::Error::FDO(e)) if matches!(*e, zbus::fdo::Error::NameHasNoOwner(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The pid and uid of a bus peer, when it is still connected.
pub async fn peer_pid_uid(conn: &Connection, unique: &str) -> Option<(u32, u32)> {
    let call = |m: &'static str| async move {
        conn.call_method(
            Some("org.freedesktop.DBus"),
            "/org/freedesktop/DBus",
            Some("org.freedesktop.DBus"),
            m,
            &(unique,),
        )
        .await
    };
    let (pid, uid) = tokio::join!(
        call("GetConnectionUnixProcessID"),
        call("GetConnectionUnixUser")
    );
    Some((
        pid.ok()?.body().deserialize().ok()?,
        uid.ok()?.body().deserialize().ok()?,
    ))
}

/// A stream of the signal `iface.member` on `path`, from `sender` if given
/// (the bus resolves a well-known name to its current owner).
pub async fn signal_stream(
    conn: &Connection,
    sender: Option<&str>,
    path: &str,
    iface: &str,
    member: &str,
) -> zbus::Result<MessageStream> {
    let mut rule = MatchRule::builder()
        .msg_type(MsgType::Signal)
        .path(path)
        .interface(iface)
        .member(member);
    if let Some(s) = sender {
        rule = rule.sender(s);
    }
    MessageStream::for_match_rule(rule.build()?, conn, None).await
}

/// A microsecond wall-clock timestamp as logind and systemd give them.
pub fn wall_usec(usec: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(usec)
}
