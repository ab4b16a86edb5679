//! A stand-in for systemd-logind and systemd's manager on a private bus: the
//! parts of `org.freedesktop.login1.Manager` and
//! `org.freedesktop.systemd1.Manager` the agent uses, with their real
//! semantics:
//! - `Inhibit` hands out the write end of a real pipe; the lock lasts until
//!   every copy of that fd is closed;
//! - `PowerOff`/`Reboot`/`Halt` send `PrepareForShutdown(true)` (and
//!   `...WithMetadata`), then wait until every shutdown delay lock is closed
//!   or `InhibitDelayMaxSec` has passed, then queue the target's job;
//! - the config is read as logind reads it (main file, then
//!   `logind.conf.d/*.conf` by file name across /etc, /run, /usr/local/lib,
//!   /usr/lib, last wins), again on `KillUnit(systemd-logind.service, SIGHUP)`;
//! - `Subscribe`, `JobNew`, `JobRemoved`, `ListJobs`, `StartUnit` and
//!   `CancelJob` as systemd has them (signals only while someone subscribes).
//!
//! Test controls on `dev.lastgasp.Fake`: `CancelShutdown` calls off the
//! shutdown under way (as logind does when its job goes away) and sends
//! `PrepareForShutdown(false)`.
//!
//! Every event is appended to `--log` as `<µs since epoch> <event> k=v...`.
//! When the bus goes away it reconnects and keeps its state (as logind keeps
//! its inhibitors across restarts).
//!
//! Usage: lastgasp-fake-systemd --bus ADDRESS --root DIR --log FILE
//!        [--no-scheduled-signal]   (systemd < 255: no PropertiesChanged for
//!                                   ScheduledShutdown)
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs,
    io::{Read, Write},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use tokio::{sync::mpsc, time::Instant};
use zbus::{message::Type as MsgType, Connection, Message, MessageStream, Variant};

const LOGIND: &str = "org.freedesktop.login1";
const LOGIND_PATH: &str = "/org/freedesktop/login1";
const LOGIND_IFACE: &str = "org.freedesktop.login1.Manager";
const SYSTEMD: &str = "org.freedesktop.systemd1";
const SYSTEMD_PATH: &str = "/org/freedesktop/systemd1";
const SYSTEMD_IFACE: &str = "org.freedesktop.systemd1.Manager";
const PROPS: &str = "org.freedesktop.DBus.Properties";
const FAKE_IFACE: &str = "dev.lastgasp.Fake";

struct Inhibitor {
    what: String,
    who: String,
    why: String,
    mode: String,
    uid: u32,
    pid: u32,
}

/// A shutdown logind is carrying out.
struct Action {
    kind: String,
    unit: String,
    /// Until when delay locks may hold it (None once executed).
    timeout: Option<Instant>,
}

struct Job {
    unit: String,
    job_type: String,
    done_at: Instant,
}

struct Fake {
    root: PathBuf,
    log: fs::File,
    scheduled_signal: bool,
    delay_max: Duration,
    inhibitors: BTreeMap<u64, Inhibitor>,
    next_inhibitor: u64,
    action: Option<Action>,
    scheduled: Option<(String, u64, Instant)>,
    subscribers: HashSet<String>,
    jobs: BTreeMap<u32, Job>,
    next_job: u32,
    reload_at: Option<Instant>,
    closed_tx: mpsc::UnboundedSender<u64>,
}

fn usec_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bus = arg(&args, "--bus").expect("--bus ADDRESS");
    let root = PathBuf::from(arg(&args, "--root").expect("--root DIR"));
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(arg(&args, "--log").expect("--log FILE"))
        .expect("opening the log");
    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel();
    let mut fake = Fake {
        delay_max: read_delay(&root),
        root,
        log,
        scheduled_signal: !args.iter().any(|a| a == "--no-scheduled-signal"),
        inhibitors: BTreeMap::new(),
        next_inhibitor: 1,
        action: None,
        scheduled: None,
        subscribers: HashSet::new(),
        jobs: BTreeMap::new(),
        next_job: 1,
        reload_at: None,
        closed_tx,
    };
    let mut connections = 0;
    loop {
        let Ok((conn, stream)) = connect(&bus).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        connections += 1;
        fake.event(&format!(
            "connected n={connections} delay_max_usec={}",
            fake.delay_max.as_micros()
        ));
        if connections == 1 {
            println!("ready");
        }
        // Subscribers were peers on the old bus.
        fake.subscribers.clear();
        fake.serve(&conn, stream, &mut closed_rx).await;
        fake.event("disconnected");
    }
}

async fn connect(bus: &str) -> zbus::Result<(Connection, MessageStream)> {
    let conn = zbus::connection::Builder::address(bus).build().await?;
    // The stream exists before the names, so no call is missed.
    let stream = MessageStream::from(&conn);
    conn.call_method(
        Some("org.freedesktop.DBus"),
        "/org/freedesktop/DBus",
        Some("org.freedesktop.DBus"),
        "AddMatch",
        &("type='signal',sender='org.freedesktop.DBus',member='NameOwnerChanged'",),
    )
    .await?;
    conn.request_name(LOGIND).await?;
    conn.request_name(SYSTEMD).await?;
    Ok((conn, stream))
}

/// logind's InhibitDelayMaxSec from the files under `root`.
fn read_delay(root: &Path) -> Duration {
    const DIRS: [&str; 4] = [
        "etc/systemd",
        "run/systemd",
        "usr/local/lib/systemd",
        "usr/lib/systemd",
    ];
    let mut files: Vec<PathBuf> = DIRS
        .iter()
        .map(|d| root.join(d).join("logind.conf"))
        .filter(|p| p.exists())
        .take(1)
        .collect();
    let mut dropins = BTreeMap::new();
    for d in DIRS {
        for e in fs::read_dir(root.join(d).join("logind.conf.d"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().into_string().unwrap();
            if name.ends_with(".conf") && !dropins.contains_key(&name) {
                dropins.insert(name, e.path());
            }
        }
    }
    files.extend(dropins.into_values());
    let mut delay = Duration::from_secs(5);
    for f in files {
        let mut section = String::new();
        for line in fs::read_to_string(f).unwrap_or_default().lines() {
            let line = line.trim();
            if line.starts_with('[') {
                section = line.to_string();
            } else if let Some(v) = line.strip_prefix("InhibitDelayMaxSec=") {
                if section == "[Login]" {
                    let v = v.trim();
                    let (n, unit) =
                        v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len()));
                    let n: u64 = n.parse().unwrap_or(5);
                    delay = match unit.trim() {
                        "" | "s" | "sec" => Duration::from_secs(n),
                        "ms" => Duration::from_millis(n),
                        "min" | "m" => Duration::from_secs(60 * n),
                        _ => delay,
                    };
                }
            }
        }
    }
    delay
}

type Reply = Result<(), (String, String)>;

fn err(name: &str, msg: impl Into<String>) -> Reply {
    Err((name.to_string(), msg.into()))
}

impl Fake {
    fn event(&mut self, e: &str) {
        writeln!(self.log, "{} {e}", usec_now()).unwrap();
        self.log.flush().unwrap();
    }

    async fn serve(
        &mut self,
        conn: &Connection,
        mut stream: MessageStream,
        closed_rx: &mut mpsc::UnboundedReceiver<u64>,
    ) {
        loop {
            let wake = self.next_wake();
            tokio::select! {
                m = stream.next() => match m {
                    Some(Ok(m)) => self.on_message(conn, m).await,
                    Some(Err(_)) => continue,
                    None => return,
                },
                Some(id) = closed_rx.recv() => {
                    if let Some(i) = self.inhibitors.remove(&id) {
                        self.event(&format!("lock-closed id={id} who={}", i.who));
                    }
                    self.dispatch_delayed(conn, false).await;
                }
                _ = sleep_until(wake) => self.on_timers(conn).await,
            }
            if conn.is_closed() {
                return;
            }
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        [
            self.action.as_ref().and_then(|a| a.timeout),
            self.scheduled.as_ref().map(|s| s.2),
            self.jobs.values().map(|j| j.done_at).min(),
            self.reload_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    async fn on_timers(&mut self, conn: &Connection) {
        let now = Instant::now();
        if self.reload_at.is_some_and(|t| t <= now) {
            self.reload_at = None;
            self.delay_max = read_delay(&self.root);
            self.event(&format!(
                "reloaded delay_max_usec={}",
                self.delay_max.as_micros()
            ));
        }
        if self
            .action
            .as_ref()
            .and_then(|a| a.timeout)
            .is_some_and(|t| t <= now)
        {
            self.dispatch_delayed(conn, true).await;
        }
        if self.scheduled.as_ref().is_some_and(|s| s.2 <= now) {
            let (kind, _, _) = self.scheduled.take().unwrap();
            self.event(&format!("scheduled-due type={kind}"));
            self.scheduled_changed(conn).await;
            if !kind.starts_with("dry-") {
                let _ = self.shutdown(conn, &kind).await;
            }
        }
        let due: Vec<u32> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.done_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let job = self.jobs.remove(&id).unwrap();
            if unit_kind(&job.unit).is_some() {
                self.event(&format!("shutdown-executed unit={}", job.unit));
            }
            self.job_removed(conn, id, &job.unit, "done").await;
        }
    }

    async fn on_message(&mut self, conn: &Connection, m: Message) {
        let h = m.header();
        if m.message_type() == MsgType::Signal {
            if h.member().is_some_and(|n| n.as_str() == "NameOwnerChanged") {
                if let Ok((name, _old, new)) = m.body().deserialize::<(String, String, String)>() {
                    if new.is_empty() && self.subscribers.remove(&name) {
                        self.event(&format!("unsubscribed sender={name} (gone)"));
                    }
                }
            }
            return;
        }
        if m.message_type() != MsgType::MethodCall {
            return;
        }
        let iface = h
            .interface()
            .map(std::string::ToString::to_string)
            .unwrap_or_default();
        let member = h
            .member()
            .map(std::string::ToString::to_string)
            .unwrap_or_default();
        let sender = h
            .sender()
            .map(std::string::ToString::to_string)
            .unwrap_or_default();
        let r = match (iface.as_str(), member.as_str()) {
            (LOGIND_IFACE, "Inhibit") => self.inhibit(conn, &m, &sender).await,
            (LOGIND_IFACE, "ListInhibitors") => {
                let list: Vec<(&str, &str, &str, &str, u32, u32)> = self
                    .inhibitors
                    .values()
                    .map(|i| {
                        (
                            i.what.as_str(),
                            i.who.as_str(),
                            i.why.as_str(),
                            i.mode.as_str(),
                            i.uid,
                            i.pid,
                        )
                    })
                    .collect();
                reply(conn, &m, &list).await
            }
            (LOGIND_IFACE, "PowerOff" | "Reboot" | "Halt") => {
                let kind = member.to_lowercase();
                match self.shutdown(conn, &kind).await {
                    Ok(()) => reply(conn, &m, &()).await,
                    e => e,
                }
            }
            // What systemctl calls first; SD_LOGIND_REBOOT_VIA_KEXEC is 1 << 1.
            (LOGIND_IFACE, "PowerOffWithFlags" | "RebootWithFlags" | "HaltWithFlags") => {
                let flags: u64 = m.body().deserialize().unwrap_or(0);
                let kind = match member.trim_end_matches("WithFlags") {
                    "Reboot" if flags & 2 != 0 => "kexec".to_string(),
                    k => k.to_lowercase(),
                };
                match self.shutdown(conn, &kind).await {
                    Ok(()) => reply(conn, &m, &()).await,
                    e => e,
                }
            }
            (LOGIND_IFACE, "ScheduleShutdown") => match m.body().deserialize::<(String, u64)>() {
                Ok((kind, usec)) => {
                    let ok = [
                        "poweroff",
                        "reboot",
                        "halt",
                        "kexec",
                        "dry-poweroff",
                        "dry-reboot",
                        "dry-halt",
                    ];
                    if !ok.contains(&kind.as_str()) {
                        err(
                            "org.freedesktop.DBus.Error.InvalidArgs",
                            format!("Unsupported shutdown type: {kind}"),
                        )
                    } else {
                        let left = Duration::from_micros(usec.saturating_sub(usec_now()));
                        self.scheduled = Some((kind.clone(), usec, Instant::now() + left));
                        self.event(&format!("scheduled type={kind} usec={usec}"));
                        self.scheduled_changed(conn).await;
                        reply(conn, &m, &()).await
                    }
                }
                Err(e) => err("org.freedesktop.DBus.Error.InvalidArgs", e.to_string()),
            },
            (LOGIND_IFACE, "CancelScheduledShutdown") => {
                let had = self.scheduled.take().is_some();
                if had {
                    self.event("scheduled-cancelled");
                    self.scheduled_changed(conn).await;
                }
                reply(conn, &m, &had).await
            }
            (PROPS, "Get") => match m.body().deserialize::<(String, String)>() {
                Ok((i, p)) => match self.property(&i, &p) {
                    Some(v) => reply(conn, &m, &v).await,
                    None => err(
                        "org.freedesktop.DBus.Error.UnknownProperty",
                        format!("Unknown property {i}.{p}"),
                    ),
                },
                Err(e) => err("org.freedesktop.DBus.Error.InvalidArgs", e.to_string()),
            },
            (SYSTEMD_IFACE, "Subscribe") => {
                if self.subscribers.insert(sender.clone()) {
                    self.event(&format!("subscribed sender={sender}"));
                    reply(conn, &m, &()).await
                } else {
                    err(
                        "org.freedesktop.systemd1.AlreadySubscribed",
                        "Client is already subscribed.",
                    )
                }
            }
            (SYSTEMD_IFACE, "Unsubscribe") => {
                if self.subscribers.remove(&sender) {
                    reply(conn, &m, &()).await
                } else {
                    err(
                        "org.freedesktop.systemd1.NotSubscribed",
                        "Client is not subscribed.",
                    )
                }
            }
            (SYSTEMD_IFACE, "StartUnit") => match m.body().deserialize::<(String, String)>() {
                Ok((unit, mode)) => {
                    self.event(&format!(
                        "start-unit unit={unit} mode={mode} sender={sender}"
                    ));
                    let id = self.start_unit(conn, &unit).await;
                    reply(conn, &m, &job_path(id)).await
                }
                Err(e) => err("org.freedesktop.DBus.Error.InvalidArgs", e.to_string()),
            },
            (SYSTEMD_IFACE, "CancelJob") => match m.body().deserialize::<u32>() {
                Ok(id) => match self.jobs.remove(&id) {
                    Some(job) => {
                        self.event(&format!("job-cancelled id={id} unit={}", job.unit));
                        self.job_removed(conn, id, &job.unit, "canceled").await;
                        reply(conn, &m, &()).await
                    }
                    None => err(
                        "org.freedesktop.systemd1.NoSuchJob",
                        format!("Job {id} does not exist."),
                    ),
                },
                Err(e) => err("org.freedesktop.DBus.Error.InvalidArgs", e.to_string()),
            },
            (SYSTEMD_IFACE, "ListJobs") => {
                let list: Vec<(
                    u32,
                    String,
                    String,
                    String,
                    zbus::OwnedObjectPath,
                    zbus::OwnedObjectPath,
                )> = self
                    .jobs
                    .iter()
                    .map(|(id, j)| {
                        (
                            *id,
                            j.unit.clone(),
                            j.job_type.clone(),
                            "waiting".to_string(),
                            job_path(*id),
                            zbus::OwnedObjectPath::try_from("/org/freedesktop/systemd1/unit/x")
                                .unwrap(),
                        )
                    })
                    .collect();
                reply(conn, &m, &list).await
            }
            (SYSTEMD_IFACE, "KillUnit") => match m.body().deserialize::<(String, String, i32)>() {
                Ok((unit, whom, signo)) => {
                    self.event(&format!("kill-unit unit={unit} whom={whom} signal={signo}"));
                    if unit == "systemd-logind.service" && signo == libc::SIGHUP {
                        // A reload is asynchronous: the caller must re-read.
                        self.reload_at = Some(Instant::now() + Duration::from_millis(50));
                    }
                    reply(conn, &m, &()).await
                }
                Err(e) => err("org.freedesktop.DBus.Error.InvalidArgs", e.to_string()),
            },
            (FAKE_IFACE, "CancelShutdown") => {
                if let Some(a) = self.action.take() {
                    self.event(&format!("shutdown-cancelled type={}", a.kind));
                    self.prepare_for_shutdown(conn, false, &a.kind).await;
                }
                reply(conn, &m, &()).await
            }
            _ => err(
                "org.freedesktop.DBus.Error.UnknownMethod",
                format!("Unknown method {iface}.{member}"),
            ),
        };
        if let Err((name, msg)) = r {
            let _ = conn.reply_error(&h, name.as_str(), &msg).await;
        }
    }

    async fn inhibit(&mut self, conn: &Connection, m: &Message, sender: &str) -> Reply {
        let Ok((what, who, why, mode)) = m.body().deserialize::<(String, String, String, String)>()
        else {
            return err(
                "org.freedesktop.DBus.Error.InvalidArgs",
                "Inhibit takes ssss",
            );
        };
        if !["delay", "block", "block-weak"].contains(&mode.as_str()) {
            return err(
                "org.freedesktop.DBus.Error.InvalidArgs",
                "Invalid mode specification",
            );
        }
        let (pid, uid) = peer(conn, sender).await;
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let id = self.next_inhibitor;
        self.next_inhibitor += 1;
        self.inhibitors.insert(
            id,
            Inhibitor {
                what: what.clone(),
                who: who.clone(),
                why,
                mode: mode.clone(),
                uid,
                pid,
            },
        );
        self.event(&format!(
            "inhibit id={id} what={what} who={who} mode={mode} pid={pid}"
        ));
        // The lock ends when every copy of the write end is closed.
        let tx = self.closed_tx.clone();
        std::thread::spawn(move || {
            let mut f = fs::File::from(read_end);
            let mut b = [0u8; 64];
            while matches!(f.read(&mut b), Ok(n) if n > 0) {}
            let _ = tx.send(id);
        });
        let fd = zbus::OwnedFd::from(write_end);
        reply(conn, m, &fd).await
        // Our copy of the write end closes here.
    }

    /// logind's PowerOff/Reboot/Halt.
    async fn shutdown(&mut self, conn: &Connection, kind: &str) -> Reply {
        if self.action.is_some() {
            return err(
                "org.freedesktop.login1.OperationInProgress",
                "There's already a shutdown or sleep operation in progress",
            );
        }
        let unit = format!("{kind}.target");
        self.action = Some(Action {
            kind: kind.to_string(),
            unit,
            timeout: Some(Instant::now() + self.delay_max),
        });
        self.event(&format!("prepare start=true type={kind}"));
        self.prepare_for_shutdown(conn, true, kind).await;
        self.dispatch_delayed(conn, false).await;
        Ok(())
    }

    async fn prepare_for_shutdown(&mut self, conn: &Connection, start: bool, kind: &str) {
        let meta: HashMap<&str, Variant<'_>> = HashMap::from([("type", Variant::from(kind))]);
        let _ = conn
            .emit_signal(
                None::<&str>,
                LOGIND_PATH,
                LOGIND_IFACE,
                "PrepareForShutdownWithMetadata",
                &(start, meta),
            )
            .await;
        let _ = conn
            .emit_signal(
                None::<&str>,
                LOGIND_PATH,
                LOGIND_IFACE,
                "PrepareForShutdown",
                &start,
            )
            .await;
    }

    /// Goes ahead with the delayed shutdown once no delay lock holds it, or
    /// at its timeout.
    async fn dispatch_delayed(&mut self, conn: &Connection, timed_out: bool) {
        let Some(a) = self.action.as_ref().filter(|a| a.timeout.is_some()) else {
            return;
        };
        let held = self
            .inhibitors
            .values()
            .filter(|i| i.mode == "delay" && i.what.split(':').any(|w| w == "shutdown"))
            .count();
        if held > 0 && !self.delay_max.is_zero() && !timed_out {
            return;
        }
        let reason = if timed_out && held > 0 {
            "timeout"
        } else if self.delay_max.is_zero() {
            "no-delay"
        } else {
            "locks-released"
        };
        let unit = a.unit.clone();
        self.event(&format!(
            "shutdown-proceeds unit={unit} reason={reason} locks_held={held}"
        ));
        self.action.as_mut().unwrap().timeout = None;
        self.start_unit(conn, &unit).await;
    }

    /// Queues the unit's job (and a shutdown target's companions).
    async fn start_unit(&mut self, conn: &Connection, unit: &str) -> u32 {
        let mut units = vec![unit.to_string()];
        if let Some(base) = unit
            .strip_suffix(".target")
            .filter(|_| unit_kind(unit).is_some() && unit != "shutdown.target")
        {
            units.push(format!("systemd-{base}.service"));
            units.push("shutdown.target".into());
        }
        let first = self.next_job;
        // Services stop first; the jobs finish a moment later.
        let done_at = Instant::now() + Duration::from_millis(100);
        for u in units {
            let id = self.next_job;
            self.next_job += 1;
            self.jobs.insert(
                id,
                Job {
                    unit: u.clone(),
                    job_type: "start".into(),
                    done_at,
                },
            );
            self.event(&format!("job-new id={id} unit={u}"));
            if !self.subscribers.is_empty() {
                let _ = conn
                    .emit_signal(
                        None::<&str>,
                        SYSTEMD_PATH,
                        SYSTEMD_IFACE,
                        "JobNew",
                        &(id, job_path(id), u.as_str()),
                    )
                    .await;
            }
        }
        first
    }

    async fn job_removed(&mut self, conn: &Connection, id: u32, unit: &str, result: &str) {
        if !self.subscribers.is_empty() {
            let _ = conn
                .emit_signal(
                    None::<&str>,
                    SYSTEMD_PATH,
                    SYSTEMD_IFACE,
                    "JobRemoved",
                    &(id, job_path(id), unit, result),
                )
                .await;
        }
        // logind: its shutdown's job went away without running.
        if result != "done"
            && self
                .action
                .as_ref()
                .is_some_and(|a| a.unit == unit && a.timeout.is_none())
        {
            let a = self.action.take().unwrap();
            self.event(&format!("shutdown-cancelled type={}", a.kind));
            self.prepare_for_shutdown(conn, false, &a.kind).await;
        }
    }

    async fn scheduled_changed(&mut self, conn: &Connection) {
        if !self.scheduled_signal {
            return;
        }
        let v = self.scheduled_value();
        let changed: HashMap<&str, Variant<'_>> =
            HashMap::from([("ScheduledShutdown", Variant::from(v))]);
        let _ = conn
            .emit_signal(
                None::<&str>,
                LOGIND_PATH,
                PROPS,
                "PropertiesChanged",
                &(LOGIND_IFACE, changed, Vec::<String>::new()),
            )
            .await;
    }

    fn scheduled_value(&self) -> (String, u64) {
        match &self.scheduled {
            Some((k, u, _)) => (k.clone(), *u),
            None => (String::new(), 0),
        }
    }

    fn property(&self, iface: &str, name: &str) -> Option<Variant<'static>> {
        if iface != LOGIND_IFACE {
            return None;
        }
        Some(match name {
            "InhibitDelayMaxUSec" => Variant::from(self.delay_max.as_micros() as u64),
            "PreparingForShutdown" => Variant::from(self.action.is_some()),
            "PreparingForShutdownWithMetadata" => {
                let mut m: HashMap<String, Variant<'static>> = HashMap::new();
                m.insert("preparing".into(), Variant::from(self.action.is_some()));
                if let Some(a) = &self.action {
                    m.insert("type".into(), Variant::from(a.kind.clone()));
                }
                Variant::from(m)
            }
            "ScheduledShutdown" => Variant::from(self.scheduled_value()),
            _ => return None,
        })
    }
}

fn unit_kind(unit: &str) -> Option<&'static str> {
    Some(match unit {
        "poweroff.target" | "systemd-poweroff.service" => "poweroff",
        "reboot.target" | "systemd-reboot.service" | "ctrl-alt-del.target" => "reboot",
        "halt.target" | "systemd-halt.service" => "halt",
        "kexec.target" | "systemd-kexec.service" => "kexec",
        "soft-reboot.target" | "systemd-soft-reboot.service" => "soft-reboot",
        "shutdown.target" => "shutdown",
        _ => return None,
    })
}

fn job_path(id: u32) -> zbus::OwnedObjectPath {
    zbus::OwnedObjectPath::try_from(format!("/org/freedesktop/systemd1/job/{id}")).unwrap()
}

async fn peer(conn: &Connection, sender: &str) -> (u32, u32) {
    let call = |m: &'static str| async move {
        conn.call_method(
            Some("org.freedesktop.DBus"),
            "/org/freedesktop/DBus",
            Some("org.freedesktop.DBus"),
            m,
            &(sender,),
        )
        .await
        .ok()
        .and_then(|r| r.body().deserialize::<u32>().ok())
        .unwrap_or(0)
    };
    (
        call("GetConnectionUnixProcessID").await,
        call("GetConnectionUnixUser").await,
    )
}

async fn reply<B>(conn: &Connection, m: &Message, body: &B) -> Reply
where
    B: serde::Serialize + zbus::DynamicType,
{
    conn.reply(&m.header(), body).await.map_err(|e| {
        (
            "org.freedesktop.DBus.Error.Failed".to_string(),
            e.to_string(),
        )
    })
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
