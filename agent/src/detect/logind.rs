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
    collections::HashMap,
    fmt, fs,
    io::Write,
    os::{fd::OwnedFd, unix::fs::PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use zbus::{
    message::Type as MsgType, wire::OwnedVariant, Connection, MatchRule, Message, MessageStream,
};

use super::{
    dbus::{self, LOGIND, LOGIND_MANAGER, LOGIND_PATH},
    ebpf::now_pair,
};
use crate::http::Health;
use crate::signal::{Actor, BusSender, Detail, Effect, Kind, Scope, ShutdownSignal, Source};

/// No shutdown delay is taken as longer than this (logind allows
/// "infinity"): the deadline arithmetic stays in range.
const DELAY_CAP: Duration = Duration::from_secs(24 * 3600);

/// The drop-in written under `<root>/etc/systemd/logind.conf.d/`.
pub const DROPIN_NAME: &str = "99-lastgasp.conf";
const WHO: &str = "lastgasp";
const WHY: &str = "lastgasp needs time to tell the cluster and drain the node";
/// logind's default InhibitDelayMaxSec.
const LOGIND_DEFAULT_DELAY: Duration = Duration::from_secs(5);

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
// logind's configuration files and InhibitDelayMaxSec

/// One assignment of InhibitDelayMaxSec in a file logind reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub file: PathBuf,
    pub value: String,
    /// `None`: unparsable (logind ignores it).
    pub delay: Option<Duration>,
}

pub fn dropin_path(root: &Path) -> PathBuf {
    root.join("etc/systemd/logind.conf.d").join(DROPIN_NAME)
}

/// The files logind reads, in the order it reads them (later wins): the
/// main file (the first of /etc, /run, /usr/local/lib, /usr/lib), then every
/// `logind.conf.d/*.conf` sorted by file name across those directories, a
/// name in an earlier directory masking the same name in later ones.
pub fn conf_files(root: &Path) -> Vec<PathBuf> {
    const DIRS: [&str; 4] = [
        "etc/systemd",
        "run/systemd",
        "usr/local/lib/systemd",
        "usr/lib/systemd",
    ];
    let mut files: Vec<PathBuf> = DIRS
        .iter()
        .map(|d| root.join(d).join("logind.conf"))
        .find(|p| p.is_file())
        .into_iter()
        .collect();
    let mut dropins: std::collections::BTreeMap<String, PathBuf> = Default::default();
    for d in DIRS {
        let Ok(entries) = fs::read_dir(root.join(d).join("logind.conf.d")) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".conf") {
                dropins.entry(name).or_insert_with(|| e.path());
            }
        }
    }
    files.extend(dropins.into_values());
    files
}

/// Every InhibitDelayMaxSec assignment logind would read, in order: the last
/// one is in force.
pub fn inhibit_delay_settings(root: &Path) -> Vec<Setting> {
    let mut out = Vec::new();
    for file in conf_files(root) {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        let mut in_login = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                in_login = line == "[Login]";
            } else if in_login {
                if let Some((k, v)) = line.split_once('=') {
                    if k.trim() == "InhibitDelayMaxSec" {
                        let value = v.trim().to_string();
                        // An empty assignment resets to the default.
                        let delay = if value.is_empty() {
                            Some(LOGIND_DEFAULT_DELAY)
                        } else {
                            parse_timespan(&value)
                        };
                        out.push(Setting {
                            file: file.clone(),
                            value,
                            delay,
                        });
                    }
                }
            }
        }
    }
    out
}

/// systemd's time span syntax: "30", "30s", "1min 30s", "500ms", "infinity".
pub fn parse_timespan(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "infinity" {
        return Some(Duration::MAX);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    let mut any = false;
    while !rest.is_empty() {
        rest = rest.trim_start();
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..num_end].parse().ok()?;
        rest = rest[num_end..].trim_start();
        let unit_end = rest
            .find(|c: char| !c.is_ascii_alphabetic() && c != 'µ')
            .unwrap_or(rest.len());
        let secs = match &rest[..unit_end] {
            "" | "s" | "sec" | "second" | "seconds" => 1.0,
            "us" | "usec" | "µs" => 1e-6,
            "ms" | "msec" => 1e-3,
            "m" | "min" | "minute" | "minutes" => 60.0,
            "h" | "hr" | "hour" | "hours" => 3600.0,
            "d" | "day" | "days" => 86400.0,
            "w" | "week" | "weeks" => 604800.0,
            _ => return None,
        };
        rest = &rest[unit_end..];
        total += Duration::from_secs_f64(n * secs);
        any = true;
    }
    any.then_some(total)
}

#[derive(Debug)]
pub enum DelayError {
    /// After the drop-in and a reload, logind still allows less.
    TooLow {
        have: Duration,
        want: Duration,
        /// The assignment in force (the last one logind reads).
        winner: Option<Setting>,
        ours: PathBuf,
        reload: Option<String>,
    },
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    Bus(zbus::Error),
}

impl std::error::Error for DelayError {}

impl fmt::Display for DelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DelayError::TooLow {
                have,
                want,
                winner,
                ours,
                reload,
            } => {
                write!(
                    f,
                    "logind allows a shutdown delay of {} (InhibitDelayMaxUSec) but lastgasp needs {}: ",
                    secs(*have),
                    secs(*want)
                )?;
                match winner {
                    Some(w) if w.file != *ours => write!(
                        f,
                        "{} sets InhibitDelayMaxSec={} and is read after {}, so it wins; raise it there or remove it",
                        w.file.display(),
                        w.value,
                        ours.display()
                    ),
                    Some(w) => write!(
                        f,
                        "{} (InhibitDelayMaxSec={}) is the file in force, but logind has not applied it after a reload{}",
                        w.file.display(),
                        w.value,
                        reload.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
                    ),
                    None => write!(f, "no file sets InhibitDelayMaxSec, yet {} was written", ours.display()),
                }
            }
            DelayError::Write { path, error } => {
                write!(f, "writing the logind drop-in {}: {error}", path.display())
            }
            DelayError::Bus(e) => write!(f, "reading logind's InhibitDelayMaxUSec: {e}"),
        }
    }
}

pub fn secs(d: Duration) -> String {
    if d == Duration::MAX {
        "infinity".into()
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DelayOutcome {
    /// logind already allows at least what is needed.
    Enough(Duration),
    /// The drop-in was written and logind reloaded.
    Raised { from: Duration, to: Duration },
}

pub async fn inhibit_delay_max(conn: &Connection) -> zbus::Result<Duration> {
    dbus::logind_property::<u64>(conn, "InhibitDelayMaxUSec")
        .await
        .map(Duration::from_micros)
}

/// Makes logind allow at least `want`: writes the drop-in, reloads logind
/// (SIGHUP through systemd's KillUnit, as the kubelet does) and re-reads the
/// value with backoff (100 ms doubling, 5 tries). Never lowers it.
pub async fn ensure_inhibit_delay(
    conn: &Connection,
    root: &Path,
    want: Duration,
) -> Result<DelayOutcome, DelayError> {
    let have = inhibit_delay_max(conn).await.map_err(DelayError::Bus)?;
    if have >= want {
        return Ok(DelayOutcome::Enough(have));
    }
    let path = dropin_path(root);
    write_dropin(&path, want).map_err(|error| DelayError::Write {
        path: path.clone(),
        error,
    })?;
    tracing::info!(file = %path.display(), from = %secs(have), to = %secs(want), "logind: raising InhibitDelayMaxSec");
    let reload = conn
        .call_method(
            Some(dbus::SYSTEMD),
            dbus::SYSTEMD_PATH,
            Some(dbus::SYSTEMD_MANAGER),
            "KillUnit",
            &("systemd-logind.service", "all", libc::SIGHUP),
        )
        .await
        .err()
        .map(|e| format!("KillUnit systemd-logind.service SIGHUP failed: {e}"));
    let mut now = have;
    let mut wait = Duration::from_millis(100);
    for _ in 0..5 {
        tokio::time::sleep(wait).await;
        wait *= 2;
        now = inhibit_delay_max(conn).await.map_err(DelayError::Bus)?;
        if now >= want {
            return Ok(DelayOutcome::Raised {
                from: have,
                to: now,
            });
        }
    }
    Err(DelayError::TooLow {
        have: now,
        want,
        winner: inhibit_delay_settings(root).pop(),
        ours: path,
        reload,
    })
}

pub fn dropin_text(want: Duration) -> String {
    // Whole seconds, rounded up: the delay must not come out shorter.
    let s = want.as_secs() + u64::from(want.subsec_nanos() > 0);
    format!("# Written by lastgasp: the time its graceful node shutdown needs.\n[Login]\nInhibitDelayMaxSec={s}\n")
}

fn write_dropin(path: &Path, want: Duration) -> std::io::Result<()> {
    let dir = path.parent().expect("drop-in has a directory");
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))?;
    let tmp = path.with_extension("conf.tmp");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(dropin_text(want).as_bytes())?;
    f.set_permissions(fs::Permissions::from_mode(0o644))?;
    f.sync_all()?;
    fs::rename(&tmp, path)
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

/// Takes a `shutdown` delay lock; the fd is the lock.
pub async fn take_lock(conn: &Connection) -> zbus::Result<OwnedFd> {
    let reply = conn
        .call_method(
            Some(LOGIND),
            LOGIND_PATH,
            Some(LOGIND_MANAGER),
            "Inhibit",
            &("shutdown", WHO, WHY, "delay"),
        )
        .await?;
    let fd: zbus::OwnedFd = reply.body().deserialize()?;
    // `fd` is a dup: the message's own copy closes with `reply`.
    Ok(fd.into())
}

/// The agent's side of the delay lock.
#[derive(Clone, Debug)]
pub struct LogindHandle {
    release: mpsc::UnboundedSender<()>,
    relock: mpsc::UnboundedSender<()>,
    held: watch::Receiver<bool>,
}

impl LogindHandle {
    /// Graceful work is done: close the delay lock so the shutdown goes on.
    /// Outside a shutdown this does nothing (the lock stays, for the next one).
    pub fn release(&self) {
        let _ = self.release.send(());
    }

    /// The shutdown did not come (the agent abandoned its episode): forget
    /// it and hold a delay lock again, for the next one.
    pub fn relock(&self) {
        let _ = self.relock.send(());
    }

    /// Whether the agent holds a delay lock right now.
    pub fn lock_held(&self) -> bool {
        *self.held.borrow()
    }

    /// Follows `lock_held`.
    pub fn watch_lock(&self) -> watch::Receiver<bool> {
        self.held.clone()
    }
}

/// A shutdown announced and not called off.
struct Episode {
    /// When the lock goes if graceful work has not released it.
    release_at: Instant,
    released: bool,
    /// Announced by logind itself, not by another peer (which anyone on
    /// the bus can be: the kubelet's e2e tests are).
    from_logind: bool,
}

pub struct LogindDetector {
    cfg: LogindConfig,
    conn: Option<Connection>,
    /// Subscribed by `start`, for the first session.
    streams: Option<(MessageStream, MessageStream)>,
    lock: Option<OwnedFd>,
    delay_max: Duration,
    episode: Option<Episode>,
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
        let conn = dbus::connect(cfg.bus.as_deref())
            .await
            .map_err(StartError::NoBus)?;
        if dbus::name_owner(&conn, LOGIND).await?.is_none() {
            return Err(StartError::NoLogind);
        }
        // Listening from here on: a shutdown that starts while we set up is
        // in the streams, or in PreparingForShutdown when `run` reads it.
        let streams = subscribe(&conn).await?;
        if let Some(want) = cfg.want_delay {
            ensure_inhibit_delay(&conn, &cfg.logind_root, want).await?;
        }
        let delay_max = inhibit_delay_max(&conn).await?.min(DELAY_CAP);
        let lock = take_lock(&conn).await.map_err(StartError::Lock)?;
        let (release, release_rx) = mpsc::unbounded_channel();
        let (relock, relock_rx) = mpsc::unbounded_channel();
        let (held, held_rx) = watch::channel(true);
        let det = LogindDetector {
            cfg,
            conn: Some(conn),
            streams: Some(streams),
            lock: Some(lock),
            delay_max,
            episode: None,
            scheduled: None,
            sessions: 0,
            release_rx,
            relock_rx,
            held,
            health: None,
        };
        let handle = LogindHandle {
            release,
            relock,
            held: held_rx,
        };
        Ok((det, handle))
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
            let why = format!("{err:#}; reconnecting every {:?}", self.cfg.reconnect_after);
            if let Some(h) = &self.health {
                h.lost(PART, &why);
            }
            tracing::warn!("logind: {why}");
            self.conn = None;
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
        let conn = match self.conn.clone() {
            Some(c) => c,
            None => {
                let c = dbus::connect(self.cfg.bus.as_deref()).await?;
                self.conn = Some(c.clone());
                c
            }
        };
        let first = self.sessions == 0;
        self.sessions += 1;
        // Subscribed before reading state, so nothing falls in between.
        let (mut prepare, mut changed) = match self.streams.take() {
            Some(s) => s,
            None => subscribe(&conn).await?,
        };

        match inhibit_delay_max(&conn).await {
            Ok(d) => self.delay_max = d.min(DELAY_CAP),
            Err(e) => tracing::warn!("logind: reading InhibitDelayMaxUSec: {e}"),
        }
        if self.wants_lock() && (!first || self.lock.is_none()) {
            self.relock(&conn).await;
        }
        // The agent may start, or come back, in the middle of a shutdown.
        let preparing: bool = dbus::logind_property(&conn, "PreparingForShutdown").await?;
        if preparing && !self.episode.as_ref().is_some_and(|e| e.from_logind) {
            let (wall, boot_ns) = now_pair();
            tracing::warn!("logind: a shutdown is already under way");
            let kind = self.kind(&conn).await;
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
                return Ok(Flow::Stop);
            }
        } else if !preparing && self.episode.as_ref().is_some_and(|e| e.from_logind) && !first {
            tracing::warn!("logind: the shutdown was called off while the bus was away");
            if let Some(f) = self
                .cancel(&conn, tx, None, None, "PreparingForShutdown")
                .await
            {
                return Ok(f);
            }
        }
        if let Some(f) = self.check_scheduled(&conn, tx, None).await {
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
                    if let Some(f) = self.on_prepare(&conn, m, tx).await {
                        return Ok(f);
                    }
                }
                Some(()) = self.release_rx.recv() => {
                    self.release("graceful work done");
                    self.relock_unless_logind_waits(&conn).await;
                }
                Some(()) = self.relock_rx.recv() => {
                    if self.episode.take().is_some() || self.lock.is_none() {
                        tracing::info!("logind: the shutdown did not come: delay lock taken again");
                        self.relock(&conn).await;
                    }
                }
                _ = sleep_until_opt(due) => {
                    self.release("deadline near");
                    self.relock_unless_logind_waits(&conn).await;
                }
                m = changed.next() => {
                    let m = m.ok_or_else(|| anyhow::anyhow!("the bus connection closed"))??;
                    let value = scheduled_from_changed(&m);
                    if let Some(f) = self.check_scheduled(&conn, tx, value).await {
                        return Ok(f);
                    }
                }
                _ = poll.tick() => {
                    if let Some(f) = self.check_scheduled(&conn, tx, None).await {
                        return Ok(f);
                    }
                }
                _ = tx.closed() => return Ok(Flow::Stop),
            }
        }
    }

    async fn on_prepare(
        &mut self,
        conn: &Connection,
        m: Message,
        tx: &mpsc::Sender<ShutdownSignal>,
    ) -> Option<Flow> {
        let (wall, boot_ns) = now_pair();
        let received = Instant::now();
        let sender = m
            .header()
            .sender()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let start: bool = match m.body().deserialize() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(
                    sender,
                    signature = %m.body().signature(),
                    "logind: malformed PrepareForShutdown ignored (it carries one boolean): {e}"
                );
                return None;
            }
        };
        // Asked at once, for this very signal: a restarted logind has a new
        // unique name, and only the current owner speaks for logind.
        let (owner, actor) =
            tokio::join!(dbus::name_owner(conn, LOGIND), sender_actor(conn, &sender));
        let owner = owner.ok().flatten();
        let from_logind = owner.as_deref() == Some(sender.as_str());
        let by = Some(BusSender {
            unique: sender.clone(),
            owns_name: from_logind,
        });
        if !from_logind && !self.cfg.trust_unowned {
            tracing::warn!(
                sender,
                logind = owner.as_deref().unwrap_or("(none)"),
                start,
                "logind: PrepareForShutdown from a peer that does not own org.freedesktop.login1: \
                 reported, audit-only (--trust-unowned-bus-signals acts on it)"
            );
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
            s.sender = by;
            return tx.send(s).await.is_err().then_some(Flow::Stop);
        }
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
        // logind's limit as it is now: another drop-in (the kubelet's) may
        // have raised it since the agent started.
        match tokio::time::timeout(Duration::from_millis(500), inhibit_delay_max(conn)).await {
            Ok(Ok(d)) if d.min(DELAY_CAP) != self.delay_max => {
                tracing::info!(from = %secs(self.delay_max), to = %secs(d), "logind: InhibitDelayMaxUSec changed since it was read");
                self.delay_max = d.min(DELAY_CAP);
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(
                "logind: re-reading InhibitDelayMaxUSec: {e}; using {}",
                secs(self.delay_max)
            ),
            Err(_) => tracing::warn!(
                "logind: re-reading InhibitDelayMaxUSec timed out; using {}",
                secs(self.delay_max)
            ),
        }
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
        conn: &Connection,
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
        self.episode = Some(Episode {
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
    async fn relock_unless_logind_waits(&mut self, conn: &Connection) {
        if self.lock.is_none() && self.wants_lock() {
            tracing::info!(
                "logind: the shutdown was not announced by logind: delay lock taken again"
            );
            self.relock(conn).await;
        }
    }

    /// Takes a new lock, then drops the old one (never a moment without).
    async fn relock(&mut self, conn: &Connection) {
        match take_lock(conn).await {
            Ok(fd) => {
                let old = self.lock.replace(fd);
                drop(old);
                self.held.send_replace(true);
                if let Some(h) = &self.health {
                    h.regained(LOCK_PART);
                }
            }
            Err(e) => {
                tracing::error!("logind: cannot take a delay lock: {e}");
                if let Some(h) = &self.health {
                    h.lost(LOCK_PART, &format!("cannot take a delay lock: {e}"));
                }
            }
        }
    }

    /// logind's kind of the shutdown under way: its metadata (systemd ≥ 255),
    /// else the type of a scheduled shutdown.
    async fn kind(&self, conn: &Connection) -> Kind {
        let meta: Option<HashMap<String, OwnedVariant>> =
            dbus::logind_property(conn, "PreparingForShutdownWithMetadata")
                .await
                .ok();
        if let Some(t) = meta
            .and_then(|mut m| m.remove("type"))
            .and_then(|v| String::try_from(v).ok())
        {
            return kind_of(&t);
        }
        match dbus::logind_property::<(String, u64)>(conn, "ScheduledShutdown").await {
            Ok((t, _)) => kind_of(&t),
            Err(_) => Kind::Unknown,
        }
    }

    /// Follows ScheduledShutdown: `value` from a PropertiesChanged, else read.
    async fn check_scheduled(
        &mut self,
        conn: &Connection,
        tx: &mpsc::Sender<ShutdownSignal>,
        value: Option<(String, u64)>,
    ) -> Option<Flow> {
        let value = match value {
            Some(v) => v,
            None => match dbus::logind_property(conn, "ScheduledShutdown").await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!("logind: reading ScheduledShutdown: {e}");
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
                let at = dbus::wall_usec(usec);
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
                if SystemTime::now() + Duration::from_secs(1) >= dbus::wall_usec(usec) {
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
async fn subscribe(conn: &Connection) -> zbus::Result<(MessageStream, MessageStream)> {
    let prepare = dbus::signal_stream(
        conn,
        None,
        LOGIND_PATH,
        LOGIND_MANAGER,
        "PrepareForShutdown",
    )
    .await?;
    let rule = MatchRule::builder()
        .msg_type(MsgType::Signal)
        .sender(LOGIND)
        .path(LOGIND_PATH)
        .interface("org.freedesktop.DBus.Properties")
        .member("PropertiesChanged")
        .arg(0, LOGIND_MANAGER)
        .build()?;
    let changed = MessageStream::for_match_rule(rule, conn, None).await?;
    Ok((prepare, changed))
}

/// ScheduledShutdown from a PropertiesChanged signal, when it is there.
fn scheduled_from_changed(m: &Message) -> Option<(String, u64)> {
    let (_, mut changed, _): (String, HashMap<String, OwnedVariant>, Vec<String>) =
        m.body().deserialize().ok()?;
    <(String, u64)>::try_from(changed.remove("ScheduledShutdown")?).ok()
}

/// The process behind a bus peer, when it is still connected.
async fn sender_actor(conn: &Connection, sender: &str) -> Option<Actor> {
    let (pid, uid) =
        tokio::time::timeout(Duration::from_millis(500), dbus::peer_pid_uid(conn, sender))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timespans_parse_as_systemd_does() {
        assert_eq!(parse_timespan("30"), Some(Duration::from_secs(30)));
        assert_eq!(parse_timespan("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_timespan("1min 30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_timespan("1min30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_timespan("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_timespan("2h"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_timespan("infinity"), Some(Duration::MAX));
        assert_eq!(parse_timespan("soon"), None);
        assert_eq!(parse_timespan(""), None);
    }

    #[test]
    fn the_last_dropin_by_name_wins_and_etc_masks_usr() {
        let root =
            std::env::temp_dir().join(format!("lastgasp-logind-conf-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let put = |rel: &str, text: &str| {
            let p = root.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        };
        put(
            "etc/systemd/logind.conf",
            "[Login]\n#InhibitDelayMaxSec=5\nInhibitDelayMaxSec=10\n",
        );
        put(
            "usr/lib/systemd/logind.conf.d/50-distro.conf",
            "[Login]\nInhibitDelayMaxSec=7\n",
        );
        put(
            "etc/systemd/logind.conf.d/99-lastgasp.conf",
            &dropin_text(Duration::from_millis(29_500)),
        );
        put(
            "run/systemd/logind.conf.d/zz-cap.conf",
            "[Other]\nInhibitDelayMaxSec=1\n[Login]\nInhibitDelayMaxSec=1min\n",
        );
        // Same name in /etc masks /usr/lib.
        put(
            "usr/lib/systemd/logind.conf.d/zz-cap.conf",
            "[Login]\nInhibitDelayMaxSec=2\n",
        );
        let s = inhibit_delay_settings(&root);
        let got: Vec<_> = s
            .iter()
            .map(|s| {
                (
                    s.file.strip_prefix(&root).unwrap().display().to_string(),
                    s.value.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("etc/systemd/logind.conf".to_string(), "10".to_string()),
                (
                    "usr/lib/systemd/logind.conf.d/50-distro.conf".into(),
                    "7".into()
                ),
                (
                    "etc/systemd/logind.conf.d/99-lastgasp.conf".into(),
                    "30".into()
                ),
                (
                    "run/systemd/logind.conf.d/zz-cap.conf".into(),
                    "1min".into()
                ),
            ]
        );
        assert_eq!(s.last().unwrap().delay, Some(Duration::from_secs(60)));
        fs::remove_dir_all(&root).ok();
    }

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
        let (release, release_rx) = mpsc::unbounded_channel();
        let (relock, relock_rx) = mpsc::unbounded_channel();
        let (held, _) = watch::channel(true);
        let mut d = LogindDetector {
            cfg: LogindConfig::default(),
            conn: None,
            streams: None,
            lock: None,
            delay_max: Duration::MAX,
            episode: None,
            scheduled: None,
            sessions: 0,
            release_rx,
            relock_rx,
            held,
            health: None,
        };
        drop((release, relock));
        let wall = SystemTime::now();
        let deadline = d.begin(Instant::now(), wall, Duration::MAX, true);
        assert_eq!(deadline, wall + DELAY_CAP);
        assert_eq!(parse_timespan("infinity"), Some(Duration::MAX));
    }
}
