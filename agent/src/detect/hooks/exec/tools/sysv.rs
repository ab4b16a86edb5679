//! The System V style tools' command lines (`shutdown`, `halt`, busybox,
//! `telinit`, `kexec`, `systemd-shutdown`), as each tool reads them.
use std::time::{Duration, SystemTime};

use super::{
    super::{
        escape_bytes,
        getopt::{tokenize, Spec, Tok, Val},
        Intent,
    },
    basename, scheduled, tool_named, utf8, Tool,
};
use crate::signal::{Effect, Kind};

pub(crate) const SHUTDOWN: Spec = Spec {
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
pub(crate) enum ShutdownAction {
    Do(Kind),
    Cancel,
    Show,
}

/// `shutdown [OPTIONS] [TIME] [WALL...]`. `cut`: the last argument is partial, which is
/// harmless only inside the wall message.
pub(crate) fn shutdown(args: &[&[u8]], cut: bool, now: SystemTime) -> Intent {
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
pub(crate) fn shutdown_time(time: &str, now: SystemTime) -> Option<Effect> {
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

pub(crate) const C_SPACE: [char; 6] = [' ', '\t', '\n', '\r', '\x0b', '\x0c'];

pub(crate) fn strip_sign(s: &str) -> (bool, &str) {
    match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    }
}

/// The whole of `s` as C's strtoull(s, .., 0) reads it, with systemd's safe_atou64 checks.
pub(crate) fn c_strtoull(s: &str) -> Option<u64> {
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
pub(crate) fn c_strtol(s: &str) -> Option<(i64, &str)> {
    let (negative, s) = strip_sign(s.trim_start_matches(C_SPACE));
    let (digits, rest) = s.split_at(s.bytes().take_while(u8::is_ascii_digit).count());
    let n: i64 = digits.parse().ok()?;
    Some((if negative { -n } else { n }, rest))
}

pub(crate) const HALT: Spec = Spec {
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
pub(crate) fn halt(mut kind: Kind, args: &[&[u8]]) -> Intent {
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

pub(crate) fn busybox(args: &[&[u8]], now: SystemTime) -> Intent {
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

pub(crate) const BUSYBOX_HALT: Spec = Spec {
    short: "d:nfwi",
    long: &[],
    lenient_long: false,
};

/// busybox's `halt`, `poweroff` and `reboot`: `-f` calls reboot(2) at once; without it
/// busybox signals PID 1 (SIGUSR1, SIGUSR2, SIGTERM; systemd does not shut down on
/// those) or runs `telinit 0|6`, never asking logind.
pub(crate) fn busybox_halt(kind: Kind, args: &[&[u8]], now: SystemTime) -> Intent {
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
pub(crate) fn telinit(args: &[&[u8]]) -> Intent {
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

pub(crate) const KEXEC: Spec = Spec {
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
pub(crate) fn kexec(args: &[&[u8]]) -> Intent {
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

pub(crate) const SYSTEMD_SHUTDOWN: Spec = Spec {
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
pub(crate) fn systemd_shutdown(args: &[&[u8]]) -> Intent {
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
