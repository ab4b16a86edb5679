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

/// The path, the binary and argv as captured (the tool is read from them).
fn record(r: &KernelRecord) -> Decoded {
    let raw = r.raw;
    let path_len = (raw.path_len as usize).min(common::PATH_LEN);
    let path = &raw.path[..path_len];
    let path = &path[..path.iter().position(|&b| b == 0).unwrap_or(path.len())];
    let args = &raw.args[..(raw.args_len as usize).min(common::ARGS_LEN)];
    let truncated = raw.flags & common::Flag::ArgsTruncated.bit() != 0;
    let argv = split_argv(args);
    let common::ToolExec { exe, .. } = raw.payload().unwrap_or_default();
    let binary = (raw.flags & common::Flag::ExecRead.bit() != 0)
        .then(|| &exe[..exe.iter().position(|&b| b == 0).unwrap_or(exe.len())]);
    let mut intent = decode_exec(path, binary, &argv, truncated, r.at);
    if raw.flags & common::Flag::ArgsMissing.bit() != 0
        && tool_named(binary.unwrap_or(basename(path))).is_some()
    {
        // The tool is known, its arguments not: assume the worst.
        intent = Intent {
            kind: Kind::Unknown,
            effect: Effect::Now,
            ..intent
        };
    }
    let mut path_s = String::from_utf8_lossy(path).into_owned();
    if raw.flags & common::Flag::PathTruncated.bit() != 0 {
        path_s.insert_str(0, "...");
    }
    Decoded {
        source: Source::Exec,
        intent,
        detail: Detail::Exec {
            path: path_s,
            binary: binary.map(|b| String::from_utf8_lossy(b).into_owned()),
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

/// Decodes an exec of a shutdown tool. `path` is the exec'd path (may be
/// just a tail of it), `binary` the file name of the binary really
/// executed (`None`: not read, and the path's name stands for it), `argv`
/// the split arguments (argv[0] first), `truncated` true when the capture
/// was cut at 256 bytes (the last element is then partial), `now` the wall
/// time of the exec (for `+N`).
///
/// The binary names the tool, never a symlink's name or a script's: a
/// `#!` script runs its interpreter, and is judged by what it runs in turn.
/// A multi-call binary (systemctl, busybox, halt, init) acts as its argv[0]
/// names it, as it does itself.
pub(crate) fn decode_exec(
    path: &[u8],
    binary: Option<&[u8]>,
    argv: &[&[u8]],
    truncated: bool,
    now: SystemTime,
) -> Intent {
    let binary = binary.unwrap_or(basename(path));
    let Some(exe) = tool_named(binary) else {
        let (name, binary) = (escape_bytes(basename(path)), escape_bytes(binary));
        return Intent::nothing(
            Kind::Unknown,
            format!("{name} runs {binary}, which is no shutdown tool"),
        );
    };
    let args = argv.get(1..).unwrap_or_default();
    let mut tool = argv
        .first()
        .and_then(|a| tool_named(basename(a)))
        .filter(|_| reads_argv0(exe))
        .unwrap_or(exe);
    // `/sbin/reboot -> busybox`: the exec'd file is busybox, argv[0] names the applet.
    if let (Tool::Halt(kind), Tool::Busybox) = (tool, exe) {
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

/// Whether the binary acts as its argv[0] names it.
fn reads_argv0(exe: Tool) -> bool {
    matches!(
        exe,
        Tool::Systemctl | Tool::Busybox | Tool::Halt(_) | Tool::Telinit
    )
}
