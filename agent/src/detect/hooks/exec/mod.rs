//! `sched_process_exec` (`agent-ebpf/src/exec.rs`): an exec of a shutdown
//! tool, with its first arguments; `tools` reads each tool's command line.
use std::{fmt::Write as _, time::SystemTime};

use lastgasp_common::{self as common};

use super::{Attach, Decoded, Hook, Intent, KernelRecord};
use crate::signal::{Detail, Effect, Kind, Source};

mod getopt;
#[cfg(test)]
mod tests;
mod tools;

use tools::{
    basename, busybox, busybox_halt, halt, kexec, shutdown, systemctl, systemd_shutdown, telinit,
    tool_named, Tool,
};

pub(crate) const HOOK: Hook = Hook {
    source: common::RecordSource::Exec,
    attach: Attach::Tracepoint {
        prog: "sched_process_exec",
        category: "sched",
        name: "sched_process_exec",
        required: false,
    },
    decode: record,
};

/// The path and argv as captured (the tool is read from them).
fn record(r: &KernelRecord) -> Decoded {
    let raw = r.raw;
    let path_len = (raw.path_len as usize).min(common::PATH_LEN);
    let path = &raw.path[..path_len];
    let path = &path[..path.iter().position(|&b| b == 0).unwrap_or(path.len())];
    let args = &raw.args[..(raw.args_len as usize).min(common::ARGS_LEN)];
    let truncated = raw.flags & common::FLAG_ARGS_TRUNCATED != 0;
    let argv = split_argv(args);
    let mut intent = decode_exec(path, &argv, truncated, r.at);
    if raw.flags & common::FLAG_ARGS_MISSING != 0 {
        // The tool is known, its arguments not: assume the worst.
        intent = Intent {
            kind: Kind::Unknown,
            effect: Effect::Now,
            ..intent
        };
    }
    let mut path_s = String::from_utf8_lossy(path).into_owned();
    if raw.flags & common::FLAG_PATH_TRUNCATED != 0 {
        path_s.insert_str(0, "...");
    }
    Decoded {
        source: Source::Exec,
        intent,
        detail: Detail::Exec {
            path: path_s,
            argv: argv
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect(),
            raw: escape_bytes(args),
            truncated,
        },
        scope: None,
    }
}

/// Splits the NUL-separated argv bytes as captured (may lack the final NUL, may be cut).
///
/// `raw` must be the captured bytes only: NUL padding after them would read
/// as empty arguments.
pub(crate) fn split_argv(raw: &[u8]) -> Vec<&[u8]> {
    if raw.is_empty() {
        return Vec::new();
    }
    let body = raw.strip_suffix(&[0]).unwrap_or(raw);
    body.split(|&b| b == 0).collect()
}

/// Escapes bytes for display: printable ASCII kept, everything else as \xNN (NUL shown as \0).
///
/// The backslash itself is shown as `\\`, so the text maps back to the bytes.
pub(crate) fn escape_bytes(raw: &[u8]) -> String {
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
pub(crate) fn decode_exec(path: &[u8], argv: &[&[u8]], truncated: bool, now: SystemTime) -> Intent {
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
pub(crate) fn script_argv<'a, 'b>(path: &[u8], argv: &'a [&'b [u8]]) -> &'a [&'b [u8]] {
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
