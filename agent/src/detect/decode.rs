//! Decodes what the kernel captured of a shutdown request (an exec of a
//! shutdown tool, a reboot(2) call, a signal to PID 1) into an [`Intent`].
//!
//! Pure functions that never panic. The semantics are systemd's (v252+)
//! unless noted. Where the capture cannot settle what happens (an unknown
//! option, a cut argument, bytes that are not UTF-8 where a word must be
//! read) the answer is [`Kind::Unknown`] with [`Effect::Now`]: assume the
//! worst; the caller keeps the raw bytes.
//!
//! With [`Effect::None`], `kind` keeps the requested kind when nothing
//! happens by design (`shutdown -k`, `systemctl -H host`, `--dry-run`), and
//! is [`Kind::Unknown`] when the request is refused or is no shutdown at all.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::signal::{Effect, Kind};

/// What a shutdown request means, decoded from what the kernel captured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intent {
    pub kind: Kind,
    /// skips service stop jobs (node gone within moments): `--force`, `-f`, `-ff`, SIGRTMIN+13.., direct reboot(2)
    pub forced: bool,
    /// does not go through logind, so no logind delay lock protects it
    pub bypasses_logind: bool,
    pub effect: Effect,
}

impl Intent {
    fn new(kind: Kind, effect: Effect, forced: bool, bypasses_logind: bool) -> Self {
        Self {
            kind,
            forced,
            bypasses_logind,
            effect,
        }
    }

    fn nothing(kind: Kind, why: impl Into<String>) -> Self {
        Self::new(kind, Effect::None { why: why.into() }, false, false)
    }

    /// The capture cannot settle what happens: assume a shutdown starts now.
    fn unclear() -> Self {
        Self::new(Kind::Unknown, Effect::Now, false, false)
    }
}

/// Splits the NUL-separated argv bytes as captured (may lack the final NUL, may be cut).
///
/// `raw` must be the captured bytes only: NUL padding after them would read
/// as empty arguments.
pub fn split_argv(raw: &[u8]) -> Vec<&[u8]> {
    if raw.is_empty() {
        return Vec::new();
    }
    let body = raw.strip_suffix(&[0]).unwrap_or(raw);
    body.split(|&b| b == 0).collect()
}

/// Escapes bytes for display: printable ASCII kept, everything else as \xNN (NUL shown as \0).
///
/// The backslash itself is shown as `\\`, so the text maps back to the bytes.
pub fn escape_bytes(raw: &[u8]) -> String {
    let mut out = String::with_capacity(raw.len());
    for &b in raw {
        match b {
            0 => out.push_str("\\0"),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out
}

/// Decodes an exec of a shutdown tool. `path` is the exec'd file (may be just a tail of it),
/// `argv` the split arguments (argv[0] first), `truncated` true when the capture was cut at
/// 256 bytes (the last element is then partial), `now` the wall time of the exec (for `+N`).
pub fn decode_exec(path: &[u8], argv: &[&[u8]], truncated: bool, now: SystemTime) -> Intent {
    let argv = script_argv(path, argv);
    let exe = tool_named(basename(path));
    let args = argv.get(1..).unwrap_or_default();
    let Some(mut tool) = argv.first().and_then(|a| tool_named(basename(a))).or(exe) else {
        let name = escape_bytes(basename(path));
        return Intent::nothing(Kind::Unknown, format!("{name} is not a shutdown tool"));
    };
    // `/sbin/reboot -> busybox`: the exec'd file is busybox, argv[0] names the applet.
    if let (Tool::Halt(kind), Some(Tool::Busybox)) = (tool, exe) {
        tool = Tool::BusyboxHalt(kind);
    }
    if truncated && tool != Tool::Shutdown {
        return Intent::unclear();
    }
    match tool {
        Tool::Systemctl => systemctl(args, now),
        Tool::Shutdown => shutdown(args, truncated, now),
        Tool::Halt(kind) => halt(kind, args),
        Tool::Busybox => busybox(args, now),
        Tool::BusyboxHalt(kind) => busybox_halt(kind, args, now),
        Tool::Telinit => telinit(args),
        Tool::Kexec => kexec(args),
        Tool::SystemdShutdown => systemd_shutdown(args),
    }
}

/// The tool's own argv. A `#!` script named like a tool (`/usr/local/bin/reboot`
/// with `#!/bin/sh`) is exec'd as its interpreter: argv is then
/// `[interpreter, (its one argument,) script path, the script's arguments...]`
/// and the exec'd path is the script's. The tool's argv starts at that path.
pub fn script_argv<'a, 'b>(path: &[u8], argv: &'a [&'b [u8]]) -> &'a [&'b [u8]] {
    if path.is_empty()
        || argv
            .first()
            .is_some_and(|a0| tool_named(basename(a0)).is_some())
    {
        return argv;
    }
    match argv.iter().skip(1).take(2).position(|a| *a == path) {
        Some(i) => &argv[i + 1..],
        None => argv,
    }
}

/// The first argument to reboot(2).
pub const REBOOT_MAGIC1: u32 = 0xfee1_dead;
/// The second arguments to reboot(2) the kernel accepts.
pub const REBOOT_MAGIC2: [u32; 4] = [672_274_793, 85_072_278, 369_367_448, 537_993_216];

pub fn valid_reboot_magic(magic1: u32, magic2: u32) -> bool {
    magic1 == REBOOT_MAGIC1 && REBOOT_MAGIC2.contains(&magic2)
}

/// Decodes reboot(2) arguments (as the raw u32 values).
pub fn decode_reboot(magic1: u32, magic2: u32, cmd: u32) -> Intent {
    let kind = match cmd {
        0x0123_4567 | 0xa1b2_c3d4 => Kind::Reboot, // RESTART, RESTART2
        0x4321_fedc => Kind::Poweroff,
        0xcdef_0123 => Kind::Halt,
        0x4558_4543 => Kind::Kexec,
        _ => Kind::Unknown,
    };
    if !valid_reboot_magic(magic1, magic2) {
        return Intent::nothing(kind, "invalid magic: the kernel refuses it");
    }
    match cmd {
        0x89ab_cdef | 0 => Intent::nothing(Kind::Unknown, "sets ctrl-alt-del behaviour"),
        0xd000_fce2 => Intent::nothing(Kind::Unknown, "hibernation"),
        _ if kind == Kind::Unknown => {
            Intent::nothing(Kind::Unknown, format!("unknown command {cmd:#010x}"))
        }
        _ => Intent::new(kind, Effect::Now, true, true),
    }
}

/// glibc's SIGRTMIN: the kernel's first two real-time signals are glibc's own.
const SIGRTMIN: u32 = 34;

/// Decodes a signal sent to PID 1 (kernel signal number), as systemd(1) handles it.
pub fn decode_signal_to_init(signo: u32) -> Intent {
    // The order of systemd's SIGRTMIN+3.. targets and SIGRTMIN+13.. immediate actions.
    fn nth(n: u32) -> Kind {
        match n {
            0 => Kind::Halt,
            1 => Kind::Poweroff,
            2 => Kind::Reboot,
            3 => Kind::Kexec,
            _ => Kind::SoftReboot,
        }
    }
    match (signo, signo.checked_sub(SIGRTMIN)) {
        // Starts ctrl-alt-del.target, normally an alias of reboot.target. More than 7 within
        // 2 s run CtrlAltDelBurstAction= instead (reboot-force by default): not told apart here.
        (2, _) => Intent::new(Kind::Reboot, Effect::Now, false, true),
        (_, Some(n @ 3..=7)) => Intent::new(nth(n - 3), Effect::Now, false, true),
        (_, Some(n @ 13..=17)) => Intent::new(nth(n - 13), Effect::Now, true, true),
        _ => Intent::nothing(
            Kind::Unknown,
            format!("{} does not shut systemd down", signal_name(signo)),
        ),
    }
}

/// The name of a kernel signal number (the generic Linux numbering of x86, arm, riscv...;
/// not that of alpha, mips, parisc or sparc).
pub fn signal_name(signo: u32) -> String {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    match signo {
        SIGRTMIN..=64 => format!("SIGRTMIN+{}", signo - SIGRTMIN),
        _ => match signo.checked_sub(1).and_then(|i| NAMES.get(i as usize)) {
            Some(name) => (*name).to_string(),
            None => format!("SIG{signo}"),
        },
    }
}

// ---------------------------------------------------------------------------
// Tools

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tool {
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

fn tool_named(name: &[u8]) -> Option<Tool> {
    Some(match name {
        b"systemctl" => Tool::Systemctl,
        b"shutdown" => Tool::Shutdown,
        b"reboot" => Tool::Halt(Kind::Reboot),
        b"poweroff" => Tool::Halt(Kind::Poweroff),
        b"halt" => Tool::Halt(Kind::Halt),
        b"busybox" => Tool::Busybox,
        b"init" | b"telinit" => Tool::Telinit,
        b"kexec" => Tool::Kexec,
        b"systemd-shutdown" => Tool::SystemdShutdown,
        _ => return None,
    })
}

fn basename(path: &[u8]) -> &[u8] {
    path.rsplit(|&b| b == b'/').next().unwrap_or(path)
}

fn utf8(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

const SYSTEMCTL: Spec = Spec {
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
enum Request {
    /// `systemctl poweroff` and the like.
    Verb(Kind),
    /// `systemctl start poweroff.target` and the like: a job on systemd, past logind.
    Unit(Kind),
}

fn systemctl(args: &[&[u8]], now: SystemTime) -> Intent {
    let (mut force, mut remote, mut system, mut offline, mut dry_run) =
        (false, false, true, false, false);
    let mut when = None;
    let mut words = Vec::new();
    // In argv order, like getopt: help and --when=cancel|show act at once.
    for tok in tokenize(args, &SYSTEMCTL) {
        match tok {
            Tok::Bad => return Intent::unclear(),
            Tok::Pos(_, word) => words.push(word),
            Tok::Short(b'h', _) | Tok::Long("help" | "version", _) => {
                return Intent::nothing(Kind::Unknown, "only prints help")
            }
            Tok::Long("when", value) => match value.unwrap_or_default() {
                b"" | b"cancel" => return Intent::new(Kind::Unknown, Effect::Cancel, false, false),
                b"show" => return Intent::nothing(Kind::Unknown, "shows the scheduled shutdown"),
                value => when = Some(value),
            },
            Tok::Short(b'f', _) | Tok::Long("force", _) => force = true,
            Tok::Short(b'H', _) | Tok::Long("host", _) => remote = true,
            Tok::Short(b'M', machine) | Tok::Long("machine", machine) => {
                remote |= machine != Some(b".host");
            }
            Tok::Long("user" | "global", _) => system = false,
            Tok::Long("system", _) => system = true,
            Tok::Short(b'C', _) | Tok::Long("capsule", _) => system = false,
            Tok::Long("root" | "image", _) => offline = true,
            Tok::Long("dry-run", _) => dry_run = true,
            _ => {}
        }
    }

    let Some((&verb, operands)) = words.split_first() else {
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
    if remote {
        return Intent::nothing(kind, "targets another machine");
    }
    if !system {
        return Intent::nothing(Kind::Unknown, "not the system manager");
    }
    if offline {
        return Intent::nothing(Kind::Unknown, "refused with --root or --image");
    }
    if dry_run {
        return Intent::nothing(kind, "dry run");
    }

    match request {
        Request::Unit(kind) => Intent::new(kind, Effect::Now, false, true),
        // `--force` skips logind for halt, poweroff, reboot and kexec (`-ff` even systemd,
        // calling reboot(2) at once); systemd's soft-reboot ignores it and asks logind.
        Request::Verb(kind) if force && kind != Kind::SoftReboot => {
            Intent::new(kind, Effect::Now, true, true)
        }
        Request::Verb(kind) => {
            let effect = match when {
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
struct Unreadable;

/// The first shutdown unit among `names` (`shutdown.target` gives `Kind::Unknown`).
fn shutdown_unit(names: &[&[u8]], isolate: bool) -> Result<Option<Kind>, Unreadable> {
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
fn when_effect(value: &str, now: SystemTime) -> Option<Effect> {
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

fn scheduled(at: Option<SystemTime>, spec: &str) -> Effect {
    Effect::Scheduled {
        at,
        spec: spec.to_string(),
    }
}

/// systemd's time span syntax: "5min", "1h 30s", "1.5d"; a bare number is seconds.
fn parse_timespan(text: &str) -> Option<Duration> {
    const USEC_PER_SEC: u64 = 1_000_000;
    fn unit_usec(unit: &str) -> Option<u64> {
        Some(match unit {
            "" | "s" | "sec" | "second" | "seconds" => USEC_PER_SEC,
            "us" | "usec" | "μs" | "µs" => 1,
            "ms" | "msec" => 1_000,
            "m" | "min" | "minute" | "minutes" => 60 * USEC_PER_SEC,
            "h" | "hr" | "hour" | "hours" => 3_600 * USEC_PER_SEC,
            "d" | "day" | "days" => 86_400 * USEC_PER_SEC,
            "w" | "week" | "weeks" => 604_800 * USEC_PER_SEC,
            "M" | "month" | "months" => 2_629_800 * USEC_PER_SEC,
            "y" | "year" | "years" => 31_557_600 * USEC_PER_SEC,
            _ => return None,
        })
    }

    let mut rest = text.trim_start();
    if rest.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let (int, after) = rest.split_at(rest.bytes().take_while(u8::is_ascii_digit).count());
        let (frac, after) = match after.strip_prefix('.') {
            Some(f) => f.split_at(f.bytes().take_while(u8::is_ascii_digit).count()),
            None => ("", after),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        let after = after.trim_start();
        let (unit, after) = after.split_at(
            after
                .find(|c: char| !c.is_alphabetic())
                .unwrap_or(after.len()),
        );
        let per = unit_usec(unit)?;
        let whole: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
        let mut part = whole.checked_mul(per)?;
        let mut scale = per;
        for digit in frac.bytes() {
            scale /= 10;
            part = part.checked_add(u64::from(digit - b'0') * scale)?;
        }
        total = total.checked_add(part)?;
        rest = after.trim_start();
    }
    Some(Duration::from_micros(total))
}

const SHUTDOWN: Spec = Spec {
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
enum ShutdownAction {
    Do(Kind),
    Cancel,
    Show,
}

/// `shutdown [OPTIONS] [TIME] [WALL...]`. `cut`: the last argument is partial, which is
/// harmless only inside the wall message.
fn shutdown(args: &[&[u8]], cut: bool, now: SystemTime) -> Intent {
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
fn shutdown_time(time: &str, now: SystemTime) -> Option<Effect> {
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

const C_SPACE: [char; 6] = [' ', '\t', '\n', '\r', '\x0b', '\x0c'];

fn strip_sign(s: &str) -> (bool, &str) {
    match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    }
}

/// The whole of `s` as C's strtoull(s, .., 0) reads it, with systemd's safe_atou64 checks.
fn c_strtoull(s: &str) -> Option<u64> {
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
fn c_strtol(s: &str) -> Option<(i64, &str)> {
    let (negative, s) = strip_sign(s.trim_start_matches(C_SPACE));
    let (digits, rest) = s.split_at(s.bytes().take_while(u8::is_ascii_digit).count());
    let n: i64 = digits.parse().ok()?;
    Some((if negative { -n } else { n }, rest))
}

const HALT: Spec = Spec {
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
fn halt(mut kind: Kind, args: &[&[u8]]) -> Intent {
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
    // Forced: systemd calls reboot(2) itself.
    Intent::new(kind, Effect::Now, force, force)
}

fn busybox(args: &[&[u8]], now: SystemTime) -> Intent {
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

const BUSYBOX_HALT: Spec = Spec {
    short: "d:nfwi",
    long: &[],
    lenient_long: false,
};

/// busybox's `halt`, `poweroff` and `reboot`: `-f` calls reboot(2) at once; without it
/// busybox signals PID 1 (SIGUSR1, SIGUSR2, SIGTERM; systemd does not shut down on
/// those) or runs `telinit 0|6`, never asking logind.
fn busybox_halt(kind: Kind, args: &[&[u8]], now: SystemTime) -> Intent {
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
    Intent::new(kind, effect, force, true)
}

/// `init` and `telinit` with a runlevel. `init` is also how the kernel starts PID 1, with
/// boot parameters it did not know as arguments (`splash`): none of that is a request.
fn telinit(args: &[&[u8]]) -> Intent {
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

const KEXEC: Spec = Spec {
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
fn kexec(args: &[&[u8]]) -> Intent {
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
        Intent::new(Kind::Kexec, Effect::Now, true, true)
    } else if via_shutdown && kernel {
        // The `shutdown -r now` it runs is seen as an exec of its own.
        Intent::new(Kind::Kexec, Effect::Now, false, false)
    } else if via_shutdown {
        Intent::nothing(Kind::Unknown, "no kernel given")
    } else {
        Intent::nothing(Kind::Unknown, "loads/unloads a kernel")
    }
}

const SYSTEMD_SHUTDOWN: Spec = Spec {
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
fn systemd_shutdown(args: &[&[u8]]) -> Intent {
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

// ---------------------------------------------------------------------------
// A getopt_long(3) reader: GNU argument permutation, `--` ending options,
// clustered short options, `--name=value`, unambiguous long-name prefixes.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Val {
    No,
    Req,
    Opt,
}

struct Spec {
    /// getopt(3) style: a letter followed by ':' takes a value, by "::" an optional one.
    short: &'static str,
    long: &'static [(&'static str, Val)],
    /// Skip unknown long options instead of refusing them.
    lenient_long: bool,
}

enum Long {
    Found(&'static str, Val),
    Unknown,
    Ambiguous,
}

impl Spec {
    fn short(&self, c: u8) -> Option<Val> {
        let s = self.short.as_bytes();
        let i = s.iter().position(|&b| b == c && c != b':')?;
        Some(match (s.get(i + 1), s.get(i + 2)) {
            (Some(b':'), Some(b':')) => Val::Opt,
            (Some(b':'), _) => Val::Req,
            _ => Val::No,
        })
    }

    fn long(&self, name: &[u8]) -> Long {
        if name.is_empty() {
            return Long::Unknown;
        }
        if let Some(&(n, v)) = self.long.iter().find(|(n, _)| n.as_bytes() == name) {
            return Long::Found(n, v);
        }
        let mut hits = self
            .long
            .iter()
            .filter(|(n, _)| n.as_bytes().starts_with(name));
        match (hits.next(), hits.next()) {
            (Some(&(n, v)), None) => Long::Found(n, v),
            (None, _) => Long::Unknown,
            _ => Long::Ambiguous,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Tok<'a> {
    Short(u8, Option<&'a [u8]>),
    Long(&'static str, Option<&'a [u8]>),
    /// A non-option argument and its index in the arguments.
    Pos(usize, &'a [u8]),
    /// An unknown or ambiguous option, a missing value, a value given to a flag.
    Bad,
}

fn tokenize<'a>(args: &[&'a [u8]], spec: &Spec) -> Vec<Tok<'a>> {
    let mut toks = Vec::new();
    let mut i = 0;
    while let Some(&arg) = args.get(i) {
        i += 1;
        if arg == b"--" {
            toks.extend(
                args.iter()
                    .enumerate()
                    .skip(i)
                    .map(|(j, &a)| Tok::Pos(j, a)),
            );
            break;
        }
        if let Some(body) = arg.strip_prefix(b"--") {
            let (name, inline) = match body.iter().position(|&b| b == b'=') {
                Some(eq) => (&body[..eq], Some(&body[eq + 1..])),
                None => (body, None),
            };
            let tok = match (spec.long(name), inline) {
                (Long::Found(n, Val::No), None) => Tok::Long(n, None),
                (Long::Found(_, Val::No), Some(_)) => Tok::Bad,
                (Long::Found(n, Val::Opt), value) => Tok::Long(n, value),
                (Long::Found(n, Val::Req), Some(value)) => Tok::Long(n, Some(value)),
                (Long::Found(n, Val::Req), None) => match args.get(i) {
                    Some(&value) => {
                        i += 1;
                        Tok::Long(n, Some(value))
                    }
                    None => Tok::Bad,
                },
                (Long::Unknown, _) if spec.lenient_long => continue,
                (Long::Unknown | Long::Ambiguous, _) => Tok::Bad,
            };
            toks.push(tok);
        } else if arg.len() > 1 && arg[0] == b'-' {
            for (j, &c) in arg.iter().enumerate().skip(1) {
                let rest = &arg[j + 1..];
                match spec.short(c) {
                    None => toks.push(Tok::Bad),
                    Some(Val::No) => {
                        toks.push(Tok::Short(c, None));
                        continue;
                    }
                    Some(Val::Opt) => toks.push(Tok::Short(c, (!rest.is_empty()).then_some(rest))),
                    Some(Val::Req) if !rest.is_empty() => toks.push(Tok::Short(c, Some(rest))),
                    Some(Val::Req) => match args.get(i) {
                        Some(&value) => {
                            i += 1;
                            toks.push(Tok::Short(c, Some(value)));
                        }
                        None => toks.push(Tok::Bad),
                    },
                }
                break;
            }
        } else {
            toks.push(Tok::Pos(i - 1, arg));
        }
    }
    toks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn bytes<'a>(argv: &[&'a str]) -> Vec<&'a [u8]> {
        argv.iter().map(|a| a.as_bytes()).collect()
    }

    /// Decodes `argv` exec'd from `path`.
    fn run(path: &str, argv: &[&str]) -> Intent {
        decode_exec(path.as_bytes(), &bytes(argv), false, now())
    }

    /// Decodes a space-separated command line; the path is argv[0] when it has a slash,
    /// else /usr/sbin/argv[0].
    fn exec(line: &str) -> Intent {
        let argv: Vec<&str> = line.split(' ').collect();
        let path = match argv[0] {
            p if p.contains('/') => p.to_string(),
            p => format!("/usr/sbin/{p}"),
        };
        run(&path, &argv)
    }

    fn logind(kind: Kind) -> Intent {
        Intent::new(kind, Effect::Now, false, false)
    }

    fn forced(kind: Kind) -> Intent {
        Intent::new(kind, Effect::Now, true, true)
    }

    /// Not forced, past logind.
    fn direct(kind: Kind) -> Intent {
        Intent::new(kind, Effect::Now, false, true)
    }

    /// Nothing happens, for any reason.
    fn none(kind: Kind) -> Intent {
        Intent::nothing(kind, "")
    }

    fn unclear() -> Intent {
        Intent::unclear()
    }

    fn cancel() -> Intent {
        Intent::new(Kind::Unknown, Effect::Cancel, false, false)
    }

    /// Scheduled `secs` from now (`None`: not computable), via logind.
    fn sched(kind: Kind, secs: Option<u64>, spec: &str) -> Intent {
        let at = secs.map(|s| now() + Duration::from_secs(s));
        Intent::new(kind, scheduled(at, spec), false, false)
    }

    /// Compares, ignoring the text of an expected `Effect::None` whose `why` is empty.
    fn assert_intent(what: &str, got: &Intent, want: &Intent) {
        match (&got.effect, &want.effect) {
            (Effect::None { .. }, Effect::None { why }) if why.is_empty() => assert_eq!(
                (got.kind, got.forced, got.bypasses_logind),
                (want.kind, want.forced, want.bypasses_logind),
                "{what}: got {got:?}"
            ),
            _ => assert_eq!(got, want, "{what}"),
        }
    }

    fn check(cases: &[(&str, Intent)]) {
        for (line, want) in cases {
            assert_intent(line, &exec(line), want);
        }
    }

    #[test]
    fn systemctl_verbs() {
        use Kind::*;
        check(&[
            ("systemctl poweroff", logind(Poweroff)),
            ("systemctl reboot", logind(Reboot)),
            ("systemctl halt", logind(Halt)),
            ("systemctl kexec", logind(Kexec)),
            ("systemctl soft-reboot", logind(SoftReboot)),
            ("/usr/bin/systemctl poweroff", logind(Poweroff)),
            ("systemctl -- poweroff", logind(Poweroff)),
            ("systemctl reboot recovery", logind(Reboot)),
            ("systemctl poweroff now", none(Unknown)),
            ("systemctl exit", none(Unknown)),
            ("systemctl", none(Unknown)),
            ("systemctl status", none(Unknown)),
            ("systemctl suspend", none(Unknown)),
            ("systemctl hibernate", none(Unknown)),
            ("systemctl list-units", none(Unknown)),
            ("systemctl stop poweroff.target", none(Unknown)),
        ]);
    }

    #[test]
    fn systemctl_force() {
        use Kind::*;
        check(&[
            ("systemctl poweroff --force", forced(Poweroff)),
            ("systemctl poweroff --force --force", forced(Poweroff)),
            ("systemctl reboot -ff", forced(Reboot)),
            ("systemctl -f -f reboot", forced(Reboot)),
            ("systemctl --force halt", forced(Halt)),
            ("systemctl kexec -f", forced(Kexec)),
            ("systemctl poweroff --forc", forced(Poweroff)), // getopt takes a unique prefix
            ("systemctl poweroff --force --when=+5min", forced(Poweroff)),
            // systemd's soft-reboot ignores --force and asks logind
            ("systemctl soft-reboot --force", logind(SoftReboot)),
        ]);
    }

    #[test]
    fn systemctl_units() {
        use Kind::*;
        check(&[
            ("systemctl start poweroff.target", direct(Poweroff)),
            ("systemctl isolate reboot.target", direct(Reboot)),
            ("systemctl isolate reboot", direct(Reboot)),
            ("systemctl restart halt.target", direct(Halt)),
            ("systemctl reload-or-restart kexec.target", direct(Kexec)),
            ("systemctl start soft-reboot.target", direct(SoftReboot)),
            ("systemctl start ctrl-alt-del.target", direct(Reboot)),
            ("systemctl start shutdown.target", direct(Unknown)),
            ("systemctl start systemd-poweroff.service", direct(Poweroff)),
            ("systemctl start systemd-poweroff", direct(Poweroff)),
            ("systemctl start systemd-reboot.service", direct(Reboot)),
            ("systemctl start systemd-halt", direct(Halt)),
            ("systemctl start systemd-kexec.service", direct(Kexec)),
            (
                "systemctl start systemd-soft-reboot.service",
                direct(SoftReboot),
            ),
            ("systemctl start nginx poweroff.target", direct(Poweroff)),
            ("systemctl --no-block start reboot.target", direct(Reboot)),
            (
                "systemctl start --job-mode replace-irreversibly reboot.target",
                direct(Reboot),
            ),
            (
                "systemctl start --job-mode=fail reboot.target",
                direct(Reboot),
            ),
            ("systemctl start -f poweroff.target", direct(Poweroff)),
            // without a suffix start means poweroff.service, isolate systemd-reboot.target
            ("systemctl start poweroff", none(Unknown)),
            ("systemctl isolate systemd-reboot", none(Unknown)),
            ("systemctl start nginx.service", none(Unknown)),
            ("systemctl start", none(Unknown)),
        ]);
    }

    #[test]
    fn systemctl_when() {
        use Kind::*;
        check(&[
            (
                "systemctl poweroff --when=+5min",
                sched(Poweroff, Some(300), "+5min"),
            ),
            (
                "systemctl reboot --when=+1h30min",
                sched(Reboot, Some(5400), "+1h30min"),
            ),
            (
                "systemctl reboot --when=+1.5h",
                sched(Reboot, Some(5400), "+1.5h"),
            ),
            (
                "systemctl reboot --when +90",
                sched(Reboot, Some(90), "+90"),
            ),
            (
                "systemctl reboot --when=@1700003600",
                sched(Reboot, Some(3600), "@1700003600"),
            ),
            ("systemctl halt --when=auto", sched(Halt, None, "auto")),
            (
                "systemctl halt --when=tomorrow",
                sched(Halt, None, "tomorrow"),
            ),
            ("systemctl poweroff --when=now", logind(Poweroff)),
            ("systemctl poweroff --when=-5min", logind(Poweroff)),
            ("systemctl poweroff --when=+x", none(Unknown)),
            ("systemctl poweroff --when=+5parsecs", none(Unknown)),
            ("systemctl poweroff --when=cancel", cancel()),
            ("systemctl poweroff --when=", cancel()),
            ("systemctl --when=cancel", cancel()),
            ("systemctl --when=cancel --frobnicate", cancel()), // systemctl stops reading there
            ("systemctl poweroff --when=show", none(Unknown)),
        ]);
        let got = run(
            "/usr/bin/systemctl",
            &["systemctl", "reboot", "--when=+5 min"],
        );
        assert_intent("+5 min", &got, &sched(Kind::Reboot, Some(300), "+5 min"));
    }

    #[test]
    fn systemctl_elsewhere_or_dry() {
        use Kind::*;
        check(&[
            ("systemctl -H host poweroff", none(Poweroff)),
            ("systemctl --host=host poweroff", none(Poweroff)),
            ("systemctl poweroff -Hroot@host", none(Poweroff)),
            ("systemctl -M container reboot", none(Reboot)),
            ("systemctl --machine container reboot", none(Reboot)),
            ("systemctl -M .host reboot", logind(Reboot)),
            ("systemctl --user poweroff", none(Unknown)),
            ("systemctl --global poweroff", none(Unknown)),
            ("systemctl --user --system poweroff", logind(Poweroff)),
            ("systemctl -C foo poweroff", none(Unknown)),
            ("systemctl --root=/mnt poweroff", none(Unknown)),
            ("systemctl --image /img poweroff", none(Unknown)),
            ("systemctl --dry-run poweroff", none(Poweroff)),
            ("systemctl -h", none(Unknown)),
            ("systemctl poweroff --help", none(Unknown)),
            ("systemctl --version", none(Unknown)),
        ]);
    }

    #[test]
    fn systemctl_options() {
        use Kind::*;
        check(&[
            ("systemctl poweroff --no-wall", logind(Poweroff)),
            ("systemctl --no-block poweroff", logind(Poweroff)),
            ("systemctl -i reboot", logind(Reboot)),
            ("systemctl reboot --check-inhibitors=no", logind(Reboot)),
            ("systemctl reboot --check-inhibitors no", logind(Reboot)),
            ("systemctl -q poweroff", logind(Poweroff)),
            ("systemctl -qi poweroff", logind(Poweroff)),
            ("systemctl poweroff --message=bye", logind(Poweroff)),
            ("systemctl --message bye poweroff", logind(Poweroff)),
            ("systemctl reboot --firmware-setup", logind(Reboot)),
            ("systemctl reboot --boot-loader-menu=10", logind(Reboot)),
            ("systemctl reboot --boot-loader-entry=foo", logind(Reboot)),
            (
                "systemctl reboot --reboot-argument=recovery",
                logind(Reboot),
            ),
            (
                "systemctl reboot --reboot-argument recovery",
                logind(Reboot),
            ),
            ("systemctl -o json reboot", logind(Reboot)),
            ("systemctl -ojson reboot", logind(Reboot)),
            ("systemctl --job-mode replace reboot", logind(Reboot)),
            ("systemctl -s KILL -n 5 reboot", logind(Reboot)),
            // refused or unknown: the caller keeps the raw
            ("systemctl poweroff --frobnicate", unclear()),
            ("systemctl -Z poweroff", unclear()),
            ("systemctl -fZ poweroff", unclear()),
            ("systemctl poweroff --no-w", unclear()), // ambiguous: --no-wall, --no-warn
            ("systemctl poweroff --force=yes", unclear()),
            ("systemctl poweroff -H", unclear()),
            ("systemctl poweroff --message", unclear()),
        ]);
    }

    #[test]
    fn shutdown_forms() {
        use Kind::*;
        check(&[
            ("shutdown", sched(Poweroff, Some(60), "+1")),
            ("shutdown -h now", logind(Poweroff)),
            ("shutdown now", logind(Poweroff)),
            ("shutdown -P now", logind(Poweroff)),
            ("shutdown --poweroff now", logind(Poweroff)),
            ("shutdown -r now", logind(Reboot)),
            ("shutdown --reboot now", logind(Reboot)),
            ("shutdown -K now", logind(Kexec)),
            ("shutdown --kexec now", logind(Kexec)),
            ("shutdown --halt now", logind(Halt)),
            ("shutdown -H -h now", logind(Halt)),
            ("shutdown -h -H now", logind(Halt)),
            ("shutdown -r -h now", logind(Poweroff)), // -h overrides all but --halt
            ("shutdown -r", sched(Reboot, Some(60), "+1")),
            ("shutdown -r +5", sched(Reboot, Some(300), "+5")),
            ("shutdown -r 5", sched(Reboot, Some(300), "5")),
            ("shutdown -r +010", sched(Reboot, Some(480), "+010")), // C syntax: octal
            ("shutdown -r +0", logind(Reboot)),
            ("shutdown +5 -r", sched(Reboot, Some(300), "+5")),
            ("shutdown -H 22:30", sched(Halt, None, "22:30")),
            ("shutdown 7:05", sched(Poweroff, None, "7:05")),
            ("shutdown 00:00", sched(Poweroff, None, "00:00")),
            ("shutdown -c", cancel()),
            ("shutdown -c bye", cancel()),
            ("shutdown -c +x", cancel()),
            ("shutdown -k now", none(Poweroff)),
            ("shutdown -k -r +5", none(Reboot)),
            ("shutdown --show", none(Unknown)),
            ("shutdown --help", none(Unknown)),
            ("shutdown --no-wall -r now", logind(Reboot)),
            ("shutdown -t 5 -r now", logind(Reboot)),
            ("shutdown -t5 -r now", logind(Reboot)),
            ("shutdown -a -f -F now", logind(Poweroff)),
            ("shutdown -r now -- -q", logind(Reboot)),
            ("shutdown +x", none(Unknown)),
            ("shutdown 25:00", none(Unknown)),
            ("shutdown 12:60", none(Unknown)),
            ("shutdown 12:", none(Unknown)),
            ("shutdown -1", unclear()), // an option to getopt
            ("shutdown -r now -q", unclear()),
            ("shutdown --frobnicate", unclear()),
            ("shutdown -t", unclear()),
        ]);
        let wall = run("/sbin/shutdown", &["shutdown", "-r", "+5", "wall msg"]);
        assert_intent("wall", &wall, &sched(Kind::Reboot, Some(300), "+5"));
    }

    #[test]
    fn halt_reboot_poweroff() {
        use Kind::*;
        check(&[
            ("halt", logind(Halt)),
            ("reboot", logind(Reboot)),
            ("poweroff", logind(Poweroff)),
            ("/sbin/halt -f", forced(Halt)),
            ("halt -f", forced(Halt)),
            ("halt -p", logind(Poweroff)),
            ("halt -p -f", forced(Poweroff)),
            ("halt --poweroff", logind(Poweroff)),
            ("reboot -p", logind(Reboot)), // -p does not turn a reboot into a power-off
            ("reboot -ff", forced(Reboot)),
            ("reboot -f -f", forced(Reboot)),
            ("reboot --force", forced(Reboot)),
            ("poweroff -f", forced(Poweroff)),
            ("poweroff --reboot", logind(Reboot)),
            ("poweroff --halt", logind(Halt)),
            ("reboot --halt", logind(Halt)),
            ("poweroff -w", none(Poweroff)),
            ("poweroff --wtmp-only", none(Poweroff)),
            ("poweroff -w -f", none(Poweroff)),
            ("reboot -d", logind(Reboot)),
            ("reboot -n", logind(Reboot)),
            ("reboot --no-wtmp --no-sync --no-wall", logind(Reboot)),
            ("halt -i -h", logind(Halt)),
            ("reboot recovery", logind(Reboot)),
            ("poweroff --reboot recovery", logind(Reboot)),
            ("reboot a b", none(Unknown)),
            ("poweroff now", none(Unknown)),
            ("reboot --help", none(Unknown)),
            ("reboot --frobnicate", unclear()),
            ("halt -x", unclear()),
        ]);
    }

    #[test]
    fn argv0_names_the_tool() {
        use Kind::*;
        assert_intent(
            "argv0 reboot",
            &run("/usr/bin/systemctl", &["reboot"]),
            &logind(Reboot),
        );
        assert_intent(
            "argv0 reboot -f",
            &run("/usr/bin/systemctl", &["reboot", "-f"]),
            &forced(Reboot),
        );
        assert_intent(
            "argv0 systemctl",
            &run("/sbin/reboot", &["systemctl", "poweroff"]),
            &logind(Poweroff),
        );
        assert_intent(
            "argv0 odd",
            &run("/sbin/reboot", &["foo", "-f"]),
            &forced(Reboot),
        );
        assert_intent(
            "argv0 path",
            &run("/x/y", &["/usr/sbin/shutdown", "now"]),
            &logind(Poweroff),
        );
        assert_intent(
            "busybox link",
            &run("/bin/busybox", &["reboot", "-f"]),
            &forced(Reboot),
        );
        assert_intent(
            "busybox link",
            &run("/bin/busybox", &["poweroff"]),
            &direct(Poweroff),
        );
        assert_intent(
            "not a tool",
            &run("/usr/bin/ls", &["ls", "-l"]),
            &none(Unknown),
        );
        assert_intent(
            "not a tool",
            &run("/usr/bin/sleep", &["sleep", "5"]),
            &none(Unknown),
        );
    }

    #[test]
    fn init_telinit() {
        use Kind::*;
        check(&[
            ("init 0", direct(Poweroff)),
            ("telinit 6", direct(Reboot)),
            ("/sbin/telinit 0", direct(Poweroff)),
            ("telinit --no-wall 0", direct(Poweroff)),
            ("init 3", none(Unknown)),
            ("init 1", none(Unknown)),
            ("telinit S", none(Unknown)),
            ("telinit s", none(Unknown)),
            ("telinit 5", none(Unknown)),
            ("telinit q", none(Unknown)),
            ("telinit U", none(Unknown)),
            ("telinit x", none(Unknown)),
            ("/sbin/init splash", none(Unknown)),
            ("/sbin/init", none(Unknown)),
            ("init --system --deserialize 23", none(Unknown)),
            ("init 0 6", none(Unknown)),
            ("init 06", none(Unknown)),
        ]);
    }

    #[test]
    fn kexec_forms() {
        use Kind::*;
        check(&[
            ("kexec -e", forced(Kexec)),
            ("kexec --exec", forced(Kexec)),
            ("kexec -x -e", forced(Kexec)),
            ("kexec -f /boot/vmlinuz", forced(Kexec)),
            ("kexec -l /boot/vmlinuz -e", forced(Kexec)),
            ("kexec -l /boot/vmlinuz", none(Unknown)),
            ("kexec -e -l /boot/vmlinuz", none(Unknown)),
            (
                "kexec -l /boot/vmlinuz --append=root=/dev/sda1 --initrd=/boot/initrd",
                none(Unknown),
            ),
            (
                "kexec -l /boot/vmlinuz --initrd /boot/initrd --reuse-cmdline",
                none(Unknown),
            ),
            ("kexec --noefi -l /boot/vmlinuz", none(Unknown)),
            ("kexec -t bzImage -l /boot/vmlinuz", none(Unknown)),
            ("kexec -p /boot/vmlinuz", none(Unknown)),
            ("kexec --load-panic /boot/vmlinuz", none(Unknown)),
            ("kexec -u", none(Unknown)),
            ("kexec -s -l /boot/vmlinuz", none(Unknown)),
            ("kexec -c -l /boot/vmlinuz", none(Unknown)),
            ("kexec -S", none(Unknown)),
            ("kexec -h", none(Unknown)),
            ("kexec", none(Unknown)),
            // loads, then runs `shutdown -r now`
            ("kexec /boot/vmlinuz", logind(Kexec)),
            ("kexec -Z", unclear()),
        ]);
    }

    #[test]
    fn busybox_applets() {
        use Kind::*;
        let in_secs = |kind, secs: u64, forced: bool| {
            let at = Some(now() + Duration::from_secs(secs));
            Intent::new(kind, scheduled(at, &format!("-d {secs}")), forced, true)
        };
        check(&[
            ("busybox reboot -f", forced(Reboot)),
            ("/bin/busybox reboot -f", forced(Reboot)),
            ("busybox /sbin/reboot -f", forced(Reboot)),
            ("busybox reboot", direct(Reboot)),
            ("busybox halt", direct(Halt)),
            ("busybox poweroff -n", direct(Poweroff)),
            ("busybox poweroff -d 10", in_secs(Poweroff, 10, false)),
            ("busybox halt -d10 -f", in_secs(Halt, 10, true)),
            ("busybox poweroff -d 0", direct(Poweroff)),
            ("busybox halt -w", none(Halt)),
            ("busybox poweroff -d x", none(Unknown)),
            ("busybox poweroff -d -5", none(Unknown)),
            ("busybox poweroff -d", unclear()),
            ("busybox reboot --force", unclear()),
            ("busybox ls", none(Unknown)),
            ("busybox shutdown", none(Unknown)),
            ("busybox", none(Unknown)),
        ]);
    }

    #[test]
    fn systemd_shutdown_forms() {
        use Kind::*;
        check(&[
            (
                "/usr/lib/systemd/systemd-shutdown poweroff --timeout 90s",
                logind(Poweroff),
            ),
            (
                "/usr/lib/systemd/systemd-shutdown reboot --log-level info --log-target kmsg \
                 --log-color --log-location --log-time=yes --exit-code 0",
                logind(Reboot),
            ),
            ("/usr/lib/systemd/systemd-shutdown halt", logind(Halt)),
            (
                "/usr/lib/systemd/systemd-shutdown kexec --timeout=90s",
                logind(Kexec),
            ),
            (
                "/usr/lib/systemd/systemd-shutdown exit --exit-code 3",
                none(Unknown),
            ),
            ("/usr/lib/systemd/systemd-shutdown", unclear()),
            ("/usr/lib/systemd/systemd-shutdown frobnicate", unclear()),
            (
                "/usr/lib/systemd/systemd-shutdown poweroff --bogus",
                unclear(),
            ),
        ]);
    }

    #[test]
    fn not_utf8() {
        let now = now();
        let argv: [&[u8]; 2] = [b"systemctl", b"\xffpoweroff"];
        assert_eq!(
            decode_exec(b"/usr/bin/systemctl", &argv, false, now),
            unclear()
        );
        let argv: [&[u8]; 3] = [b"systemctl", b"start", b"\xff.target"];
        assert_eq!(
            decode_exec(b"/usr/bin/systemctl", &argv, false, now),
            unclear()
        );
        let argv: [&[u8]; 3] = [b"systemctl", b"poweroff", b"--when=+\xff"];
        assert_eq!(
            decode_exec(b"/usr/bin/systemctl", &argv, false, now),
            unclear()
        );
        let argv: [&[u8]; 3] = [b"systemctl", b"poweroff", b"--\xff"];
        assert_eq!(
            decode_exec(b"/usr/bin/systemctl", &argv, false, now),
            unclear()
        );
        let argv: [&[u8]; 3] = [b"shutdown", b"-r", b"+\xff"];
        assert_eq!(decode_exec(b"/sbin/shutdown", &argv, false, now), unclear());
        let argv: [&[u8]; 4] = [b"busybox", b"poweroff", b"-d", b"\xff"];
        assert_eq!(decode_exec(b"/bin/busybox", &argv, false, now), unclear());
        // Wall text and reboot arguments are not read.
        let argv: [&[u8]; 4] = [b"shutdown", b"-r", b"now", b"\xff\xfe bye"];
        assert_eq!(
            decode_exec(b"/sbin/shutdown", &argv, false, now),
            logind(Kind::Reboot)
        );
        let argv: [&[u8]; 2] = [b"reboot", b"\xff"];
        assert_eq!(
            decode_exec(b"/sbin/reboot", &argv, false, now),
            logind(Kind::Reboot)
        );
        let argv: [&[u8]; 2] = [b"\xff", b"-f"];
        assert_eq!(
            decode_exec(b"/sbin/halt", &argv, false, now),
            forced(Kind::Halt)
        );
    }

    #[test]
    fn truncated_capture() {
        use Kind::*;
        let cut =
            |path: &str, argv: &[&str]| decode_exec(path.as_bytes(), &bytes(argv), true, now());
        assert_eq!(
            cut("/usr/bin/systemctl", &["systemctl", "poweroff", "--forc"]),
            unclear()
        );
        assert_eq!(
            cut("/usr/bin/systemctl", &["systemctl", "status", "ngi"]),
            unclear()
        );
        assert_eq!(cut("/sbin/reboot", &["reboot", "-f"]), unclear());
        assert_eq!(cut("/sbin/init", &["init", "0"]), unclear());
        assert_eq!(cut("/bin/busybox", &["busybox", "reb"]), unclear());
        assert_eq!(cut("/sbin/kexec", &["kexec", "-e"]), unclear());
        assert_eq!(cut("/sbin/reboot", &[]), unclear());
        assert_eq!(cut("/sbin/shutdown", &["shutd"]), unclear());
        assert_eq!(cut("/sbin/shutdown", &["shutdown", "-r", "+"]), unclear());
        assert_eq!(cut("/sbin/shutdown", &["shutdown", "-r", "-"]), unclear());
        assert_eq!(
            cut("/sbin/shutdown", &["shutdown", "-r", "now", "-"]),
            unclear()
        );
        assert_eq!(
            cut("/sbin/shutdown", &["shutdown", "-r", "now", "-k"]),
            unclear()
        );
        assert_eq!(cut("/sbin/shutdown", &["shutdown", "-t"]), unclear());
        // Cut inside the wall message: still decoded.
        let got = cut(
            "/sbin/shutdown",
            &["shutdown", "-r", "+5", "going down for maint"],
        );
        assert_eq!(got, sched(Reboot, Some(300), "+5"));
        let got = cut("/sbin/shutdown", &["shutdown", "-h", "now", "a", "b", "c"]);
        assert_eq!(got, logind(Poweroff));
        assert_eq!(
            cut("/sbin/shutdown", &["shutdown", "-c", "never mi"]),
            cancel()
        );
        // Not a shutdown tool at all: the exec'd file decides.
        assert_intent("cut ls", &cut("/usr/bin/ls", &["ls", "-"]), &none(Unknown));
    }

    #[test]
    fn empty_argv() {
        use Kind::*;
        let empty = |path: &str| decode_exec(path.as_bytes(), &[], false, now());
        assert_eq!(empty("/sbin/reboot"), logind(Reboot));
        assert_eq!(empty("in/poweroff"), logind(Poweroff)); // a tail of the path
        assert_eq!(empty("/sbin/shutdown"), sched(Poweroff, Some(60), "+1"));
        assert_intent("systemctl", &empty("/usr/bin/systemctl"), &none(Unknown));
        assert_intent("busybox", &empty("/bin/busybox"), &none(Unknown));
        assert_intent("init", &empty("/sbin/init"), &none(Unknown));
        assert_intent("nothing", &empty(""), &none(Unknown));
        assert_intent("dir", &empty("/sbin/"), &none(Unknown));
    }

    /// xorshift64: a tiny deterministic generator for the garbage tests.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn garbage_never_panics() {
        const WORDS: &[&[u8]] = &[
            b"systemctl",
            b"shutdown",
            b"reboot",
            b"poweroff",
            b"halt",
            b"init",
            b"telinit",
            b"kexec",
            b"busybox",
            b"systemd-shutdown",
            b"start",
            b"isolate",
            b"poweroff.target",
            b"-",
            b"--",
            b"-f",
            b"-ff",
            b"--force",
            b"--when",
            b"--when=",
            b"--when=+5min",
            b"--when=+",
            b"--when=@",
            b"+",
            b"+5",
            b"+0x",
            b"0x",
            b"-0",
            b"now",
            b":",
            b"23:59",
            b"-d",
            b"-t",
            b"-H",
            b"-M",
            b"--job-mode",
            b"=",
            b"--=",
            b"-=",
            b"\xff",
            b"\xce\xbc",
            b"0",
            b"6",
            b"-e",
            b"-l",
            b"--append",
            b"--log-color=",
            b"1.",
            b".5",
            b"99999999999999999999",
        ];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..4000 {
            let raw: Vec<u8> = (0..rng.below(300)).map(|_| rng.next() as u8).collect();
            let argv = split_argv(&raw);
            let _ = escape_bytes(&raw);
            let _ = decode_exec(&raw, &argv, round % 2 == 0, now());
            let _ = decode_exec(b"/usr/bin/systemctl", &argv, round % 3 == 0, now());

            let argv: Vec<&[u8]> = (0..rng.below(8))
                .map(|_| WORDS[rng.below(WORDS.len())])
                .collect();
            let path = WORDS[rng.below(WORDS.len())];
            let _ = decode_exec(path, &argv, round % 5 == 0, now());
            let _ = decode_exec(path, &argv, false, UNIX_EPOCH);
            let far = UNIX_EPOCH + Duration::from_secs(i64::MAX as u64 / 4);
            let _ = decode_exec(path, &argv, false, far);

            let (a, b, c) = (rng.next() as u32, rng.next() as u32, rng.next() as u32);
            let _ = decode_reboot(a, b, c);
            let _ = decode_reboot(REBOOT_MAGIC1, REBOOT_MAGIC2[round % 4], c);
            let _ = decode_signal_to_init(a);
            let _ = signal_name(b);
        }
    }

    #[test]
    fn reboot_syscall() {
        use Kind::*;
        const M1: u32 = REBOOT_MAGIC1;
        const M2: u32 = 672_274_793;
        let cases = [
            (0x0123_4567, forced(Reboot)),
            (0xa1b2_c3d4, forced(Reboot)),
            (0x4321_fedc, forced(Poweroff)),
            (0xcdef_0123, forced(Halt)),
            (0x4558_4543, forced(Kexec)),
            (0x89ab_cdef, none(Unknown)),
            (0x0000_0000, none(Unknown)),
            (0xd000_fce2, none(Unknown)),
            (0x1234_5678, none(Unknown)),
        ];
        for (cmd, want) in cases {
            assert_intent(&format!("{cmd:#x}"), &decode_reboot(M1, M2, cmd), &want);
        }
        for m2 in [672_274_793, 85_072_278, 369_367_448, 537_993_216] {
            assert!(valid_reboot_magic(M1, m2));
            assert_eq!(decode_reboot(M1, m2, 0x4321_fedc), forced(Poweroff));
        }
        assert_eq!(
            decode_reboot(M1, M2, 0xd000_fce2).effect,
            Effect::None {
                why: "hibernation".into()
            }
        );
        assert_eq!(
            decode_reboot(M1, M2, 0).effect,
            Effect::None {
                why: "sets ctrl-alt-del behaviour".into()
            }
        );
        assert_eq!(
            decode_reboot(M1, M2, 0x1234_5678).effect,
            Effect::None {
                why: "unknown command 0x12345678".into()
            }
        );
        // Bad magic: the kernel refuses, the kind is still decoded.
        let refused = Effect::None {
            why: "invalid magic: the kernel refuses it".into(),
        };
        for (m1, m2) in [(0xfee1_deae, M2), (M1, 0), (M1, 672_274_794), (0, 0)] {
            assert!(!valid_reboot_magic(m1, m2));
            let got = decode_reboot(m1, m2, 0x0123_4567);
            assert_eq!(got, Intent::new(Reboot, refused.clone(), false, false));
        }
        assert_eq!(decode_reboot(0, 0, 0x4558_4543).kind, Kexec);
        assert_eq!(decode_reboot(0, 0, 0xd000_fce2).kind, Unknown);
    }

    #[test]
    fn signals_to_init() {
        use Kind::*;
        let cases = [
            (2, direct(Reboot)),
            (37, direct(Halt)),
            (38, direct(Poweroff)),
            (39, direct(Reboot)),
            (40, direct(Kexec)),
            (41, direct(SoftReboot)),
            (47, forced(Halt)),
            (48, forced(Poweroff)),
            (49, forced(Reboot)),
            (50, forced(Kexec)),
            (51, forced(SoftReboot)),
        ];
        for (signo, want) in cases {
            assert_eq!(decode_signal_to_init(signo), want, "{}", signal_name(signo));
        }
        for signo in [
            0,
            1,
            9,
            10,
            12,
            15,
            30,
            34,
            35,
            36,
            42,
            46,
            52,
            54,
            64,
            65,
            u32::MAX,
        ] {
            assert_intent(
                &signal_name(signo),
                &decode_signal_to_init(signo),
                &none(Unknown),
            );
        }
        let named = [
            (1, "SIGHUP"),
            (2, "SIGINT"),
            (9, "SIGKILL"),
            (15, "SIGTERM"),
            (30, "SIGPWR"),
            (31, "SIGSYS"),
            (34, "SIGRTMIN+0"),
            (38, "SIGRTMIN+4"),
            (49, "SIGRTMIN+15"),
            (64, "SIGRTMIN+30"),
            (0, "SIG0"),
            (32, "SIG32"),
            (33, "SIG33"),
            (65, "SIG65"),
        ];
        for (signo, name) in named {
            assert_eq!(signal_name(signo), name);
        }
    }

    #[test]
    fn argv_splitting_and_escaping() {
        let none: Vec<&[u8]> = Vec::new();
        assert_eq!(split_argv(b""), none);
        assert_eq!(split_argv(b"a\0b\0"), [&b"a"[..], b"b"]);
        assert_eq!(split_argv(b"a\0b"), [&b"a"[..], b"b"]);
        assert_eq!(split_argv(b"\0"), [&b""[..]]);
        assert_eq!(split_argv(b"a\0\0b\0"), [&b"a"[..], b"", b"b"]);
        assert_eq!(escape_bytes(b"ab c~"), "ab c~");
        assert_eq!(escape_bytes(b"a\0b\xff\n\\x"), "a\\0b\\xff\\x0a\\\\x");
        assert_eq!(escape_bytes(b""), "");
    }

    #[test]
    fn getopt_reader() {
        let args = bytes(&["-ab", "--c=1", "x", "--", "-d"]);
        let spec = Spec {
            short: "ab",
            long: &[("cat", Val::Req)],
            lenient_long: false,
        };
        let toks = tokenize(&args, &spec);
        assert_eq!(
            toks,
            [
                Tok::Short(b'a', None),
                Tok::Short(b'b', None),
                Tok::Long("cat", Some(&b"1"[..])),
                Tok::Pos(2, b"x"),
                Tok::Pos(4, b"-d"),
            ]
        );
        assert_eq!(tokenize(&bytes(&["-:"]), &spec), [Tok::Bad]);
        assert_eq!(tokenize(&bytes(&["--"]), &spec), []);
    }

    #[test]
    fn timespans() {
        let secs = |s| parse_timespan(s).map(|d| d.as_secs_f64());
        assert_eq!(secs("5min"), Some(300.0));
        assert_eq!(secs("5 min"), Some(300.0));
        assert_eq!(secs("1h 30min 10s"), Some(5410.0));
        assert_eq!(secs("90"), Some(90.0));
        assert_eq!(secs("1.5s"), Some(1.5));
        assert_eq!(secs("500ms"), Some(0.5));
        assert_eq!(secs("2d"), Some(172_800.0));
        assert_eq!(secs("1w"), Some(604_800.0));
        assert_eq!(secs("1M"), Some(2_629_800.0));
        assert_eq!(secs("1y"), Some(31_557_600.0));
        assert_eq!(secs(""), None);
        assert_eq!(secs("min"), None);
        assert_eq!(secs("5 parsecs"), None);
        assert_eq!(secs("99999999999999999999y"), None);
    }

    #[test]
    fn a_script_named_like_a_tool_is_read_past_its_interpreter() {
        let now = SystemTime::UNIX_EPOCH;
        for argv in [
            vec![&b"/bin/sh"[..], b"/usr/local/bin/reboot", b"-ff"],
            vec![
                &b"/usr/bin/env"[..],
                b"bash",
                b"/usr/local/bin/reboot",
                b"-ff",
            ],
            vec![&b"/bin/bash"[..], b"-e", b"/usr/local/bin/reboot", b"-ff"],
        ] {
            let i = decode_exec(b"/usr/local/bin/reboot", &argv, false, now);
            assert_eq!(
                (i.kind, i.forced, &i.effect),
                (Kind::Reboot, true, &Effect::Now),
                "{argv:?}"
            );
        }
        // Not a script: argv[0] names the tool, nothing shifts.
        let argv = [&b"systemctl"[..], b"reboot"];
        assert_eq!(script_argv(b"/usr/bin/systemctl", &argv), &argv[..]);
    }
}
