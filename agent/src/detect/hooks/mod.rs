//! The eBPF hooks in user space, one file per hook beside its kernel file
//! (`agent-ebpf/src/<hook>.rs`): how it attaches, and how its records read.
//!
//! Decoding is pure and never panics. The semantics are systemd's (v252+)
//! unless noted. Where the capture cannot settle what happens (an unknown
//! option, a cut argument, bytes that are not UTF-8 where a word must be
//! read) the answer is [`Kind::Unknown`] with [`Effect::Now`]: assume the
//! worst; the caller keeps the raw bytes.
//!
//! With [`Effect::None`], `kind` keeps the requested kind when nothing
//! happens by design (`shutdown -k`, `systemctl -H host`, `--dry-run`), and
//! is [`Kind::Unknown`] when the request is refused or is no shutdown at all.
use std::{
    fmt,
    time::{Duration, SystemTime},
};

use lastgasp_common::{self as common, RawEvent, RecordSource};

use crate::signal::{Actor, Detail, Effect, Kind, Parent, Scope, ShutdownSignal, Source};

pub(crate) mod exec;
pub(crate) mod kernel;
pub(crate) mod reboot;
pub(crate) mod reboot_exit;
pub(crate) mod signal;
pub mod tool_end;

/// Every hook: adding one is a line here.
pub const HOOKS: &[Hook] = &[
    reboot::HOOK,
    reboot_exit::HOOK,
    exec::HOOK,
    signal::HOOK,
    tool_end::HOOK,
    kernel::HOOK,
];

/// One hook: the records it writes, where it attaches, and how its records
/// read (each its own payload type, `lastgasp_common::Payload`).
pub struct Hook {
    pub source: RecordSource,
    pub attach: Attach,
    pub decode: fn(&KernelRecord) -> Decoded,
}

pub enum Attach {
    /// A tracepoint program; without a `required` one lastgasp cannot work.
    Tracepoint {
        prog: &'static str,
        category: &'static str,
        name: &'static str,
        required: bool,
    },
    /// Kernel functions: `fentry_<f>` first, `kprobe_<f>` second.
    KernelFunctions(&'static [&'static str]),
}

impl Attach {
    /// The eBPF programs this attaches (by name in the object).
    pub fn programs(&self) -> Vec<String> {
        match self {
            Attach::Tracepoint { prog, .. } => vec![prog.to_string()],
            Attach::KernelFunctions(fs) => fs
                .iter()
                .flat_map(|f| [format!("fentry_{f}"), format!("kprobe_{f}")])
                .collect(),
        }
    }

    /// The tracepoints of every hook: (program, category, name, required).
    pub fn tracepoints() -> impl Iterator<Item = (&'static str, &'static str, &'static str, bool)> {
        HOOKS.iter().filter_map(|h| match h.attach {
            Attach::Tracepoint {
                prog,
                category,
                name,
                required,
            } => Some((prog, category, name, required)),
            Attach::KernelFunctions(_) => None,
        })
    }
}

/// A hook's line of the start report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookState {
    Armed,
    /// Armed, but without part of what it captures.
    Degraded(String),
    Unavailable(String),
}

#[derive(Clone, Debug)]
pub struct HookReport {
    pub hook: String,
    pub attach: String,
    pub state: HookState,
}

impl fmt::Display for HookState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookState::Armed => write!(f, "armed"),
            HookState::Degraded(why) => write!(f, "armed, degraded: {why}"),
            HookState::Unavailable(why) => write!(f, "unavailable: {why}"),
        }
    }
}

impl HookState {
    /// The state's name in logs and metrics: armed, degraded, unavailable.
    pub fn name(&self) -> &'static str {
        match self {
            HookState::Armed => "armed",
            HookState::Degraded(_) => "degraded",
            HookState::Unavailable(_) => "unavailable",
        }
    }

    pub fn why(&self) -> Option<&str> {
        match self {
            HookState::Armed => None,
            HookState::Degraded(w) | HookState::Unavailable(w) => Some(w),
        }
    }
}

impl fmt::Display for HookReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:<20} {:<34} {}", self.hook, self.attach, self.state)
    }
}

/// What every record carries, read once for its hook.
pub struct KernelRecord<'a> {
    pub raw: &'a RawEvent,
    /// The record's time on the wall clock.
    pub at: SystemTime,
    /// In the node's PID namespace (else a container's).
    pub in_node: bool,
    pub actor: &'a Actor,
}

/// A hook's reading of one record.
pub struct Decoded {
    pub source: Source,
    pub intent: Intent,
    pub detail: Detail,
    /// `Some` when the hook knows the scope better than the caller's PID
    /// namespace does (a signal to the node's PID 1 is about the node).
    pub scope: Option<Scope>,
}

/// What a shutdown request means, decoded from what the kernel captured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intent {
    pub kind: Kind,
    /// skips service stop jobs (node gone within moments): `--force`, `-f`, `-ff`, SIGRTMIN+13.., direct reboot(2)
    pub forced: bool,
    /// does not go through logind, so no logind delay lock protects it
    pub bypasses_logind: bool,
    /// the tool calls reboot(2) itself at once (no service manager between)
    pub calls_reboot: bool,
    pub effect: Effect,
}

impl Intent {
    pub(crate) fn new(kind: Kind, effect: Effect, forced: bool, bypasses_logind: bool) -> Self {
        Self {
            kind,
            forced,
            bypasses_logind,
            calls_reboot: false,
            effect,
        }
    }

    /// The tool itself calls reboot(2), at once.
    pub(crate) fn calling_reboot(self) -> Self {
        Self {
            calls_reboot: true,
            ..self
        }
    }

    pub(crate) fn nothing(kind: Kind, why: impl Into<String>) -> Self {
        Self::new(kind, Effect::None { why: why.into() }, false, false)
    }

    /// The capture cannot settle what happens: assume a shutdown starts now.
    pub(crate) fn unclear() -> Self {
        Self::new(Kind::Unknown, Effect::Now, false, false)
    }
}

/// Turns one kernel record into a signal. Pure: `now` is (wall, boottime ns).
pub fn decode(raw: &RawEvent, now: (SystemTime, u64)) -> ShutdownSignal {
    let at = now.0 - Duration::from_nanos(now.1.saturating_sub(raw.boot_ns));
    let in_node = raw.flags & common::Flag::NodePidns.bit() != 0;
    let creds = raw.flags & common::Flag::Creds.bit() != 0;
    let exec = raw.source == RecordSource::Exec as u32;
    let actor = Actor {
        pid: raw.tgid,
        ns_pid: raw.ns_tgid,
        comm: cstr(&raw.comm),
        uid: raw.uid,
        euid: creds.then_some(raw.euid),
        cap_sys_boot: creds.then_some(raw.flags & common::Flag::CapSysBoot.bit() != 0),
        borrowed: (exec && raw.flags & common::Flag::ExecRead.bit() != 0)
            .then_some(raw.flags & common::Flag::Borrowed.bit() != 0),
        cgroup_id: raw.cgroup_id,
        parents: if raw.ppid != 0 {
            vec![Parent {
                pid: raw.ppid,
                comm: cstr(&raw.parent_comm),
            }]
        } else {
            Vec::new()
        },
        ..Default::default()
    };
    let record = KernelRecord {
        raw,
        at,
        in_node,
        actor: &actor,
    };
    let hook = raw
        .source()
        .and_then(|src| HOOKS.iter().find(|h| h.source == src));
    let d = match hook {
        Some(h) => (h.decode)(&record),
        None => Decoded {
            source: Source::KernelHook,
            intent: Intent::nothing(
                Kind::Unknown,
                format!("unknown record source {}", raw.source),
            ),
            detail: Detail::Kernel {
                function: format!("source {}", raw.source),
                via: "?".into(),
            },
            scope: None,
        },
    };
    let scope = d.scope.unwrap_or(if in_node {
        Scope::Node
    } else {
        Scope::Container
    });
    ShutdownSignal {
        source: d.source,
        kind: d.intent.kind,
        forced: d.intent.forced,
        bypasses_logind: d.intent.bypasses_logind,
        calls_reboot: d.intent.calls_reboot,
        scope,
        effect: d.intent.effect,
        actor: Some(actor),
        sender: None,
        at,
        boot_ns: raw.boot_ns,
        deadline: None,
        detail: d.detail,
    }
}

/// A NUL-terminated C string, lossily.
pub(crate) fn cstr(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Intents the hooks' tests compare against.
#[cfg(test)]
pub(crate) mod expect {
    use super::*;

    pub(crate) fn logind(kind: Kind) -> Intent {
        Intent::new(kind, Effect::Now, false, false)
    }

    pub(crate) fn forced(kind: Kind) -> Intent {
        Intent::new(kind, Effect::Now, true, true)
    }

    /// Forced, and the tool calls reboot(2) itself.
    pub(crate) fn rebooting(kind: Kind) -> Intent {
        forced(kind).calling_reboot()
    }

    /// Not forced, past logind.
    pub(crate) fn direct(kind: Kind) -> Intent {
        Intent::new(kind, Effect::Now, false, true)
    }

    /// Nothing happens, for any reason.
    pub(crate) fn none(kind: Kind) -> Intent {
        Intent::nothing(kind, "")
    }

    /// Compares, ignoring the text of an expected `Effect::None` whose `why` is empty.
    pub(crate) fn assert_intent(what: &str, got: &Intent, want: &Intent) {
        match (&got.effect, &want.effect) {
            (Effect::None { .. }, Effect::None { why }) if why.is_empty() => assert_eq!(
                (got.kind, got.forced, got.bypasses_logind),
                (want.kind, want.forced, want.bypasses_logind),
                "{what}: got {got:?}"
            ),
            _ => assert_eq!(got, want, "{what}"),
        }
    }

    /// A record from `source` with `flags`, by pid 4242 ("test"), at 1 s of boot.
    pub(crate) fn raw(source: u32, flags: u32) -> RawEvent {
        let mut r = RawEvent::ZERO;
        r.source = source;
        r.flags = flags;
        r.tgid = 4242;
        r.boot_ns = 1_000_000_000;
        r.comm[..4].copy_from_slice(b"test");
        r
    }

    /// (wall, boottime): 3 s into the boot.
    pub(crate) fn now() -> (SystemTime, u64) {
        (
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            3_000_000_000,
        )
    }
}

#[cfg(test)]
mod tests {
    use lastgasp_common::{RebootCall, RebootReturn};

    use super::{expect::*, *};

    #[test]
    fn garbage_records_never_panic() {
        let mut r = raw(99, 0xffff_ffff);
        r.path_len = u32::MAX;
        r.args_len = u32::MAX;
        r.payload = [u64::MAX; 4];
        let s = decode(&r, now());
        assert!(matches!(s.effect, Effect::None { .. }));
        for src in 1..=8 {
            r.source = src;
            let _ = decode(&r, now());
        }
    }

    /// Found by the fuzzer (`cargo xtask bench fuzz`, kernel_record): an exec
    /// of `shutdown` whose time lies past year 9999 decoded to a time no
    /// log can write, and writing the signal panicked (any user could run
    /// it). The time is now kept as unknown, with the spec.
    #[test]
    fn fuzz_kernel_record_1_a_time_past_9999_is_written_down() {
        let bytes = include_bytes!("testdata/fuzz-kernel-record-1");
        let raw = RawEvent::from_bytes(bytes).unwrap();
        let s = decode(&raw, now());
        let d = crate::decide::Decider::new().decide(&s);
        serde_json::to_string(&(&s, &d.action)).unwrap();
    }

    /// Found by the fuzzer (kernel_record, after the first fix): a reboot(2)
    /// exit record returning i64::MIN overflowed the errno's negation.
    #[test]
    fn fuzz_kernel_record_2_any_return_value_is_told() {
        let bytes = include_bytes!("testdata/fuzz-kernel-record-2");
        let raw = RawEvent::from_bytes(bytes).unwrap();
        let s = decode(&raw, now());
        serde_json::to_string(&s).unwrap();
        let mut r = raw;
        let RebootReturn(call) = r.payload().unwrap_or_default();
        r.set(&RebootReturn(RebootCall {
            ret: i64::MIN,
            ..call
        }));
        let _ = decode(&r, now());
    }

    #[test]
    fn every_record_source_has_one_hook() {
        for s in RecordSource::ALL {
            let n = HOOKS.iter().filter(|h| h.source == s).count();
            assert_eq!(n, 1, "{s:?}: {n} hooks read it");
        }
    }

    /// One file per hook, by the same name on both sides.
    #[test]
    fn each_hook_has_one_file_of_its_name_on_both_sides() {
        let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for s in RecordSource::ALL {
            let name = s.name();
            let kernel = here.join(format!("../agent-ebpf/src/{name}.rs"));
            let user = here.join(format!("src/detect/hooks/{name}.rs"));
            let user_dir = here.join(format!("src/detect/hooks/{name}/mod.rs"));
            assert!(kernel.is_file(), "no {}", kernel.display());
            assert!(
                user.is_file() || user_dir.is_file(),
                "no {} (or {name}/mod.rs)",
                user.display()
            );
        }
    }
}
