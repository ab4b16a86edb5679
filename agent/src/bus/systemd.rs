//! systemd's Manager (`org.freedesktop.systemd1.Manager`), typed.
use zbus::{proxy::CacheProperties, Connection, OwnedObjectPath};

pub const SYSTEMD: &str = "org.freedesktop.systemd1";

/// One entry of `ListJobs`: id, unit, job type, state, job path, unit path.
pub(crate) type Job = (
    u32,
    String,
    String,
    String,
    OwnedObjectPath,
    OwnedObjectPath,
);

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Manager",
    default_service = "org.freedesktop.systemd1",
    default_path = "/org/freedesktop/systemd1"
)]
pub trait SystemdManager {
    /// Without it systemd sends no job signals to this client.
    fn subscribe(&self) -> zbus::Result<()>;

    fn unsubscribe(&self) -> zbus::Result<()>;

    fn list_jobs(&self) -> zbus::Result<Vec<Job>>;

    fn kill_unit(&self, name: &str, whom: &str, signal: i32) -> zbus::Result<()>;

    /// `systemctl daemon-reload`: unit files (and their wants links) read
    /// again.
    fn reload(&self) -> zbus::Result<()>;

    #[zbus(signal)]
    fn job_new(&self, id: u32, job: OwnedObjectPath, unit: String) -> zbus::Result<()>;

    #[zbus(signal)]
    fn job_removed(
        &self,
        id: u32,
        job: OwnedObjectPath,
        unit: String,
        result: String,
    ) -> zbus::Result<()>;
}

/// systemd's manager on `conn`, without a property cache.
pub(crate) async fn manager(conn: &Connection) -> zbus::Result<SystemdManagerProxy<'static>> {
    SystemdManagerProxy::builder(conn)
        .cache_properties(CacheProperties::No)
        .build()
        .await
}

/// systemd's queued start jobs: (id, unit).
pub(crate) async fn start_jobs(
    systemd: &SystemdManagerProxy<'_>,
) -> zbus::Result<Vec<(u32, String)>> {
    Ok(systemd
        .list_jobs()
        .await?
        .into_iter()
        .filter(|(_, _, job_type, ..)| job_type == "start")
        .map(|(id, unit, ..)| (id, unit))
        .collect())
}
