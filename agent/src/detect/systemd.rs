//! systemd's job queue over D-Bus (`org.freedesktop.systemd1.Manager`): a
//! job for a shutdown unit means the node is going down.
//!
//! After `Subscribe`, systemd announces every job with `JobNew` and its end
//! with `JobRemoved`. `systemctl poweroff` goes through logind, which sends
//! `PrepareForShutdown(true)` first and queues `poweroff.target` once the
//! delay locks are gone. A shutdown job with no such signal before it was
//! queued without logind (`systemctl start poweroff.target`, SIGRTMIN+4 or
//! SIGINT to PID 1, ...): no delay lock holds it, and the signal says so
//! (`bypasses_logind`).
//!
//! "Before" means: received earlier on this same connection (so the bus's
//! own order decides), from the owner of `org.freedesktop.login1`, not
//! cancelled since, and at most logind's InhibitDelayMaxUSec plus
//! `logind_slack` earlier (logind queues the job within the delay).
//!
//! One shutdown queues several of these units at once (poweroff.target pulls
//! in systemd-poweroff.service and shutdown.target): one signal is sent per
//! kind while its jobs are pending; `shutdown.target` alone counts as
//! `unknown`.
use std::{collections::HashMap, sync::Arc, time::Duration};

use anyhow::{bail, Result};
use futures::StreamExt;
use tokio::{sync::mpsc, time::Instant};
use zbus::{message::Sequence, Connection, Message};

use crate::{
    bus::{
        self,
        logind::{Host, Inhibitor, PrepareForShutdownStream},
        systemd::{start_jobs, JobNewStream, JobRemovedStream, SYSTEMD},
    },
    clock::now_pair,
    health::Health,
    preflight::{Report, Status},
    signal::{BusSender, Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};

/// logind's PrepareForShutdown, systemd's JobNew and JobRemoved.
struct Streams {
    prepare: PrepareForShutdownStream,
    job_new: JobNewStream,
    job_removed: JobRemovedStream,
}

#[derive(Clone, Debug)]
pub struct SystemdConfig {
    /// Bus address; `None` is the system bus.
    pub bus: Option<String>,
    pub reconnect_after: Duration,
    /// How much later than logind's delay its job may still come.
    pub logind_slack: Duration,
}

impl Default for SystemdConfig {
    fn default() -> Self {
        SystemdConfig {
            bus: None,
            reconnect_after: Duration::from_secs(1),
            logind_slack: Duration::from_secs(5),
        }
    }
}

/// The units whose start job shuts the node down, and the kind.
pub fn unit_kind(unit: &str) -> Option<Kind> {
    Some(match unit {
        "poweroff.target" | "systemd-poweroff.service" => Kind::Poweroff,
        // ctrl-alt-del.target is an alias of reboot.target unless changed.
        "reboot.target" | "systemd-reboot.service" | "ctrl-alt-del.target" => Kind::Reboot,
        "halt.target" | "systemd-halt.service" => Kind::Halt,
        "kexec.target" | "systemd-kexec.service" => Kind::Kexec,
        "soft-reboot.target" | "systemd-soft-reboot.service" => Kind::SoftReboot,
        "shutdown.target" => Kind::Unknown,
        _ => return None,
    })
}

pub struct SystemdDetector {
    cfg: SystemdConfig,
    conn: Option<(Connection, Host)>,
    /// Subscribed by `start`, for the first session.
    streams: Option<Streams>,
    /// Shutdown jobs queued and not yet removed: id -> (unit, kind).
    pending: HashMap<u32, (String, Kind)>,
    /// logind's last PrepareForShutdown(true), not cancelled since.
    prepared: Option<(Instant, Sequence)>,
    window: Duration,
    /// Where a lost bus connection is reported (the readiness endpoint).
    health: Option<Arc<Health>>,
}

/// What `health` calls this detector's bus connection.
pub const PART: &str = "systemd";

impl SystemdDetector {
    pub async fn start(cfg: SystemdConfig) -> Result<Self> {
        let conn = bus::connect(cfg.bus.as_deref()).await?;
        if bus::name_owner(&conn, SYSTEMD).await?.is_none() {
            bail!("systemd (org.freedesktop.systemd1) is not on the system bus");
        }
        let host = Host::new(&conn).await?;
        let streams = subscribe(&host).await?;
        let mut det = Self::pending(cfg);
        det.conn = Some((conn, host));
        det.streams = Some(streams);
        Ok(det)
    }

    /// A detector that has not reached systemd: `run` connects and
    /// subscribes when it can, trying every `reconnect_after`.
    pub fn pending(cfg: SystemdConfig) -> Self {
        SystemdDetector {
            cfg,
            conn: None,
            streams: None,
            pending: HashMap::new(),
            prepared: None,
            window: Duration::ZERO,
            health: None,
        }
    }

    /// Reports a lost bus connection to `health` while it lasts.
    pub fn report_to(mut self, health: Arc<Health>) -> Self {
        self.health = Some(health);
        self
    }

    /// Runs until `tx` is closed, reconnecting and subscribing again when
    /// the bus goes away.
    pub async fn run(mut self, tx: mpsc::Sender<ShutdownSignal>) -> Result<()> {
        loop {
            match self.session(&tx).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let why = format!("{e:#}; reconnecting every {:?}", self.cfg.reconnect_after);
                    // `health` logs a loss once, not at every try.
                    match &self.health {
                        Some(h) => h.lost(PART, &why),
                        None => tracing::warn!(%why, "systemd: detector lost"),
                    }
                }
            }
            self.conn = None;
            self.streams = None;
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.reconnect_after) => {}
                _ = tx.closed() => return Ok(()),
            }
        }
    }

    /// One connection's worth; `Ok` when `tx` is closed.
    async fn session(&mut self, tx: &mpsc::Sender<ShutdownSignal>) -> Result<()> {
        let (conn, host) = match self.conn.take() {
            Some(c) => c,
            None => {
                let conn = bus::connect(self.cfg.bus.as_deref()).await?;
                if bus::name_owner(&conn, SYSTEMD).await?.is_none() {
                    bail!("systemd (org.freedesktop.systemd1) is not on the system bus");
                }
                let host = Host::new(&conn).await?;
                (conn, host)
            }
        };
        self.conn = Some((conn, host.clone()));
        let Streams {
            mut prepare,
            mut job_new,
            mut job_removed,
        } = match self.streams.take() {
            Some(s) => s,
            None => subscribe(&host).await?,
        };
        let delay = host
            .current_inhibit_delay()
            .await
            .unwrap_or(Duration::from_secs(5));
        self.window = delay.saturating_add(self.cfg.logind_slack);
        self.pending.clear();
        self.prepared = None;

        // Jobs queued before we looked: the agent may start mid-shutdown.
        let jobs = start_jobs(&host.systemd).await?;
        let preparing = host.logind.preparing_for_shutdown().await.unwrap_or(false);
        for (id, unit) in jobs {
            if let Some(s) = self.job_new(id, &unit, preparing) {
                if tx.send(s).await.is_err() {
                    return Ok(());
                }
            }
        }

        if let Some(h) = &self.health {
            h.regained(PART);
        }
        let closed = || anyhow::anyhow!("the bus connection closed");
        loop {
            // logind's signal first: a job is judged after every signal the
            // bus delivered before it.
            let out = tokio::select! {
                biased;
                m = prepare.next() => {
                    self.on_prepare(m.ok_or_else(closed)?.message());
                    None
                }
                m = job_new.next() => self.on_job_new(m.ok_or_else(closed)?.message()),
                m = job_removed.next() => self.on_job_removed(m.ok_or_else(closed)?.message()),
                _ = tx.closed() => return Ok(()),
            };
            if let Some(s) = out {
                if tx.send(s).await.is_err() {
                    return Ok(());
                }
            }
        }
    }

    fn on_prepare(&mut self, m: &Message) {
        match m.body().deserialize::<bool>() {
            Ok(true) => self.prepared = Some((Instant::now(), m.recv_position())),
            Ok(false) => self.prepared = None,
            Err(e) => tracing::debug!(error = %e, "systemd: malformed PrepareForShutdown ignored"),
        }
    }

    fn on_job_new(&mut self, m: &Message) -> Option<ShutdownSignal> {
        let sender = sender_of(m);
        let (id, _job, unit): (u32, zbus::OwnedObjectPath, String) = match m.body().deserialize() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "systemd: malformed JobNew ignored");
                return None;
            }
        };
        let covered = self
            .prepared
            .is_some_and(|(t, seq)| seq < m.recv_position() && t.elapsed() <= self.window);
        let mut s = self.job_new(id, &unit, covered)?;
        s.sender = sender;
        Some(s)
    }

    /// A shutdown job was queued; `covered` when logind announced it.
    fn job_new(&mut self, id: u32, unit: &str, covered: bool) -> Option<ShutdownSignal> {
        let kind = unit_kind(unit)?;
        // One signal per kind while its jobs are pending.
        let seen = self
            .pending
            .values()
            .any(|(_, k)| *k == kind || kind == Kind::Unknown);
        self.pending.insert(id, (unit.to_string(), kind));
        if seen {
            tracing::debug!(unit, "systemd: part of a shutdown already reported");
            return None;
        }
        if !covered {
            tracing::warn!(unit, "systemd: shutdown job with no PrepareForShutdown before it: logind was bypassed, no delay lock holds it");
        } else {
            tracing::info!(unit, "systemd: shutdown job queued by logind");
        }
        Some(signal(kind, Effect::Now, !covered, "JobNew", unit))
    }

    fn on_job_removed(&mut self, m: &Message) -> Option<ShutdownSignal> {
        let (id, _job, unit, result): (u32, zbus::OwnedObjectPath, String, String) =
            match m.body().deserialize() {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, "systemd: malformed JobRemoved ignored");
                    return None;
                }
            };
        let (_, kind) = self.pending.remove(&id)?;
        // "done" means the shutdown goes on; anything else (canceled,
        // failed, dependency...) with no shutdown job left calls it off.
        if result == "done" || !self.pending.is_empty() {
            return None;
        }
        tracing::info!(
            unit,
            result,
            "systemd: shutdown job ended without running: shutdown called off"
        );
        let mut s = signal(kind, Effect::Cancel, false, "JobRemoved", &unit);
        s.sender = sender_of(m);
        Some(s)
    }
}

/// The sender of a message that came through a match on systemd's
/// well-known name: the bus delivers only what its current owner sends.
fn sender_of(m: &Message) -> Option<BusSender> {
    Some(BusSender {
        unique: m.header().sender()?.to_string(),
        owns_name: true,
    })
}

/// logind's PrepareForShutdown, systemd's JobNew and JobRemoved, each from
/// its name's current owner (the proxies follow NameOwnerChanged); then
/// `Subscribe`, without which systemd sends no job signals.
async fn subscribe(host: &Host) -> Result<Streams> {
    let streams = Streams {
        prepare: host.logind.receive_prepare_for_shutdown().await?,
        job_new: host.systemd.receive_job_new().await?,
        job_removed: host.systemd.receive_job_removed().await?,
    };
    match host.systemd.subscribe().await {
        Ok(()) => Ok(streams),
        Err(zbus::Error::MethodError(name, _, _)) if name.ends_with("AlreadySubscribed") => {
            Ok(streams)
        }
        Err(e) => bail!("Subscribe: {e}"),
    }
}

fn signal(
    kind: Kind,
    effect: Effect,
    bypasses_logind: bool,
    member: &str,
    unit: &str,
) -> ShutdownSignal {
    let (at, boot_ns) = now_pair();
    ShutdownSignal {
        source: Source::Systemd,
        kind,
        forced: false,
        bypasses_logind,
        calls_reboot: false,
        scope: Scope::Node,
        effect,
        actor: None,
        sender: None,
        at,
        boot_ns,
        deadline: None,
        detail: Detail::Dbus {
            member: member.to_string(),
            unit: Some(unit.to_string()),
        },
    }
}

/// What `lastgasp check` reports of systemd: whether its job signals can be
/// followed.
pub async fn preflight(r: &mut Report, conn: &Connection, host: &Host) {
    match bus::name_owner(conn, SYSTEMD).await {
        Ok(Some(_)) => match host.systemd.subscribe().await {
            Ok(()) => {
                let _ = host.systemd.unsubscribe().await;
                r.push(
                    Status::Ok,
                    "systemd",
                    "Subscribe works: shutdown jobs that bypass logind are seen",
                );
            }
            Err(e) => r.push(Status::Fail, "systemd", format!("Subscribe failed: {e}: the agent would stay unready")),
        },
        _ => r.push(
            Status::Fail,
            "systemd",
            format!("nobody owns {SYSTEMD}: shutdown jobs would be seen by the eBPF hooks only and the agent would stay unready. A node without systemd runs the agent with --no-dbus"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_signal_per_kind_while_its_jobs_are_pending() {
        let mut d = SystemdDetector::pending(SystemdConfig::default());
        let s = d.job_new(1, "shutdown.target", false).unwrap();
        assert_eq!(s.kind, Kind::Unknown);
        let s = d.job_new(2, "poweroff.target", false).unwrap();
        assert_eq!((s.kind, s.bypasses_logind), (Kind::Poweroff, true));
        assert!(d.job_new(3, "systemd-poweroff.service", false).is_none());
        assert!(d.job_new(4, "sshd.service", false).is_none());
        assert_eq!(unit_kind("ctrl-alt-del.target"), Some(Kind::Reboot));
        assert_eq!(unit_kind("kexec.target"), Some(Kind::Kexec));
        assert_eq!(unit_kind("soft-reboot.target"), Some(Kind::SoftReboot));
    }
}
