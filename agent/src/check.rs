//! `lastgasp check`: a preflight of graceful shutdown through logind. Reads
//! and asks, changes nothing (the delay lock it takes is closed at once).
use std::{fmt, path::Path, time::Duration};

use zbus::Connection;

use crate::detect::{
    dbus::{self, DbusArgs, LOGIND, SYSTEMD, SYSTEMD_MANAGER, SYSTEMD_PATH},
    logind::{self, secs, Setting, DROPIN_NAME},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Info,
    Warn,
    /// Graceful shutdown would fail.
    Fail,
}

#[derive(Clone, Debug)]
pub struct Line {
    pub status: Status,
    pub what: &'static str,
    pub text: String,
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub lines: Vec<Line>,
}

impl Report {
    fn push(&mut self, status: Status, what: &'static str, text: impl Into<String>) {
        self.lines.push(Line {
            status,
            what,
            text: text.into(),
        });
    }

    pub fn failures(&self) -> usize {
        self.lines
            .iter()
            .filter(|l| l.status == Status::Fail)
            .count()
    }

    pub fn line(&self, what: &str) -> Option<&Line> {
        self.lines.iter().find(|l| l.what == what)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "lastgasp check: graceful node shutdown through logind")?;
        for l in &self.lines {
            let status = match l.status {
                Status::Ok => "ok",
                Status::Info => "info",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            writeln!(f, "  {status:<5} {:<14} {}", l.what, l.text)?;
        }
        match self.failures() {
            0 => writeln!(f, "result: ok"),
            n => writeln!(
                f,
                "result: graceful shutdown would fail ({n} problem{})",
                if n == 1 { "" } else { "s" }
            ),
        }
    }
}

/// Prints the report; the exit code is 1 when something would make graceful
/// shutdown fail.
pub async fn main(args: &DbusArgs) -> i32 {
    let report = check(args).await;
    print!("{report}");
    i32::from(report.failures() > 0)
}

pub async fn check(args: &DbusArgs) -> Report {
    let mut r = Report::default();
    let address = args
        .system_bus
        .clone()
        .or_else(|| std::env::var("DBUS_SYSTEM_BUS_ADDRESS").ok())
        .unwrap_or_else(|| "unix:path=/run/dbus/system_bus_socket (default)".into());
    let conn = match dbus::connect(args.system_bus.as_deref()).await {
        Ok(c) => {
            r.push(Status::Ok, "system bus", address);
            c
        }
        Err(e) => {
            r.push(
                Status::Fail,
                "system bus",
                format!("cannot connect to {address}: {e}"),
            );
            return r;
        }
    };
    match dbus::name_owner(&conn, LOGIND).await {
        Ok(Some(owner)) => {
            let who = match dbus::peer_pid_uid(&conn, &owner).await {
                Some((pid, _)) => {
                    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                    format!(" (pid {pid} {})", comm.trim())
                }
                None => String::new(),
            };
            r.push(Status::Ok, "logind", format!("{LOGIND} is {owner}{who}"));
            logind_checks(&mut r, &conn, args).await;
        }
        Ok(None) => r.push(
            Status::Fail,
            "logind",
            format!("nobody owns {LOGIND}: no delay lock can hold a shutdown (only the eBPF hooks will see it)"),
        ),
        Err(e) => r.push(Status::Fail, "logind", format!("asking the bus for {LOGIND}: {e}")),
    }
    systemd_check(&mut r, &conn).await;
    r
}

async fn logind_checks(r: &mut Report, conn: &Connection, args: &DbusArgs) {
    let root = &args.logind_root;
    let ours = logind::dropin_path(root);
    let settings = logind::inhibit_delay_settings(root);
    match logind::inhibit_delay_max(conn).await {
        Ok(have) => delay_check(r, have, args.inhibit_delay, &settings, &ours),
        Err(e) => r.push(
            Status::Fail,
            "inhibit delay",
            format!("reading InhibitDelayMaxUSec: {e}"),
        ),
    }
    let order = if settings.is_empty() {
        format!(
            "no file under {} sets InhibitDelayMaxSec (logind's default: 5s)",
            root.display()
        )
    } else {
        let n = settings.len();
        settings
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let win = if i + 1 == n { " (wins)" } else { "" };
                format!("{}: {}{win}", s.file.display(), s.value)
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    r.push(Status::Info, "drop-ins", order);

    // Listed before the check takes (and closes) a lock of its own.
    type Inhibitor = (String, String, String, String, u32, u32);
    if let Ok(m) = conn
        .call_method(
            Some(LOGIND),
            dbus::LOGIND_PATH,
            Some(dbus::LOGIND_MANAGER),
            "ListInhibitors",
            &(),
        )
        .await
    {
        if let Ok(list) = m.body().deserialize::<Vec<Inhibitor>>() {
            let held: Vec<String> = list
                .iter()
                .filter(|(what, _, _, mode, _, _)| {
                    mode == "delay" && what.split(':').any(|w| w == "shutdown")
                })
                .map(|(_, who, _, _, _, pid)| format!("{who} (pid {pid})"))
                .collect();
            if !held.is_empty() {
                r.push(
                    Status::Info,
                    "held locks",
                    format!("shutdown delay locks held now: {}", held.join(", ")),
                );
            }
        }
    }
    match logind::take_lock(conn).await {
        Ok(fd) => {
            drop(fd);
            r.push(
                Status::Ok,
                "delay lock",
                "Inhibit(shutdown, delay) gave a lock fd; closed again",
            );
        }
        Err(e) => r.push(
            Status::Fail,
            "delay lock",
            format!("logind refused Inhibit(shutdown, delay): {e}"),
        ),
    }
    if let Ok(true) = dbus::logind_property::<bool>(conn, "PreparingForShutdown").await {
        r.push(
            Status::Warn,
            "shutdown",
            "logind is preparing a shutdown right now",
        );
    }
    if let Ok((t, usec)) = dbus::logind_property::<(String, u64)>(conn, "ScheduledShutdown").await {
        if !t.is_empty() && usec > 0 {
            let at = humantime::format_rfc3339_seconds(dbus::wall_usec(usec));
            r.push(
                Status::Warn,
                "shutdown",
                format!("a {t} is scheduled for {at}"),
            );
        }
    }
}

/// Whether logind allows the delay, or will once `run` writes its drop-in.
fn delay_check(
    r: &mut Report,
    have: Duration,
    want: Option<Duration>,
    settings: &[Setting],
    ours: &Path,
) {
    let Some(want) = want else {
        r.push(
            Status::Info,
            "inhibit delay",
            format!(
                "logind allows {} (InhibitDelayMaxUSec); nothing requested (--inhibit-delay)",
                secs(have)
            ),
        );
        return;
    };
    if have >= want {
        r.push(
            Status::Ok,
            "inhibit delay",
            format!(
                "logind allows {}, lastgasp needs {}",
                secs(have),
                secs(want)
            ),
        );
        return;
    }
    // Drop-ins are read by file name: one named after ours overrides it.
    let after_ours = settings.iter().rfind(|s| {
        s.file
            .parent()
            .and_then(|d| d.file_name())
            .is_some_and(|d| d == "logind.conf.d")
            && s.file
                .file_name()
                .is_some_and(|n| n.to_string_lossy().as_ref() > DROPIN_NAME)
    });
    match after_ours {
        Some(s) if s.delay.is_none_or(|d| d < want) => r.push(
            Status::Fail,
            "inhibit delay",
            format!(
                "logind allows {}, lastgasp needs {}: {} sets InhibitDelayMaxSec={} and is read after {}, so it wins; raise it there or remove it",
                secs(have),
                secs(want),
                s.file.display(),
                s.value,
                ours.display()
            ),
        ),
        _ => {
            let dir = ours.parent().expect("drop-in dir");
            let writable = nix::unistd::access(
                dir.ancestors().find(|d| d.exists()).unwrap_or(dir),
                nix::unistd::AccessFlags::W_OK,
            )
            .is_ok();
            if writable {
                r.push(
                    Status::Warn,
                    "inhibit delay",
                    format!(
                        "logind allows {}, lastgasp needs {}: `lastgasp run` will write {} and reload logind",
                        secs(have),
                        secs(want),
                        ours.display()
                    ),
                );
            } else {
                r.push(
                    Status::Fail,
                    "inhibit delay",
                    format!(
                        "logind allows {}, lastgasp needs {}, and {} is not writable",
                        secs(have),
                        secs(want),
                        dir.display()
                    ),
                );
            }
        }
    }
}

async fn systemd_check(r: &mut Report, conn: &Connection) {
    let call = |m: &'static str| async move {
        conn.call_method(Some(SYSTEMD), SYSTEMD_PATH, Some(SYSTEMD_MANAGER), m, &())
            .await
    };
    match dbus::name_owner(conn, SYSTEMD).await {
        Ok(Some(_)) => match call("Subscribe").await {
            Ok(_) => {
                let _ = call("Unsubscribe").await;
                r.push(
                    Status::Ok,
                    "systemd",
                    "Subscribe works: shutdown jobs that bypass logind are seen",
                );
            }
            Err(e) => r.push(Status::Warn, "systemd", format!("Subscribe failed: {e}")),
        },
        _ => r.push(
            Status::Warn,
            "systemd",
            format!("nobody owns {SYSTEMD}: shutdown jobs are seen by the eBPF hooks only"),
        ),
    }
}
