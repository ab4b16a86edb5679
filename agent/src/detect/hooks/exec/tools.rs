//! The shutdown tools' command lines, as each tool reads them. The names
//! come from `lastgasp_common::TOOLS`, which the kernel's exec filter reads
//! too. systemctl's here; the System V style tools' in `sysv`.
use std::time::{SystemTime, UNIX_EPOCH};

use lastgasp_common::{self as common, ToolId};

use super::{
    getopt::{tokenize, Spec, Tok, Val},
    Intent,
};
use crate::{
    signal::{Effect, Kind},
    timespan::parse_timespan,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tool {
    Systemctl,
    Shutdown,
    /// systemd's `halt`, `poweroff` and `reboot`, with the kind the name implies.
    Halt(Kind),
    Busybox,
    /// busybox's `halt`, `poweroff` and `reboot` applets.
    BusyboxHalt(Kind),
    /// `init` and `telinit`.
    Telinit,
    Kexec,
    SystemdShutdown,
}

pub(super) fn tool_named(name: &[u8]) -> Option<Tool> {
    let (_, id) = common::TOOLS.iter().find(|(n, _)| n.as_bytes() == name)?;
    Some(match id {
        ToolId::Systemctl => Tool::Systemctl,
        ToolId::Shutdown => Tool::Shutdown,
        ToolId::Reboot => Tool::Halt(Kind::Reboot),
        ToolId::Poweroff => Tool::Halt(Kind::Poweroff),
        ToolId::Halt => Tool::Halt(Kind::Halt),
        ToolId::Busybox => Tool::Busybox,
        ToolId::Init | ToolId::Telinit => Tool::Telinit,
        ToolId::Kexec => Tool::Kexec,
        ToolId::SystemdShutdown => Tool::SystemdShutdown,
    })
}

pub(super) fn basename(path: &[u8]) -> &[u8] {
    path.rsplit(|&b| b == b'/').next().unwrap_or(path)
}

pub(super) fn utf8(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

pub(super) const SYSTEMCTL: Spec = Spec {
    short: "hC:t:p:P:alqvfs:H:M:n:o:iTr",
    long: &[
        ("help", Val::No),
        ("version", Val::No),
        ("type", Val::Req),
        ("property", Val::Req),
        ("all", Val::No),
        ("reverse", Val::No),
        ("after", Val::No),
        ("before", Val::No),
        ("show-types", Val::No),
        ("failed", Val::No),
        ("full", Val::No),
        ("job-mode", Val::Req),
        ("fail", Val::No),
        ("irreversible", Val::No),
        ("ignore-dependencies", Val::No),
        ("ignore-inhibitors", Val::No),
        ("check-inhibitors", Val::Req),
        ("value", Val::No),
        ("user", Val::No),
        ("system", Val::No),
        ("global", Val::No),
        ("capsule", Val::Req),
        ("wait", Val::No),
        ("no-block", Val::No),
        ("legend", Val::Req),
        ("no-legend", Val::No),
        ("no-pager", Val::No),
        ("no-wall", Val::No),
        ("dry-run", Val::No),
        ("quiet", Val::No),
        ("verbose", Val::No),
        ("no-warn", Val::No),
        ("root", Val::Req),
        ("image", Val::Req),
        ("image-policy", Val::Req),
        ("force", Val::No),
        ("no-reload", Val::No),
        ("kill-whom", Val::Req),
        ("kill-value", Val::Req),
        ("signal", Val::Req),
        ("no-ask-password", Val::No),
        ("host", Val::Req),
        ("machine", Val::Req),
        ("runtime", Val::No),
        ("lines", Val::Req),
        ("output", Val::Req),
        ("plain", Val::No),
        ("state", Val::Req),
        ("recursive", Val::No),
        ("with-dependencies", Val::No),
        ("preset-mode", Val::Req),
        ("firmware-setup", Val::No),
        ("boot-loader-menu", Val::Req),
        ("boot-loader-entry", Val::Req),
        ("now", Val::No),
        ("message", Val::Req),
        ("show-transaction", Val::No),
        ("what", Val::Req),
        ("reboot-argument", Val::Req),
        ("timestamp", Val::Req),
        ("read-only", Val::No),
        ("mkdir", Val::No),
        ("marked", Val::No),
        ("drop-in", Val::Req),
        ("when", Val::Req),
        ("stdin", Val::No),
        ("kill-subgroup", Val::Req),
    ],
    lenient_long: false,
};

/// What a systemctl verb asks for.
pub(super) enum Request {
    /// `systemctl poweroff` and the like.
    Verb(Kind),
    /// `systemctl start poweroff.target` and the like: a job on systemd, past logind.
    Unit(Kind),
}

/// systemctl's options as they bear on a shutdown, and its words (the
/// verb, then its operands).
#[derive(Default)]
struct SystemctlArgs<'a> {
    force: u8,
    remote: bool,
    user: bool,
    offline: bool,
    dry_run: bool,
    when: Option<&'a [u8]>,
    words: Vec<&'a [u8]>,
}

/// The options, in argv order like getopt: help and --when=cancel|show act
/// at once (the `Err`).
fn systemctl_args<'a>(args: &[&'a [u8]]) -> Result<SystemctlArgs<'a>, Intent> {
    let mut a = SystemctlArgs::default();
    for tok in tokenize(args, &SYSTEMCTL) {
        match tok {
            Tok::Bad => return Err(Intent::unclear()),
            Tok::Pos(_, word) => a.words.push(word),
            Tok::Short(b'h', _) | Tok::Long("help" | "version", _) => {
                return Err(Intent::nothing(Kind::Unknown, "only prints help"))
            }
            Tok::Long("when", value) => match value.unwrap_or_default() {
                b"" | b"cancel" => {
                    return Err(Intent::new(Kind::Unknown, Effect::Cancel, false, false))
                }
                b"show" => {
                    return Err(Intent::nothing(
                        Kind::Unknown,
                        "shows the scheduled shutdown",
                    ))
                }
                value => a.when = Some(value),
            },
            Tok::Short(b'f', _) | Tok::Long("force", _) => a.force = a.force.saturating_add(1),
            Tok::Short(b'H', _) | Tok::Long("host", _) => a.remote = true,
            Tok::Short(b'M', machine) | Tok::Long("machine", machine) => {
                a.remote |= machine != Some(b".host");
            }
            Tok::Long("user" | "global" | "capsule", _) | Tok::Short(b'C', _) => {
                a.user = true;
            }
            Tok::Long("system", _) => a.user = false,
            Tok::Long("root" | "image", _) => a.offline = true,
            Tok::Long("dry-run", _) => a.dry_run = true,
            _ => {}
        }
    }
    Ok(a)
}

pub(super) fn systemctl(args: &[&[u8]], now: SystemTime) -> Intent {
    let a = match systemctl_args(args) {
        Ok(a) => a,
        Err(intent) => return intent,
    };
    let Some((&verb, operands)) = a.words.split_first() else {
        return Intent::nothing(Kind::Unknown, "no verb: lists units");
    };
    let Some(verb) = utf8(verb) else {
        return Intent::unclear();
    };
    let request = match verb {
        "poweroff" => Request::Verb(Kind::Poweroff),
        "reboot" => Request::Verb(Kind::Reboot),
        "halt" => Request::Verb(Kind::Halt),
        "kexec" => Request::Verb(Kind::Kexec),
        "soft-reboot" => Request::Verb(Kind::SoftReboot),
        "start" | "restart" | "reload-or-restart" | "isolate" => {
            match shutdown_unit(operands, verb == "isolate") {
                Ok(Some(kind)) => Request::Unit(kind),
                Ok(None) => return Intent::nothing(Kind::Unknown, "starts no shutdown unit"),
                Err(Unreadable) => return Intent::unclear(),
            }
        }
        // `systemctl exit` ends a container's manager; on a host, systemd refuses it.
        "exit" => return Intent::nothing(Kind::Unknown, "container exit"),
        _ => return Intent::nothing(Kind::Unknown, "not a shutdown verb"),
    };

    let kind = match request {
        // Older systemctl took a reboot argument after `reboot`; newer ones refuse any operand.
        Request::Verb(kind) if operands.len() > usize::from(kind == Kind::Reboot) => {
            return Intent::nothing(Kind::Unknown, "too many arguments")
        }
        Request::Verb(kind) | Request::Unit(kind) => kind,
    };
    if a.remote {
        return Intent::nothing(kind, "targets another machine");
    }
    if a.user {
        return Intent::nothing(Kind::Unknown, "not the system manager");
    }
    if a.offline {
        return Intent::nothing(Kind::Unknown, "refused with --root or --image");
    }
    if a.dry_run {
        return Intent::nothing(kind, "dry run");
    }

    match request {
        Request::Unit(kind) => Intent::new(kind, Effect::Now, false, true),
        // `--force` skips logind for halt, poweroff, reboot and kexec (PID 1 then
        // stops nothing and kills every process, waiting for each up to its
        // timeout); `-ff` skips systemd too, calling reboot(2) at once.
        // systemd's soft-reboot ignores it and asks logind.
        Request::Verb(kind) if a.force >= 2 && kind != Kind::SoftReboot => {
            Intent::new(kind, Effect::Now, true, true).calling_reboot()
        }
        Request::Verb(kind) if a.force == 1 && kind != Kind::SoftReboot => {
            Intent::new(kind, Effect::Now, true, true)
        }
        Request::Verb(kind) => {
            let effect = match a.when {
                None => Effect::Now,
                Some(value) => match utf8(value) {
                    None => return Intent::unclear(),
                    Some(value) => match when_effect(value, now) {
                        Some(effect) => effect,
                        None => return Intent::nothing(Kind::Unknown, "invalid --when"),
                    },
                },
            };
            Intent::new(kind, effect, false, false)
        }
    }
}

/// An argument that had to be read was not UTF-8.
pub(super) struct Unreadable;

/// The first shutdown unit among `names` (`shutdown.target` gives `Kind::Unknown`).
pub(super) fn shutdown_unit(names: &[&[u8]], isolate: bool) -> Result<Option<Kind>, Unreadable> {
    const SUFFIXES: [&str; 11] = [
        ".service",
        ".socket",
        ".target",
        ".device",
        ".mount",
        ".automount",
        ".swap",
        ".timer",
        ".path",
        ".slice",
        ".scope",
    ];
    for name in names {
        let name = utf8(name).ok_or(Unreadable)?;
        // systemctl completes a name without a unit suffix with ".target" for isolate and
        // ".service" otherwise: `start poweroff` asks for the non-existent poweroff.service.
        let mangled;
        let name = if SUFFIXES.iter().any(|s| name.ends_with(s)) {
            name
        } else {
            mangled = format!("{name}{}", if isolate { ".target" } else { ".service" });
            &mangled
        };
        let kind = match name {
            "poweroff.target" | "systemd-poweroff.service" => Kind::Poweroff,
            "reboot.target" | "ctrl-alt-del.target" | "systemd-reboot.service" => Kind::Reboot,
            "halt.target" | "systemd-halt.service" => Kind::Halt,
            "kexec.target" | "systemd-kexec.service" => Kind::Kexec,
            "soft-reboot.target" | "systemd-soft-reboot.service" => Kind::SoftReboot,
            "shutdown.target" => Kind::Unknown,
            _ => continue,
        };
        return Ok(Some(kind));
    }
    Ok(None)
}

/// `systemctl --when=` (systemd's timestamp syntax); `None` when systemctl refuses it.
pub(super) fn when_effect(value: &str, now: SystemTime) -> Option<Effect> {
    let at = if value == "now" {
        Some(now)
    } else if value == "auto" {
        None // logind picks the next maintenance window
    } else if let Some(span) = value.strip_prefix('+') {
        now.checked_add(parse_timespan(span)?)
    } else if let Some(span) = value.strip_prefix('-') {
        now.checked_sub(parse_timespan(span)?)
    } else if let Some(span) = value.strip_suffix(" left") {
        now.checked_add(parse_timespan(span)?)
    } else if let Some(span) = value.strip_suffix(" ago") {
        now.checked_sub(parse_timespan(span)?)
    } else if let Some(secs) = value.strip_prefix('@') {
        UNIX_EPOCH.checked_add(parse_timespan(secs)?)
    } else {
        // A calendar time ("tomorrow", "2025-06-01 03:00"), in the node's time zone: not
        // computed (and not validated) here.
        None
    };
    Some(match at {
        Some(at) if at <= now => Effect::Now, // logind goes ahead at once
        at => scheduled(at, value),
    })
}

/// A scheduled shutdown; a time no log could write (past year 9999, before
/// 1970) is kept as unknown, with the spec.
pub(super) fn scheduled(at: Option<SystemTime>, spec: &str) -> Effect {
    Effect::Scheduled {
        at: at.and_then(crate::timespan::writable),
        spec: spec.to_string(),
    }
}

mod sysv;
pub(super) use sysv::*;
