//! logind's Manager (`org.freedesktop.login1.Manager`), typed, and the
//! small [`Inhibitor`] interface the logind detector needs from it (the
//! kubelet's `dbusInhibiter`): unit tests put a fake behind it.
use std::{collections::HashMap, future::Future, os::fd::OwnedFd, time::Duration};

use zbus::{proxy::CacheProperties, Connection};

use super::systemd::{self, SystemdManagerProxy};

pub const LOGIND: &str = "org.freedesktop.login1";
pub(crate) const PATH: &str = "/org/freedesktop/login1";
pub(crate) const MANAGER: &str = "org.freedesktop.login1.Manager";

/// One entry of `ListInhibitors`: what, who, why, mode, uid, pid.
pub(crate) type InhibitorEntry = (String, String, String, String, u32, u32);

/// Properties are read afresh each time: logind's InhibitDelayMaxUSec is
/// "const" on the bus yet changes on reload.
#[zbus::proxy(
    interface = "org.freedesktop.login1.Manager",
    default_service = "org.freedesktop.login1",
    default_path = "/org/freedesktop/login1"
)]
pub trait LogindManager {
    fn inhibit(&self, what: &str, who: &str, why: &str, mode: &str) -> zbus::Result<zbus::OwnedFd>;

    fn list_inhibitors(&self) -> zbus::Result<Vec<InhibitorEntry>>;

    #[zbus(property(emits_changed_signal = "false"), name = "InhibitDelayMaxUSec")]
    fn inhibit_delay_max_usec(&self) -> zbus::Result<u64>;

    #[zbus(property(emits_changed_signal = "false"))]
    fn preparing_for_shutdown(&self) -> zbus::Result<bool>;

    /// systemd ≥ 255: the kind of the shutdown under way (`type`).
    #[zbus(property(emits_changed_signal = "false"))]
    fn preparing_for_shutdown_with_metadata(
        &self,
    ) -> zbus::Result<HashMap<String, zbus::OwnedVariant>>;

    /// (type, µs since the epoch); ("", 0) when none is scheduled.
    #[zbus(property(emits_changed_signal = "false"))]
    fn scheduled_shutdown(&self) -> zbus::Result<(String, u64)>;

    #[zbus(signal)]
    fn prepare_for_shutdown(&self, start: bool) -> zbus::Result<()>;
}

/// logind's manager on `conn`, without a property cache.
pub(crate) async fn manager(conn: &Connection) -> zbus::Result<LogindManagerProxy<'static>> {
    LogindManagerProxy::builder(conn)
        .cache_properties(CacheProperties::No)
        .build()
        .await
}

/// What the logind detector asks of the host: logind's delay limit, a delay
/// lock, and a reload of logind's configuration.
pub trait Inhibitor {
    /// logind's InhibitDelayMaxUSec, as it is now.
    fn current_inhibit_delay(&self) -> impl Future<Output = zbus::Result<Duration>> + Send;
    /// A `shutdown` delay lock; the fd is the lock.
    fn inhibit_shutdown(
        &self,
        who: &str,
        why: &str,
    ) -> impl Future<Output = zbus::Result<OwnedFd>> + Send;
    /// SIGHUP to systemd-logind.service through systemd, as the kubelet does.
    fn reload_logind_conf(&self) -> impl Future<Output = zbus::Result<()>> + Send;
}

/// The real host: logind, and systemd for the reload.
#[derive(Clone, Debug)]
pub struct Host {
    pub logind: LogindManagerProxy<'static>,
    pub systemd: SystemdManagerProxy<'static>,
}

impl Host {
    pub async fn new(conn: &Connection) -> zbus::Result<Self> {
        Ok(Host {
            logind: manager(conn).await?,
            systemd: systemd::manager(conn).await?,
        })
    }
}

impl Inhibitor for Host {
    async fn current_inhibit_delay(&self) -> zbus::Result<Duration> {
        self.logind
            .inhibit_delay_max_usec()
            .await
            .map(Duration::from_micros)
    }

    async fn inhibit_shutdown(&self, who: &str, why: &str) -> zbus::Result<OwnedFd> {
        let fd = self.logind.inhibit("shutdown", who, why, "delay").await?;
        Ok(fd.into())
    }

    async fn reload_logind_conf(&self) -> zbus::Result<()> {
        self.systemd
            .kill_unit("systemd-logind.service", "all", libc::SIGHUP)
            .await
    }
}
