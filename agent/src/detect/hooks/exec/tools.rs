//! The shutdown tools' command lines, as each tool reads them. The names
//! come from `lastgasp_common::TOOLS`, which the kernel's exec filter reads
//! too.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lastgasp_common as common;

use super::{
    escape_bytes,
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
    Some(match *id {
        common::TOOL_SYSTEMCTL => Tool::Systemctl,
        common::TOOL_SHUTDOWN => Tool::Shutdown,
        common::TOOL_REBOOT => Tool::Halt(Kind::Reboot),
        common::TOOL_POWEROFF => Tool::Halt(Kind::Poweroff),
        common::TOOL_HALT => Tool::Halt(Kind::Halt),
        common::TOOL_BUSYBOX => Tool::Busybox,
        common::TOOL_INIT | common::TOOL_TELINIT => Tool::Telinit,
        common::TOOL_KEXEC => Tool::Kexec,
        common::TOOL_SYSTEMD_SHUTDOWN => Tool::SystemdShutdown,
        _ => return None,
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

pub(super) const SHUTDOWN: Spec = Spec {
    short: "HPrhkKat:fFc",
    long: &[
        ("help", Val::No),
        ("halt", Val::No),
        ("poweroff", Val::No),
        ("reboot", Val::No),
        ("kexec", Val::No),
        ("no-wall", Val::No),
        ("show", Val::No),
    ],
    lenient_long: false,
};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ShutdownAction {
    Do(Kind),
    Cancel,
    Show,
}

/// `shutdown [OPTIONS] [TIME] [WALL...]`. `cut`: the last argument is partial, which is
/// harmless only inside the wall message.
pub(super) fn shutdown(args: &[&[u8]], cut: bool, now: SystemTime) -> Intent {
    use ShutdownAction::{Cancel, Do, Show};
    let mut action = Do(Kind::Poweroff);
    let mut wall_only = false;
    let mut words = Vec::new();
    for tok in tokenize(args, &SHUTDOWN) {
        match tok {
            Tok::Bad => return Intent::unclear(),
            Tok::Pos(i, word) => words.push((i, word)),
            Tok::Long("help", _) => return Intent::nothing(Kind::Unknown, "only prints help"),
            Tok::Short(b'H', _) | Tok::Long("halt", _) => action = Do(Kind::Halt),
            Tok::Short(b'P', _) | Tok::Long("poweroff", _) => action = Do(Kind::Poweroff),
            // systemd makes -r a kexec when a kexec kernel is loaded: not in the capture.
            Tok::Short(b'r', _) | Tok::Long("reboot", _) => action = Do(Kind::Reboot),
            Tok::Short(b'K', _) | Tok::Long("kexec", _) => action = Do(Kind::Kexec),
            Tok::Short(b'h', _) if action != Do(Kind::Halt) => action = Do(Kind::Poweroff),
            Tok::Short(b'k', _) => wall_only = true,
            Tok::Short(b'c', _) => action = Cancel,
            Tok::Long("show", _) => action = Show,
            _ => {} // -a, -t SEC, -f, -F, --no-wall: accepted and ignored
        }
    }

    // With -c every word is wall text; otherwise the first is TIME.
    let (time, wall) = match words.split_first() {
        Some((&(_, time), wall)) if action != Cancel => (Some(time), wall),
        _ => (None, &words[..]),
    };
    let last_is_wall = wall
        .last()
        .is_some_and(|&(i, word)| i + 1 == args.len() && word != b"-");
    if cut && !last_is_wall {
        return Intent::unclear();
    }

    let effect = match time {
        // systemd implies "+1" (or logind's maintenance window, when one is set).
        None => shutdown_time("+1", now),
        Some(time) => match utf8(time) {
            None => return Intent::unclear(),
            Some(time) => shutdown_time(time, now),
        },
    };
    let Some(effect) = effect else {
        let time = escape_bytes(time.unwrap_or_default());
        return Intent::nothing(Kind::Unknown, format!("invalid time \"{time}\""));
    };
    match action {
        Show => Intent::nothing(Kind::Unknown, "shows the scheduled shutdown"),
        Cancel => Intent::new(Kind::Unknown, Effect::Cancel, false, false),
        Do(kind) if wall_only => Intent::nothing(kind, "-k: only sends the wall message"),
        Do(kind) => Intent::new(kind, effect, false, false),
    }
}

/// shutdown's TIME as systemd parses it: "now", "[+]MINUTES" (C integer syntax, so "010"
/// is octal), or "hh:mm" (local time, not computed here).
pub(super) fn shutdown_time(time: &str, now: SystemTime) -> Option<Effect> {
    if time == "now" {
        return Some(Effect::Now);
    }
    if !time.contains(':') {
        let minutes = c_strtoull(time)?;
        if minutes == 0 {
            return Some(Effect::Now);
        }
        let at = minutes
            .checked_mul(60)
            .and_then(|secs| now.checked_add(Duration::from_secs(secs)));
        return Some(scheduled(at, time));
    }
    let (hour, rest) = c_strtol(time)?;
    let (minute, rest) = c_strtol(rest.strip_prefix(':')?)?;
    let valid = (0..=23).contains(&hour) && (0..=59).contains(&minute) && rest.is_empty();
    valid.then(|| scheduled(None, time))
}

pub(super) const C_SPACE: [char; 6] = [' ', '\t', '\n', '\r', '\x0b', '\x0c'];

pub(super) fn strip_sign(s: &str) -> (bool, &str) {
    match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    }
}

/// The whole of `s` as C's strtoull(s, .., 0) reads it, with systemd's safe_atou64 checks.
pub(super) fn c_strtoull(s: &str) -> Option<u64> {
    let (negative, s) = strip_sign(s.trim_start_matches(C_SPACE));
    let hex = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()));
    let (radix, digits) = match hex {
        Some(h) => (16, h),
        None if s.starts_with('0') => (8, s),
        None => (10, s),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let n = u64::from_str_radix(digits, radix).ok()?;
    (!negative || n == 0).then_some(n)
}

/// The decimal number C's strtol reads at the start of `s`, and what follows it.
pub(super) fn c_strtol(s: &str) -> Option<(i64, &str)> {
    let (negative, s) = strip_sign(s.trim_start_matches(C_SPACE));
    let (digits, rest) = s.split_at(s.bytes().take_while(u8::is_ascii_digit).count());
    let n: i64 = digits.parse().ok()?;
    Some((if negative { -n } else { n }, rest))
}

pub(super) const HALT: Spec = Spec {
    short: "pfwdnih",
    long: &[
        ("help", Val::No),
        ("halt", Val::No),
        ("poweroff", Val::No),
        ("reboot", Val::No),
        ("force", Val::No),
        ("wtmp-only", Val::No),
        ("no-wtmp", Val::No),
        ("no-sync", Val::No),
        ("no-wall", Val::No),
    ],
    lenient_long: false,
};

/// systemd's `halt`, `poweroff` and `reboot`.
///
/// systemd also forces them when utmp says the runlevel is 0 or 6, which the capture
/// cannot show.
pub(super) fn halt(mut kind: Kind, args: &[&[u8]]) -> Intent {
    let (mut force, mut wtmp_only, mut operands) = (false, false, 0);
    for tok in tokenize(args, &HALT) {
        match tok {
            Tok::Bad => return Intent::unclear(),
            Tok::Pos(..) => operands += 1,
            Tok::Long("help", _) => return Intent::nothing(Kind::Unknown, "only prints help"),
            Tok::Long("halt", _) => kind = Kind::Halt,
            Tok::Short(b'p', _) | Tok::Long("poweroff", _) if kind != Kind::Reboot => {
                kind = Kind::Poweroff;
            }
            Tok::Long("reboot", _) => kind = Kind::Reboot,
            Tok::Short(b'f', _) | Tok::Long("force", _) => force = true,
            Tok::Short(b'w', _) | Tok::Long("wtmp-only", _) => wtmp_only = true,
            _ => {} // -d, -n, --no-wall; -i, -h are no-ops
        }
    }
    // A reboot may carry one argument for the firmware or boot loader (`reboot recovery`).
    if operands > usize::from(kind == Kind::Reboot) {
        return Intent::nothing(Kind::Unknown, "too many arguments");
    }
    if wtmp_only {
        return Intent::nothing(kind, "-w: only writes a wtmp record");
    }
    // Forced (`-f` counts as systemctl's `-ff`): the tool calls reboot(2) itself.
    let intent = Intent::new(kind, Effect::Now, force, force);
    if force {
        intent.calling_reboot()
    } else {
        intent
    }
}

pub(super) fn busybox(args: &[&[u8]], now: SystemTime) -> Intent {
    let Some((applet, args)) = args.split_first() else {
        return Intent::nothing(Kind::Unknown, "busybox without an applet");
    };
    match tool_named(basename(applet)) {
        Some(Tool::Halt(kind)) => busybox_halt(kind, args, now),
        _ => {
            let applet = escape_bytes(applet);
            Intent::nothing(
                Kind::Unknown,
                format!("busybox {applet} is not a shutdown applet"),
            )
        }
    }
}

pub(super) const BUSYBOX_HALT: Spec = Spec {
    short: "d:nfwi",
    long: &[],
    lenient_long: false,
};

/// busybox's `halt`, `poweroff` and `reboot`: `-f` calls reboot(2) at once; without it
/// busybox signals PID 1 (SIGUSR1, SIGUSR2, SIGTERM; systemd does not shut down on
/// those) or runs `telinit 0|6`, never asking logind.
pub(super) fn busybox_halt(kind: Kind, args: &[&[u8]], now: SystemTime) -> Intent {
    let (mut force, mut wtmp_only, mut delay) = (false, false, None);
    for tok in tokenize(args, &BUSYBOX_HALT) {
        match tok {
            Tok::Bad => return Intent::unclear(),
            Tok::Short(b'f', _) => force = true,
            Tok::Short(b'w', _) => wtmp_only = true,
            Tok::Short(b'd', seconds) => delay = seconds,
            _ => {} // -n, -i, operands: ignored
        }
    }
    if wtmp_only {
        return Intent::nothing(kind, "-w: only writes a wtmp record");
    }
    let effect = match delay.map(utf8) {
        None => Effect::Now,
        Some(None) => return Intent::unclear(),
        // busybox wants plain decimal digits, at most INT_MAX.
        Some(Some(text)) => match text.parse::<i32>() {
            Ok(0) if text.bytes().all(|b| b.is_ascii_digit()) => Effect::Now,
            Ok(secs) if secs > 0 && text.bytes().all(|b| b.is_ascii_digit()) => {
                let at = now.checked_add(Duration::from_secs(secs.unsigned_abs().into()));
                scheduled(at, &format!("-d {text}"))
            }
            _ => return Intent::nothing(Kind::Unknown, "invalid -d delay"),
        },
    };
    let intent = Intent::new(kind, effect, force, true);
    if force {
        intent.calling_reboot()
    } else {
        intent
    }
}

/// `init` and `telinit` with a runlevel. `init` is also how the kernel starts PID 1, with
/// boot parameters it did not know as arguments (`splash`): none of that is a request.
pub(super) fn telinit(args: &[&[u8]]) -> Intent {
    let mut words = args.iter().filter(|a| **a != b"--no-wall");
    let (Some(&word), None) = (words.next(), words.next()) else {
        return Intent::nothing(Kind::Unknown, "not a runlevel request");
    };
    match word {
        // Doubtful: systemd's telinit 0|6 sets the poweroff|reboot action and then runs
        // halt_main(), which (v252+) asks logind first unless forced. Taken here as
        // bypassing logind, which is the safe side for a delay lock.
        b"0" => Intent::new(Kind::Poweroff, Effect::Now, false, true),
        b"6" => Intent::new(Kind::Reboot, Effect::Now, false, true),
        b"1" | b"s" | b"S" => Intent::nothing(Kind::Unknown, "rescue mode"),
        b"2" | b"3" | b"4" | b"5" => Intent::nothing(Kind::Unknown, "runlevel change"),
        b"q" | b"Q" => Intent::nothing(Kind::Unknown, "reloads init"),
        b"u" | b"U" => Intent::nothing(Kind::Unknown, "re-executes init"),
        _ => Intent::nothing(Kind::Unknown, "not a runlevel request"),
    }
}

pub(super) const KEXEC: Spec = Spec {
    short: "hvdfixyluet:pscaS",
    long: &[
        ("help", Val::No),
        ("version", Val::No),
        ("debug", Val::No),
        ("force", Val::No),
        ("exec", Val::No),
        ("load", Val::No),
        ("unload", Val::No),
        ("load-panic", Val::No),
        ("load-preserve-context", Val::No),
        ("load-jump-back-helper", Val::No),
        ("status", Val::No),
        ("print-ckr-size", Val::No),
        ("no-ifdown", Val::No),
        ("no-sync", Val::No),
        ("no-checks", Val::No),
        ("reuse-initrd", Val::No),
        ("kexec-file-syscall", Val::No),
        ("kexec-syscall", Val::No),
        ("kexec-syscall-auto", Val::No),
        ("type", Val::Req),
        ("mem-min", Val::Req),
        ("mem-max", Val::Req),
        ("entry", Val::Req),
        ("command-line", Val::Req),
        ("append", Val::Req),
        ("initrd", Val::Req),
        ("ramdisk", Val::Req),
        ("dtb", Val::Req),
        ("module", Val::Req),
    ],
    // kexec-tools has many architecture-specific long options; they only shape a load.
    lenient_long: true,
};

/// kexec-tools' `kexec`. As there, later options override earlier ones.
pub(super) fn kexec(args: &[&[u8]]) -> Intent {
    // Without options kexec loads the kernel, then runs `shutdown -r now`.
    let (mut exec, mut via_shutdown, mut status, mut kernel) = (false, true, false, false);
    for tok in tokenize(args, &KEXEC) {
        match tok {
            Tok::Bad => return Intent::unclear(),
            Tok::Pos(..) => kernel = true,
            Tok::Short(b'h' | b'v', _) | Tok::Long("help" | "version" | "print-ckr-size", _) => {
                return Intent::nothing(Kind::Unknown, "only prints information")
            }
            // -e runs the loaded kernel, -f loads and runs it: both without shutdown(8).
            Tok::Short(b'e' | b'f', _) | Tok::Long("exec" | "force", _) => {
                (exec, via_shutdown) = (true, false);
            }
            Tok::Short(b'l' | b'p' | b'u', _)
            | Tok::Long("load" | "load-panic" | "unload" | "load-preserve-context", _) => {
                (exec, via_shutdown) = (false, false);
            }
            Tok::Short(b'S', _) | Tok::Long("status", _) => status = true,
            _ => {}
        }
    }
    if status {
        Intent::nothing(Kind::Unknown, "queries whether a kernel is loaded")
    } else if exec {
        Intent::new(Kind::Kexec, Effect::Now, true, true).calling_reboot()
    } else if via_shutdown && kernel {
        // The `shutdown -r now` it runs is seen as an exec of its own.
        Intent::new(Kind::Kexec, Effect::Now, false, false)
    } else if via_shutdown {
        Intent::nothing(Kind::Unknown, "no kernel given")
    } else {
        Intent::nothing(Kind::Unknown, "loads/unloads a kernel")
    }
}

pub(super) const SYSTEMD_SHUTDOWN: Spec = Spec {
    short: "",
    long: &[
        ("log-level", Val::Req),
        ("log-target", Val::Req),
        ("log-color", Val::Opt),
        ("log-location", Val::Opt),
        ("log-time", Val::Opt),
        ("exit-code", Val::Req),
        ("timeout", Val::Req),
    ],
    lenient_long: false,
};

/// `systemd-shutdown VERB`, which PID 1 runs at the very end of an orderly shutdown.
pub(super) fn systemd_shutdown(args: &[&[u8]]) -> Intent {
    let mut verb = None;
    for tok in tokenize(args, &SYSTEMD_SHUTDOWN) {
        match tok {
            Tok::Bad => return Intent::unclear(),
            Tok::Pos(_, word) => {
                verb.get_or_insert(word);
            }
            _ => {}
        }
    }
    let kind = match verb.unwrap_or_default() {
        b"poweroff" => Kind::Poweroff,
        b"reboot" => Kind::Reboot,
        b"halt" => Kind::Halt,
        b"kexec" => Kind::Kexec,
        // Outside a container systemd-shutdown powers off instead; the caller knows the scope.
        b"exit" => return Intent::nothing(Kind::Unknown, "container exit"),
        // systemd-shutdown refuses it and freezes a machine that is already going down.
        _ => return Intent::unclear(),
    };
    Intent::new(kind, Effect::Now, false, false)
}
