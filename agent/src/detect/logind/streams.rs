//! What the detector subscribes to, and the signals it makes of them.
use std::{
    fs,
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use zbus::{message::Type as MsgType, Connection, MatchRule, Message, MessageStream};

use crate::{
    bus::{
        self,
        logind::{LOGIND, MANAGER, PATH},
    },
    signal::{Actor, Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};

/// logind's name for a shutdown (a HandleAction or a ScheduleShutdown type).
pub fn kind_of(action: &str) -> Kind {
    match action.strip_prefix("dry-").unwrap_or(action) {
        "poweroff" => Kind::Poweroff,
        "reboot" => Kind::Reboot,
        "halt" => Kind::Halt,
        "kexec" => Kind::Kexec,
        "soft-reboot" => Kind::SoftReboot,
        _ => Kind::Unknown,
    }
}

/// The detector's subscriptions.
pub(super) struct Streams {
    /// PrepareForShutdown from the owner of org.freedesktop.login1 (the bus
    /// daemon filters broadcasts by sender; one sent straight to this
    /// connection still arrives, and is judged by the owner).
    pub(super) prepare: MessageStream,
    /// logind's ScheduledShutdown changes.
    pub(super) changed: MessageStream,
    /// NameOwnerChanged for org.freedesktop.login1.
    pub(super) owner_changed: MessageStream,
    /// PrepareForShutdown from every peer, on a connection of its own with
    /// a short queue: a flood of forgeries fills only that one. `None` when
    /// it could not be opened (forgeries then go unreported).
    pub(super) others: Option<MessageStream>,
}

pub(super) async fn next_other(
    others: &mut Option<MessageStream>,
) -> Option<zbus::Result<Message>> {
    match others {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

pub(super) async fn subscribe(conn: &Connection, address: Option<&str>) -> zbus::Result<Streams> {
    let rule = MatchRule::builder()
        .msg_type(MsgType::Signal)
        .sender(LOGIND)
        .path(PATH)
        .interface(MANAGER)
        .member("PrepareForShutdown")
        .build()?;
    let prepare = MessageStream::for_match_rule(rule, conn, None).await?;
    let rule = MatchRule::builder()
        .msg_type(MsgType::Signal)
        .sender("org.freedesktop.DBus")
        .interface("org.freedesktop.DBus")
        .member("NameOwnerChanged")
        .arg(0, LOGIND)
        .build()?;
    let owner_changed = MessageStream::for_match_rule(rule, conn, None).await?;
    let others = match bus::connect(address).await {
        Ok(c) => Some(
            MessageStream::for_match_rule(
                bus::any_sender_rule(PATH, MANAGER, "PrepareForShutdown")?,
                &c,
                std::num::NonZeroUsize::new(16),
            )
            .await?,
        ),
        Err(e) => {
            tracing::warn!(error = %e, "logind: no second bus connection to watch for forged PrepareForShutdown: forgeries go unreported");
            None
        }
    };
    let rule = MatchRule::builder()
        .msg_type(MsgType::Signal)
        .sender(LOGIND)
        .path(PATH)
        .interface("org.freedesktop.DBus.Properties")
        .member("PropertiesChanged")
        .arg(0, MANAGER)
        .build()?;
    let changed = MessageStream::for_match_rule(rule, conn, None).await?;
    Ok(Streams {
        prepare,
        changed,
        owner_changed,
        others,
    })
}

/// The process behind a bus peer, when it is still connected.
pub(super) async fn sender_actor(conn: &Connection, sender: &str) -> Option<Actor> {
    let (pid, uid) =
        tokio::time::timeout(Duration::from_millis(500), bus::peer_pid_uid(conn, sender))
            .await
            .ok()??;
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    Some(Actor {
        pid,
        ns_pid: pid,
        comm: comm.trim().to_string(),
        uid,
        ..Actor::default()
    })
}

pub(super) fn signal(
    kind: Kind,
    effect: Effect,
    deadline: Option<SystemTime>,
    at: SystemTime,
    boot_ns: u64,
    actor: Option<Actor>,
    member: &str,
) -> ShutdownSignal {
    ShutdownSignal {
        source: Source::Logind,
        kind,
        forced: false,
        bypasses_logind: false,
        calls_reboot: false,
        scope: Scope::Node,
        effect,
        actor,
        sender: None,
        at,
        boot_ns,
        deadline,
        detail: Detail::Dbus {
            member: member.to_string(),
            unit: None,
        },
    }
}

/// PrepareForShutdown's one boolean; a malformed signal is logged and
/// ignored.
pub(super) fn prepare_arg(m: &Message, sender: &str) -> Option<bool> {
    match m.body().deserialize() {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!(
                sender,
                signature = %m.body().signature(),
                error = %e,
                "logind: malformed PrepareForShutdown ignored (it carries one boolean)"
            );
            None
        }
    }
}
