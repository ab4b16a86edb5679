//! logind over D-Bus: a shutdown delay lock, `PrepareForShutdown`, scheduled
//! shutdowns (`shutdown +N`), and the InhibitDelayMaxSec drop-in.
//!
//! The delay lock has its own owner ([`DelayLock`]); the detector tells it
//! when logind announces or calls off a shutdown, and lends it the bus.
//! Files by concern: the subscriptions and the signals made of them
//! (`streams`), scheduled shutdowns (`scheduled`), other peers'
//! PrepareForShutdown (`forged`), logind's configuration (`config`).
//!
//! `PrepareForShutdown` does not say which kind of shutdown starts: the kind
//! comes from logind's `PreparingForShutdownWithMetadata` (systemd ≥ 255),
//! else from `ScheduledShutdown` when it names one, else `unknown` (systemd's
//! job for poweroff.target etc. follows and names it).
use std::{path::PathBuf, sync::Arc, time::Duration};

use futures::StreamExt;
use tokio::{sync::mpsc, time::Instant};
use zbus::{Connection, Message};

use crate::{
    bus::{
        self,
        delay_lock::{self, DelayLock, DelayLockHandle, DELAY_CAP},
        logind::{Host, Inhibitor, LOGIND},
    },
    clock::now_pair,
    health::Health,
    signal::{Actor, BusSender, Effect, Kind, ShutdownSignal},
    timespan::secs,
};

pub mod config;
mod forged;
pub(crate) mod preflight;
mod scheduled;
mod streams;

pub use config::{DelayError, DelayOutcome};
pub(crate) use scheduled::scheduled_from_changed;
pub use streams::kind_of;
use streams::{next_other, prepare_arg, sender_actor, signal, subscribe, Streams};

/// A connection and the typed managers on it.
#[derive(Clone)]
struct Link {
    conn: Connection,
    host: Host,
}

impl Link {
    async fn connect(address: Option<&str>) -> zbus::Result<Self> {
        let conn = bus::connect(address).await?;
        let host = Host::new(&conn).await?;
        Ok(Link { conn, host })
    }
}

#[derive(Clone, Debug)]
pub struct LogindConfig {
    /// Bus address; `None` is the system bus.
    pub bus: Option<String>,
    /// The delay graceful work needs; `None` takes what logind allows.
    pub want_delay: Option<Duration>,
    /// Root of logind's configuration ("/" on a node).
    pub logind_root: PathBuf,
    /// Release this long before logind's deadline (capped at a quarter of
    /// the delay).
    pub release_margin: Duration,
    pub reconnect_after: Duration,
    /// systemd < 255 does not announce ScheduledShutdown changes: poll it.
    pub scheduled_poll: Duration,
    /// Act on a PrepareForShutdown from a peer that does not own
    /// `org.freedesktop.login1` (test rigs such as the kubelet's `dbus-send`
    /// e2e). Off: such a signal is reported, audit-only, and changes nothing.
    pub trust_unowned: bool,
}

impl Default for LogindConfig {
    fn default() -> Self {
        LogindConfig {
            bus: None,
            want_delay: None,
            logind_root: PathBuf::from("/"),
            release_margin: Duration::from_secs(1),
            reconnect_after: Duration::from_secs(1),
            scheduled_poll: Duration::from_secs(2),
            trust_unowned: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot reach the system bus: {0}")]
    NoBus(zbus::Error),
    #[error("logind (org.freedesktop.login1) is not on the system bus")]
    NoLogind,
    #[error(transparent)]
    Delay(#[from] DelayError),
    #[error("logind refused a shutdown delay lock: {0}")]
    Lock(zbus::Error),
    #[error("talking to logind: {0}")]
    Bus(#[from] zbus::Error),
}

// ---------------------------------------------------------------------------
// The detector

pub struct LogindDetector {
    cfg: LogindConfig,
    link: Option<Link>,
    /// Subscribed by `start`, for the first session.
    streams: Option<Streams>,
    /// The unique name owning `org.freedesktop.login1`, followed through
    /// NameOwnerChanged: a signal is judged without a round trip.
    owner: Option<String>,
    /// Reports of other peers' PrepareForShutdown, rate-limited.
    forged: forged::Forged,
    lock: DelayLock,
    /// InhibitDelayMaxSec raised as `cfg.want_delay` asks (or nothing asked).
    configured: bool,
    delay_max: Duration,
    /// The last ScheduledShutdown seen: (type, µs since the epoch).
    scheduled: Option<(String, u64)>,
    sessions: u32,
    /// Where a lost bus or lock is reported (the readiness endpoint).
    health: Option<Arc<Health>>,
}

/// What `health` calls this detector's bus connection, and its delay lock.
pub const PART: &str = "logind";

enum Flow {
    /// The receiver of signals is gone.
    Stop,
}

impl LogindDetector {
    /// Connects, raises InhibitDelayMaxSec if the config wants more, and
    /// takes the delay lock.
    pub async fn start(cfg: LogindConfig) -> Result<(Self, DelayLockHandle), StartError> {
        let link = Link::connect(cfg.bus.as_deref())
            .await
            .map_err(StartError::NoBus)?;
        if bus::name_owner(&link.conn, LOGIND).await?.is_none() {
            return Err(StartError::NoLogind);
        }
        // Listening from here on: a shutdown that starts while we set up is
        // in the streams, or in PreparingForShutdown when `run` reads it.
        let streams = subscribe(&link.conn, cfg.bus.as_deref()).await?;
        let owner = bus::name_owner(&link.conn, LOGIND).await?;
        if let Some(want) = cfg.want_delay {
            config::ensure_inhibit_delay(&link.host, &cfg.logind_root, want).await?;
        }
        let delay_max = link.host.current_inhibit_delay().await?.min(DELAY_CAP);
        let lock = delay_lock::take_lock(&link.host)
            .await
            .map_err(StartError::Lock)?;
        let (mut det, handle) = Self::pending(cfg);
        det.link = Some(link);
        det.streams = Some(streams);
        det.owner = owner;
        det.configured = true;
        det.lock.taken(lock);
        det.delay_max = delay_max;
        Ok((det, handle))
    }

    /// A detector that has not reached logind (no bus, no logind, a refused
    /// call at the agent's start): `run` connects, raises the delay and
    /// takes the lock when it can, trying every `reconnect_after`.
    pub fn pending(cfg: LogindConfig) -> (Self, DelayLockHandle) {
        let (lock, handle) = DelayLock::new(cfg.release_margin);
        let det = LogindDetector {
            cfg,
            link: None,
            owner: None,
            streams: None,
            forged: forged::Forged::default(),
            lock,
            configured: false,
            delay_max: Duration::ZERO,
            scheduled: None,
            sessions: 0,
            health: None,
        };
        (det, handle)
    }

    /// logind's InhibitDelayMaxUSec as last read.
    pub fn inhibit_delay_max(&self) -> Duration {
        self.delay_max
    }

    /// Reports a lost bus connection or delay lock to `health` while it lasts.
    pub fn report_to(mut self, health: Arc<Health>) -> Self {
        self.lock.report_to(health.clone());
        self.health = Some(health);
        self
    }

    /// Runs until `tx` is closed, reconnecting (and re-locking) when the bus
    /// goes away.
    pub async fn run(mut self, tx: mpsc::Sender<ShutdownSignal>) -> anyhow::Result<()> {
        loop {
            let err = match self.session(&tx).await {
                Ok(Flow::Stop) => return Ok(()),
                Err(e) => e,
            };
            let why = format!(
                "{err:#}; the graceful path is NOT armed; reconnecting every {:?}",
                self.cfg.reconnect_after
            );
            // `health` logs a loss once, not at every try.
            match &self.health {
                Some(h) => h.lost(PART, &why),
                None => tracing::warn!(%why, "logind: detector lost"),
            }
            self.link = None;
            self.streams = None;
            // The lock and a shutdown under way outlive the bus connection:
            // keep honouring release() and the deadline meanwhile.
            let until = Instant::now() + self.cfg.reconnect_after;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    // Taken again when the bus is back (the session relocks).
                    w = self.lock.wake() => self.lock.apply(w, None::<&Host>).await,
                    _ = tx.closed() => return Ok(()),
                }
            }
        }
    }

    async fn session(&mut self, tx: &mpsc::Sender<ShutdownSignal>) -> anyhow::Result<Flow> {
        let link = match self.link.clone() {
            Some(l) => l,
            None => {
                let l = Link::connect(self.cfg.bus.as_deref()).await?;
                self.link = Some(l.clone());
                l
            }
        };
        let conn = &link;
        let first = self.sessions == 0;
        self.sessions += 1;
        let Streams {
            mut prepare,
            mut changed,
            mut owner_changed,
            mut others,
        } = self.subscribed(conn).await?;
        if let Some(f) = self.catch_up(conn, tx, first).await? {
            return Ok(f);
        }
        if let Some(h) = &self.health {
            h.regained(PART);
        }

        let mut poll = tokio::time::interval(self.cfg.scheduled_poll);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll.tick().await;
        loop {
            tokio::select! {
                biased;
                m = prepare.next() => {
                    let m = m.ok_or_else(|| anyhow::anyhow!("the bus connection closed"))??;
                    if let Some(f) = self.on_prepare(conn, m, tx).await {
                        return Ok(f);
                    }
                }
                m = owner_changed.next() => {
                    let m = m.ok_or_else(|| anyhow::anyhow!("the bus connection closed"))??;
                    self.owner_changed(&m);
                }
                w = self.lock.wake() => self.lock.apply(w, Some(&conn.host)).await,
                m = changed.next() => {
                    let m = m.ok_or_else(|| anyhow::anyhow!("the bus connection closed"))??;
                    let value = scheduled_from_changed(&m);
                    if let Some(f) = self.check_scheduled(conn, tx, value).await {
                        return Ok(f);
                    }
                }
                _ = poll.tick() => {
                    self.forged.summary();
                    if let Some(f) = self.check_scheduled(conn, tx, None).await {
                        return Ok(f);
                    }
                }
                Some(m) = next_other(&mut others) => match m {
                    Ok(m) => {
                        if let Some(f) = self.on_other(conn, m, tx).await {
                            return Ok(f);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "logind: the connection watching other peers' PrepareForShutdown failed: forgeries are no longer reported until the bus reconnects");
                        others = None;
                    }
                },
                _ = tx.closed() => return Ok(Flow::Stop),
            }
        }
    }

    /// The signals subscribed to (before any state is read, so nothing falls
    /// in between), logind's owner known and its delay configured.
    async fn subscribed(&mut self, link: &Link) -> anyhow::Result<Streams> {
        let streams = match self.streams.take() {
            Some(s) => s,
            None => {
                let s = subscribe(&link.conn, self.cfg.bus.as_deref()).await?;
                self.owner = bus::name_owner(&link.conn, LOGIND).await?;
                s
            }
        };
        if self.owner.is_none() {
            anyhow::bail!("{}", StartError::NoLogind);
        }
        if !self.configured {
            if let Some(want) = self.cfg.want_delay {
                config::ensure_inhibit_delay(&link.host, &self.cfg.logind_root, want).await?;
            }
            self.configured = true;
        }
        Ok(streams)
    }

    /// The lock taken and logind's state read: the agent may start, or come
    /// back, in the middle of a shutdown, or after one was called off.
    async fn catch_up(
        &mut self,
        conn: &Link,
        tx: &mpsc::Sender<ShutdownSignal>,
        first: bool,
    ) -> anyhow::Result<Option<Flow>> {
        match conn.host.current_inhibit_delay().await {
            Ok(d) => self.delay_max = d.min(DELAY_CAP),
            Err(e) => tracing::warn!(error = %e, "logind: InhibitDelayMaxUSec not read"),
        }
        if self.lock.wants_lock() && (!first || !self.lock.is_held()) {
            self.lock.take(&conn.host).await;
        }
        let preparing = conn.host.logind.preparing_for_shutdown().await?;
        let by_logind = self.lock.announced_by_logind() == Some(true);
        if preparing && !by_logind {
            let (wall, boot_ns) = now_pair();
            tracing::warn!("logind: a shutdown is already under way");
            let kind = self.kind(conn).await;
            // Its start is unknown: the deadline is at most a full delay away.
            let deadline = self.lock.begin(Instant::now(), wall, self.delay_max, true);
            let s = signal(
                kind,
                Effect::Now,
                Some(deadline),
                wall,
                boot_ns,
                None,
                "PreparingForShutdown",
            );
            if tx.send(s).await.is_err() {
                return Ok(Some(Flow::Stop));
            }
        } else if !preparing && by_logind && !first {
            tracing::warn!("logind: the shutdown was called off while the bus was away");
            if let Some(f) = self
                .cancel(conn, tx, None, None, "PreparingForShutdown")
                .await
            {
                return Ok(Some(f));
            }
        }
        Ok(self.check_scheduled(conn, tx, None).await)
    }

    /// logind's limit as it is now: another drop-in (the kubelet's) may have
    /// raised it since the agent started.
    async fn reread_delay_max(&mut self, conn: &Link) {
        let read = tokio::time::timeout(
            Duration::from_millis(500),
            conn.host.current_inhibit_delay(),
        )
        .await;
        match read {
            Ok(Ok(d)) if d.min(DELAY_CAP) != self.delay_max => {
                tracing::info!(from = %secs(self.delay_max), to = %secs(d), "logind: InhibitDelayMaxUSec changed since it was read");
                self.delay_max = d.min(DELAY_CAP);
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                using = %secs(self.delay_max),
                "logind: InhibitDelayMaxUSec not re-read"
            ),
            Err(_) => tracing::warn!(
                using = %secs(self.delay_max),
                "logind: re-reading InhibitDelayMaxUSec timed out"
            ),
        }
    }

    /// logind restarted (a new unique name) or left the bus.
    fn owner_changed(&mut self, m: &Message) {
        // Only the bus daemon speaks for names; a peer can send this signal
        // straight to us under its own name.
        if m.header().sender().map(zbus::names::UniqueName::as_str) != Some("org.freedesktop.DBus")
        {
            return;
        }
        if let Ok((name, _, new)) = m.body().deserialize::<(String, String, String)>() {
            if name == LOGIND {
                tracing::info!(owner = new, "logind: org.freedesktop.login1 changed hands");
                self.owner = (!new.is_empty()).then_some(new);
            }
        }
    }

    async fn on_prepare(
        &mut self,
        conn: &Link,
        m: Message,
        tx: &mpsc::Sender<ShutdownSignal>,
    ) -> Option<Flow> {
        let (wall, boot_ns) = now_pair();
        let received = Instant::now();
        let sender = m
            .header()
            .sender()
            .map(std::string::ToString::to_string)
            .unwrap_or_default();
        let start = prepare_arg(&m, &sender)?;
        let from_logind = self.is_loginds(&m);
        if !from_logind && !self.cfg.trust_unowned {
            self.report_forged(&conn.conn, &sender, start, (wall, boot_ns), tx)
                .await;
            return None;
        }
        let actor = sender_actor(&conn.conn, &sender).await;
        let by = Some(BusSender {
            unique: sender.clone(),
            owns_name: from_logind,
        });
        if !from_logind {
            tracing::warn!(
                sender,
                start,
                "logind: PrepareForShutdown from a peer that does not own org.freedesktop.login1, \
                 acted on (--trust-unowned-bus-signals): logind may not be shutting down"
            );
        }
        let logind_episode = self.lock.announced_by_logind();
        if !start {
            if logind_episode == Some(true) && !from_logind {
                tracing::warn!(
                    sender,
                    "logind: ignored: only logind can call off its own shutdown"
                );
                return None;
            }
            tracing::info!(
                sender,
                from_logind,
                "logind: PrepareForShutdown(false): shutdown cancelled"
            );
            return self.cancel(conn, tx, actor, by, "PrepareForShutdown").await;
        }
        // logind sends it once per shutdown: a second one is the same
        // shutdown (read from PreparingForShutdown while subscribing), unless
        // logind's own follows another peer's.
        if logind_episode.is_some_and(|l| l || !from_logind) {
            tracing::info!(
                sender,
                "logind: PrepareForShutdown(true) during a shutdown already reported"
            );
            return None;
        }
        let kind = if from_logind {
            self.kind(conn).await
        } else {
            Kind::Unknown
        };
        self.reread_delay_max(conn).await;
        let deadline = self.lock.begin(received, wall, self.delay_max, from_logind);
        tracing::info!(
            sender,
            from_logind,
            lock = self.lock.is_held(),
            deadline = %humantime::format_rfc3339_millis(deadline),
            "logind: PrepareForShutdown(true)"
        );
        let mut s = signal(
            kind,
            Effect::Now,
            Some(deadline),
            wall,
            boot_ns,
            actor,
            "PrepareForShutdown",
        );
        s.sender = by;
        tx.send(s).await.is_err().then_some(Flow::Stop)
    }

    /// A shutdown is called off: take a new lock first, then drop the old.
    async fn cancel(
        &mut self,
        conn: &Link,
        tx: &mpsc::Sender<ShutdownSignal>,
        actor: Option<Actor>,
        by: Option<BusSender>,
        member: &str,
    ) -> Option<Flow> {
        let (wall, boot_ns) = now_pair();
        if self.lock.end() || !self.lock.is_held() {
            self.lock.take(&conn.host).await;
        }
        let mut s = signal(
            Kind::Unknown,
            Effect::Cancel,
            None,
            wall,
            boot_ns,
            actor,
            member,
        );
        s.sender = by;
        tx.send(s).await.is_err().then_some(Flow::Stop)
    }

    /// logind's kind of the shutdown under way: its metadata (systemd ≥ 255),
    /// else the type of a scheduled shutdown.
    async fn kind(&self, conn: &Link) -> Kind {
        let meta = conn
            .host
            .logind
            .preparing_for_shutdown_with_metadata()
            .await
            .ok();
        if let Some(t) = meta
            .and_then(|mut m| m.remove("type"))
            .and_then(|v| String::try_from(v).ok())
        {
            return kind_of(&t);
        }
        match conn.host.logind.scheduled_shutdown().await {
            Ok((t, _)) => kind_of(&t),
            Err(_) => Kind::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logind_action_names_map_to_kinds() {
        assert_eq!(kind_of("poweroff"), Kind::Poweroff);
        assert_eq!(kind_of("dry-reboot"), Kind::Reboot);
        assert_eq!(kind_of("soft-reboot"), Kind::SoftReboot);
        assert_eq!(kind_of("suspend"), Kind::Unknown);
    }
}
