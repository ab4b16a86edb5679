//! logind over D-Bus: a shutdown delay lock, `PrepareForShutdown`, scheduled
//! shutdowns (`shutdown +N`), and the InhibitDelayMaxSec drop-in.
//!
//! The detector owns the lock's fd. The rest of the agent holds a
//! [`LogindHandle`] and calls `release()` once its graceful work is done;
//! failing that, the detector releases by itself `release_margin` before
//! logind's deadline (PrepareForShutdown + InhibitDelayMaxUSec).
//!
//! `PrepareForShutdown` does not say which kind of shutdown starts: the kind
//! comes from logind's `PreparingForShutdownWithMetadata` (systemd ≥ 255),
//! else from `ScheduledShutdown` when it names one, else `unknown` (systemd's
//! job for poweroff.target etc. follows and names it).
use std::{
    fs,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use zbus::{message::Type as MsgType, Connection, MatchRule, Message, MessageStream};

use crate::{
    bus::{
        self,
        logind::{Host, Inhibitor, LOGIND, MANAGER, PATH},
    },
    detect::clock::now_pair,
    health::Health,
    signal::{Actor, BusSender, Detail, Effect, Kind, Scope, ShutdownSignal, Source},
    timespan::secs,
};

pub mod config;
pub(crate) mod lock;
pub(crate) mod preflight;

pub use config::{DelayError, DelayOutcome};
pub use lock::LogindHandle;

/// No shutdown delay is taken as longer than this (logind allows
/// "infinity"): the deadline arithmetic stays in range.
const DELAY_CAP: Duration = Duration::from_secs(24 * 3600);

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

/// A shutdown announced and not called off.
struct Announced {
    /// When the lock goes if graceful work has not released it.
    release_at: Instant,
    released: bool,
    /// Announced by logind itself, not by another peer (which anyone on
    /// the bus can be: the kubelet's e2e tests are).
    from_logind: bool,
}

pub struct LogindDetector {
    cfg: LogindConfig,
    link: Option<Link>,
    /// Subscribed by `start`, for the first session.
    streams: Option<Streams>,
    /// The unique name owning `org.freedesktop.login1`, followed through
    /// NameOwnerChanged: a signal is judged without a round trip.
    owner: Option<String>,
    /// Reports of other peers' PrepareForShutdown, rate-limited.
    forged: Forged,
    lock: Option<OwnedFd>,
    /// InhibitDelayMaxSec raised as `cfg.want_delay` asks (or nothing asked).
    configured: bool,
    delay_max: Duration,
    episode: Option<Announced>,
    /// The last ScheduledShutdown seen: (type, µs since the epoch).
    scheduled: Option<(String, u64)>,
    sessions: u32,
    release_rx: mpsc::UnboundedReceiver<()>,
    relock_rx: mpsc::UnboundedReceiver<()>,
    held: watch::Sender<bool>,
    /// Where a lost bus or lock is reported (the readiness endpoint).
    health: Option<Arc<Health>>,
}

/// What `health` calls this detector's bus connection, and its delay lock.
pub const PART: &str = "logind";
const LOCK_PART: &str = "logind delay lock";

enum Flow {
    /// The receiver of signals is gone.
    Stop,
}

impl LogindDetector {
    /// Connects, raises InhibitDelayMaxSec if the config wants more, and
    /// takes the delay lock.
    pub async fn start(cfg: LogindConfig) -> Result<(Self, LogindHandle), StartError> {
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
        let lock = lock::take_lock(&link.host)
            .await
            .map_err(StartError::Lock)?;
        let (mut det, handle) = Self::pending(cfg);
        det.link = Some(link);
        det.streams = Some(streams);
        det.owner = owner;
        det.configured = true;
        det.lock = Some(lock);
        det.delay_max = delay_max;
        det.held.send_replace(true);
        Ok((det, handle))
    }

    /// A detector that has not reached logind (no bus, no logind, a refused
    /// call at the agent's start): `run` connects, raises the delay and
    /// takes the lock when it can, trying every `reconnect_after`.
    pub fn pending(cfg: LogindConfig) -> (Self, LogindHandle) {
        let (handle, release_rx, relock_rx, held) = LogindHandle::new();
        held.send_replace(false);
        let det = LogindDetector {
            cfg,
            link: None,
            owner: None,
            streams: None,
            forged: Forged::default(),
            lock: None,
            configured: false,
            delay_max: Duration::ZERO,
            episode: None,
            scheduled: None,
            sessions: 0,
            release_rx,
            relock_rx,
            held,
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
                let due = self.release_due();
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    Some(()) = self.release_rx.recv() => self.release("graceful work done"),
                    // Taken again when the bus is back (the session relocks).
                    Some(()) = self.relock_rx.recv() => self.episode = None,
                    _ = sleep_until_opt(due) => self.release("deadline near"),
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
            let due = self.release_due();
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
                Some(()) = self.release_rx.recv() => self.release_and_relock(conn, "graceful work done").await,
                Some(()) = self.relock_rx.recv() => self.relock_after_no_shutdown(conn).await,
                _ = sleep_until_opt(due) => self.release_and_relock(conn, "deadline near").await,
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
        if self.wants_lock() && (!first || self.lock.is_none()) {
            self.relock(conn).await;
        }
        let preparing = conn.host.logind.preparing_for_shutdown().await?;
        if preparing && !self.episode.as_ref().is_some_and(|e| e.from_logind) {
            let (wall, boot_ns) = now_pair();
            tracing::warn!("logind: a shutdown is already under way");
            let kind = self.kind(conn).await;
            // Its start is unknown: the deadline is at most a full delay away.
            let deadline = self.begin(Instant::now(), wall, self.delay_max, true);
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
        } else if !preparing && self.episode.as_ref().is_some_and(|e| e.from_logind) && !first {
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

    async fn release_and_relock(&mut self, conn: &Link, why: &str) {
        self.release(why);
        self.relock_unless_logind_waits(conn).await;
    }

    async fn relock_after_no_shutdown(&mut self, conn: &Link) {
        if self.episode.take().is_some() || self.lock.is_none() {
            tracing::info!("logind: the shutdown did not come: delay lock taken again");
            self.relock(conn).await;
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

    /// A PrepareForShutdown on the connection watching every peer: logind's
    /// own arrive on the main one (and are skipped here); the others are
    /// forgeries, reported (or, with --trust-unowned-bus-signals, acted on).
    async fn on_other(
        &mut self,
        conn: &Link,
        m: Message,
        tx: &mpsc::Sender<ShutdownSignal>,
    ) -> Option<Flow> {
        if self.is_loginds(&m) {
            return None;
        }
        self.on_prepare(conn, m, tx).await
    }

    /// Only the current owner's broadcast speaks for logind (one sent
    /// straight to this connection is another peer's, whoever it names).
    fn is_loginds(&self, m: &Message) -> bool {
        let h = m.header();
        h.destination().is_none()
            && h.sender()
                .map(zbus::names::UniqueName::as_str)
                .is_some_and(|s| self.owner.as_deref() == Some(s))
    }

    /// Another peer's PrepareForShutdown: audit-only, never waited for.
    /// Within `Forged`'s rate it is reported with the peer's pid and uid;
    /// past it, counted (and summed up in the log).
    async fn report_forged(
        &mut self,
        conn: &Connection,
        sender: &str,
        start: bool,
        (wall, boot_ns): (SystemTime, u64),
        tx: &mpsc::Sender<ShutdownSignal>,
    ) {
        if !self.forged.take() {
            return;
        }
        tracing::warn!(
            sender,
            logind = self.owner.as_deref().unwrap_or("(none)"),
            start,
            "logind: PrepareForShutdown from a peer that does not own org.freedesktop.login1: \
             reported, audit-only (--trust-unowned-bus-signals acts on it)"
        );
        let actor = tokio::time::timeout(Duration::from_millis(100), sender_actor(conn, sender))
            .await
            .ok()
            .flatten();
        let effect = if start { Effect::Now } else { Effect::Cancel };
        let mut s = signal(
            Kind::Unknown,
            effect,
            None,
            wall,
            boot_ns,
            actor,
            "PrepareForShutdown",
        );
        s.sender = Some(BusSender {
            unique: sender.to_string(),
            owns_name: false,
        });
        // Lossy: a flood of reports must not stand before logind's signal.
        if tx.try_send(s).is_err() {
            self.forged.dropped += 1;
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
        let logind_episode = self.episode.as_ref().map(|e| e.from_logind);
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
        let deadline = self.begin(received, wall, self.delay_max, from_logind);
        tracing::info!(
            sender,
            from_logind,
            lock = self.lock.is_some(),
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
        let was = self.episode.take();
        if was.is_some() || self.lock.is_none() {
            self.relock(conn).await;
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

    /// A shutdown starts: logind goes ahead `left` after `from` whatever we do.
    fn begin(
        &mut self,
        from: Instant,
        wall: SystemTime,
        left: Duration,
        from_logind: bool,
    ) -> SystemTime {
        let left = left.min(DELAY_CAP);
        let margin = self.cfg.release_margin.min(left / 4);
        let deadline = wall + left;
        self.episode = Some(Announced {
            release_at: from + left.saturating_sub(margin),
            released: false,
            from_logind,
        });
        // Releases asked for before this shutdown belong to an earlier one.
        while self.release_rx.try_recv().is_ok() {}
        deadline
    }

    fn release_due(&self) -> Option<Instant> {
        match (&self.episode, &self.lock) {
            (Some(ep), Some(_)) if !ep.released => Some(ep.release_at),
            _ => None,
        }
    }

    fn release(&mut self, why: &str) {
        let Some(ep) = self.episode.as_mut().filter(|e| !e.released) else {
            tracing::debug!("logind: release asked outside a shutdown: the lock stays");
            return;
        };
        ep.released = true;
        if self.lock.take().is_some() {
            tracing::info!("logind: delay lock released ({why})");
            self.held.send_replace(false);
        }
    }

    /// Outside a shutdown logind itself announced, the node keeps a lock.
    fn wants_lock(&self) -> bool {
        self.episode.as_ref().is_none_or(|e| !e.from_logind)
    }

    /// After a release for another peer's PrepareForShutdown, logind is not
    /// waiting for us: lock again, so a forged signal cannot leave the node
    /// unprotected.
    async fn relock_unless_logind_waits(&mut self, conn: &Link) {
        if self.lock.is_none() && self.wants_lock() {
            tracing::info!(
                "logind: the shutdown was not announced by logind: delay lock taken again"
            );
            self.relock(conn).await;
        }
    }

    /// Takes a new lock, then drops the old one (never a moment without).
    async fn relock(&mut self, conn: &Link) {
        match lock::take_lock(&conn.host).await {
            Ok(fd) => {
                let old = self.lock.replace(fd);
                drop(old);
                self.held.send_replace(true);
                if let Some(h) = &self.health {
                    h.regained(LOCK_PART);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "logind: cannot take a delay lock");
                if let Some(h) = &self.health {
                    h.lost(LOCK_PART, &format!("cannot take a delay lock: {e}"));
                }
            }
        }
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

    /// Follows ScheduledShutdown: `value` from a PropertiesChanged, else read.
    async fn check_scheduled(
        &mut self,
        conn: &Link,
        tx: &mpsc::Sender<ShutdownSignal>,
        value: Option<(String, u64)>,
    ) -> Option<Flow> {
        let value = match value {
            Some(v) => v,
            None => match conn.host.logind.scheduled_shutdown().await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(error = %e, "logind: reading ScheduledShutdown");
                    return None;
                }
            },
        };
        // During a shutdown logind reports the delayed action here: not news.
        if self.episode.is_some() {
            self.scheduled = None;
            return None;
        }
        let now = (!value.0.is_empty() && value.1 > 0).then_some(value);
        if now == self.scheduled {
            return None;
        }
        let before = std::mem::replace(&mut self.scheduled, now.clone());
        let (wall, boot_ns) = now_pair();
        let s = match (now, before) {
            (Some((t, usec)), _) => {
                let at = bus::wall_usec(usec);
                tracing::info!(r#type = t, at = %humantime::format_rfc3339_seconds(at), "logind: shutdown scheduled");
                let effect = if t.starts_with("dry-") {
                    Effect::None {
                        why: format!("{t}: a dry run (shutdown -k) only warns"),
                    }
                } else {
                    Effect::Scheduled {
                        at: Some(at),
                        spec: t.clone(),
                    }
                };
                signal(
                    kind_of(&t),
                    effect,
                    None,
                    wall,
                    boot_ns,
                    None,
                    "ScheduledShutdown",
                )
            }
            (None, Some((t, usec))) => {
                if SystemTime::now() + Duration::from_secs(1) >= bus::wall_usec(usec) {
                    // Cleared at its time: it is being carried out, not cancelled.
                    return None;
                }
                tracing::info!(r#type = t, "logind: scheduled shutdown cancelled");
                signal(
                    kind_of(&t),
                    Effect::Cancel,
                    None,
                    wall,
                    boot_ns,
                    None,
                    "ScheduledShutdown",
                )
            }
            (None, None) => return None,
        };
        tx.send(s).await.is_err().then_some(Flow::Stop)
    }
}

/// PrepareForShutdown from any sender, as the kubelet accepts it (its e2e
/// tests fake it), and logind's PropertiesChanged.
/// The detector's subscriptions.
struct Streams {
    /// PrepareForShutdown from the owner of org.freedesktop.login1 (the bus
    /// daemon filters broadcasts by sender; one sent straight to this
    /// connection still arrives, and is judged by the owner).
    prepare: MessageStream,
    /// logind's ScheduledShutdown changes.
    changed: MessageStream,
    /// NameOwnerChanged for org.freedesktop.login1.
    owner_changed: MessageStream,
    /// PrepareForShutdown from every peer, on a connection of its own with
    /// a short queue: a flood of forgeries fills only that one. `None` when
    /// it could not be opened (forgeries then go unreported).
    others: Option<MessageStream>,
}

/// Other peers' PrepareForShutdown reported per second (burst
/// `FORGED_BURST`); the rest are counted.
const FORGED_PER_SEC: f64 = 5.0;
const FORGED_BURST: f64 = 20.0;

/// The forgery reports' token bucket and what it held back.
struct Forged {
    tokens: f64,
    at: Instant,
    /// Held back (over the rate, or the signal channel was full) since the
    /// last summary.
    dropped: u64,
}

impl Default for Forged {
    fn default() -> Self {
        Forged {
            tokens: FORGED_BURST,
            at: Instant::now(),
            dropped: 0,
        }
    }
}

impl Forged {
    /// Whether one more may be reported now.
    fn take(&mut self) -> bool {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * FORGED_PER_SEC)
            .min(FORGED_BURST);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            self.dropped += 1;
            false
        }
    }

    /// Logs what was held back since the last call.
    fn summary(&mut self) {
        if self.dropped > 0 {
            tracing::warn!(
                held_back = self.dropped,
                "logind: forged PrepareForShutdown signals not reported one by one (a flood from another peer)"
            );
            self.dropped = 0;
        }
    }
}

async fn next_other(others: &mut Option<MessageStream>) -> Option<zbus::Result<Message>> {
    match others {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn subscribe(conn: &Connection, address: Option<&str>) -> zbus::Result<Streams> {
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

/// ScheduledShutdown from a PropertiesChanged signal, when it is there.
pub(crate) fn scheduled_from_changed(m: &Message) -> Option<(String, u64)> {
    type Changed = (
        String,
        std::collections::HashMap<String, zbus::OwnedVariant>,
        Vec<String>,
    );
    let (_, mut changed, _): Changed = m.body().deserialize().ok()?;
    <(String, u64)>::try_from(changed.remove("ScheduledShutdown")?).ok()
}

/// The process behind a bus peer, when it is still connected.
async fn sender_actor(conn: &Connection, sender: &str) -> Option<Actor> {
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

fn signal(
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

async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// PrepareForShutdown's one boolean; a malformed signal is logged and
/// ignored.
fn prepare_arg(m: &Message, sender: &str) -> Option<bool> {
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

    /// logind allows "infinity": the deadline arithmetic stays in range.
    #[tokio::test]
    async fn an_infinite_delay_limit_is_capped_not_overflowed() {
        let (mut d, handle) = LogindDetector::pending(LogindConfig::default());
        d.delay_max = Duration::MAX;
        drop(handle);
        let wall = SystemTime::now();
        let deadline = d.begin(Instant::now(), wall, Duration::MAX, true);
        assert_eq!(deadline, wall + DELAY_CAP);
    }
}
