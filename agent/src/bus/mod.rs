//! The system bus, below the detectors: connecting, the bus daemon's own
//! answers (who owns a name, who a peer is), and typed proxies for logind's
//! and systemd's managers. Nothing here knows what a shutdown signal is.
use std::time::{Duration, SystemTime};

use zbus::{connection, fdo::DBusProxy, message::Type as MsgType, Connection, MatchRule};

pub mod delay_lock;
pub(crate) mod logind;
pub(crate) mod systemd;

pub use logind::{LogindManagerProxy, LOGIND};
pub use systemd::{SystemdManagerProxy, SYSTEMD};

/// No reply within this is treated as a broken bus.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The system bus, or the bus at `address`.
pub async fn connect(address: Option<&str>) -> zbus::Result<Connection> {
    connect_waiting(address, CALL_TIMEOUT).await
}

/// As [`connect`], its calls waiting up to `timeout` for an answer.
pub async fn connect_waiting(address: Option<&str>, timeout: Duration) -> zbus::Result<Connection> {
    let builder = match address {
        Some(a) => connection::Builder::address(a),
        None => connection::Builder::system(),
    };
    builder.method_timeout(timeout).build().await
}

/// The unique name owning `name`, `None` when nobody does.
pub async fn name_owner(conn: &Connection, name: &str) -> zbus::Result<Option<String>> {
    let name = zbus::names::BusName::try_from(name)?;
    match DBusProxy::new(conn).await?.get_name_owner(name).await {
        Ok(owner) => Ok(Some(owner.to_string())),
        Err(zbus::fdo::Error::NameHasNoOwner(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The pid and uid of a bus peer, when it is still connected.
pub async fn peer_pid_uid(conn: &Connection, unique: &str) -> Option<(u32, u32)> {
    let proxy = DBusProxy::new(conn).await.ok()?;
    let name = zbus::names::BusName::try_from(unique).ok()?;
    let (pid, uid) = tokio::join!(
        proxy.get_connection_unix_process_id(name.clone()),
        proxy.get_connection_unix_user(name)
    );
    Some((pid.ok()?, uid.ok()?))
}

/// A match rule for every `iface.member` signal on `path`, whoever sends
/// it. A proxy's stream only carries the name owner's; a detector that must
/// also see (and report) forgeries listens with this.
pub fn any_sender_rule(
    path: &str,
    iface: &str,
    member: &str,
) -> zbus::Result<zbus::OwnedMatchRule> {
    Ok(MatchRule::builder()
        .msg_type(MsgType::Signal)
        .path(path)
        .interface(iface)
        .member(member)
        .build()?
        .into())
}

/// A microsecond wall-clock timestamp as logind and systemd give them.
/// Past year 9999 (`u64::MAX` is logind's "never"), the latest time a log
/// can write.
pub fn wall_usec(usec: u64) -> SystemTime {
    (SystemTime::UNIX_EPOCH + Duration::from_micros(usec)).min(crate::timespan::latest())
}
