//! The one event type that flows from detection to decision to action, as
//! every audit line carries it.
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

#[cfg(any(test, feature = "fixtures"))]
pub mod fixture;

/// Which detector saw it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// `syscalls/sys_enter_reboot`.
    RebootSyscall,
    /// `sched/sched_process_exec` of a shutdown tool.
    Exec,
    /// `signal/signal_generate` to the node's PID 1.
    SignalPid1,
    /// fentry/kprobe on the kernel's power-off functions.
    KernelHook,
    /// logind over D-Bus.
    Logind,
    /// systemd's job queue over D-Bus.
    Systemd,
    /// systemd-shutdown's own hook (`/usr/lib/systemd/system-shutdown/`):
    /// every process stopped, file systems unmounted, the reboot(2) next.
    ShutdownHook,
    /// lastgasp's unit systemd runs right before systemd-{verb}.service
    /// (`act::final_unit`): every unit stopped (every pod's scope, the
    /// kubelet, the runtime), every mount unit unmounted; systemd-shutdown
    /// comes next.
    FinalUnit,
    /// The agent's own reading once PID 1 exec'd systemd-shutdown
    /// (`detect::final_sweep`): its kill sweep ended every process but
    /// PID 1, kernel threads and root `@` processes outside pods; the
    /// unmount loop and reboot(2) come next.
    FinalSweep,
    /// `sched/sched_process_exit` (and exec): a tool whose exec proved the
    /// node's end ended without the kernel going down.
    ToolEnd,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Poweroff,
    Halt,
    Reboot,
    Kexec,
    SoftReboot,
    Unknown,
}

/// The user-facing name: the one serde writes ("reboot-syscall",
/// "soft-reboot", "node").
macro_rules! serde_display {
    ($($t:ty),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match serde_json::to_value(self) {
                    Ok(serde_json::Value::String(s)) => f.write_str(&s),
                    _ => Err(std::fmt::Error),
                }
            }
        }
    )*};
}
serde_display!(Source, Kind, Scope);

/// Whose world ends: the node (its initial PID namespace), or only a
/// container's PID namespace.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum Scope {
    Node,
    Container,
}

/// What the request does if it succeeds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "effect")]
pub enum Effect {
    /// The shutdown starts now.
    Now,
    /// A shutdown is scheduled (`shutdown +5`); `at` when known exactly.
    Scheduled {
        #[serde(default, with = "humantime_serde")]
        at: Option<SystemTime>,
        spec: String,
    },
    /// A scheduled or delayed shutdown is cancelled.
    Cancel,
    /// Nothing is shut down (a query, `shutdown -k`, bad reboot magic, a
    /// caller without CAP_SYS_BOOT...).
    None { why: String },
    /// A request that was carried out and failed (a reboot(2) that
    /// returned): retract what it started.
    Failed { why: String },
}

impl Effect {
    /// The name serde writes (`"effect": "now"`).
    pub fn name(&self) -> &'static str {
        match self {
            Effect::Now => "now",
            Effect::Scheduled { .. } => "scheduled",
            Effect::Cancel => "cancel",
            Effect::None { .. } => "none",
            Effect::Failed { .. } => "failed",
        }
    }
}

/// Who asked.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Actor {
    /// Global (host) pid of the thread group.
    pub pid: u32,
    /// The pid as seen in the node's PID namespace; 0 outside it.
    pub ns_pid: u32,
    pub comm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    pub uid: u32,
    /// Effective uid, read from the task's credentials in the kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub euid: Option<u32>,
    /// Whether the task holds CAP_SYS_BOOT in its effective set in the
    /// initial user namespace, i.e. whether its reboot(2) can work. `None`:
    /// the kernel's credentials could not be read (no BTF offsets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap_sys_boot: Option<bool>,
    /// An exec's: `Some(true)` when the exec itself lent the caller its
    /// privilege (the kernel's AT_SECURE: a setuid or setgid binary, file
    /// capabilities), for a caller whose real uid is not root. `None`: not
    /// an exec, or not read. An exec proves a capable caller only with
    /// `Some(false)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub borrowed: Option<bool>,
    pub cgroup_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// Parent chain, nearest first, as far as /proc still had it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<Parent>,
}

/// The D-Bus peer that sent a logind or systemd signal.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct BusSender {
    /// Its unique name (`:1.42`).
    pub unique: String,
    /// It owned the service's well-known name (`org.freedesktop.login1` or
    /// `org.freedesktop.systemd1`) when the signal came: only then is it
    /// logind or systemd speaking. Anyone else on the bus can send the same
    /// signal.
    pub owns_name: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Parent {
    pub pid: u32,
    pub comm: String,
}

/// The detector's own raw facts, kept for the audit.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "hook")]
pub enum Detail {
    Reboot {
        magic1: u32,
        magic2: u32,
        cmd: u32,
        valid_magic: bool,
        /// At the syscall's exit: what it returned (`-errno`). Absent at
        /// entry.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ret: Option<i64>,
    },
    Exec {
        path: String,
        /// The file name of the binary really executed, as the kernel read
        /// it (behind every symlink; a script's interpreter).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        binary: Option<String>,
        argv: Vec<String>,
        /// argv as captured, NUL-separated, with non-printable bytes escaped.
        raw: String,
        truncated: bool,
    },
    Signal {
        signo: u32,
        name: String,
        /// The kernel's verdict: delivered, ignored, already pending...
        result: String,
    },
    Kernel {
        function: String,
        via: String,
    },
    Dbus {
        member: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unit: Option<String>,
    },
    /// systemd-shutdown's hook (or lastgasp's stop unit), with the verb
    /// the shutdown ends in.
    Hook {
        verb: String,
    },
    /// A watched tool's end: "exited" or "exec'd another program".
    ToolEnd {
        how: String,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ShutdownSignal {
    pub source: Source,
    pub kind: Kind,
    /// The path skips service stop jobs: the node is gone within moments.
    pub forced: bool,
    /// The path does not go through logind, so no delay lock protects it.
    pub bypasses_logind: bool,
    /// The caller calls reboot(2) itself at once, with no service manager
    /// between (`reboot -f`, `systemctl poweroff -ff`, `busybox poweroff
    /// -f`): nothing on the node is stopped before the kernel goes down.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub calls_reboot: bool,
    pub scope: Scope,
    #[serde(flatten)]
    pub effect: Effect,
    pub actor: Option<Actor>,
    /// D-Bus signals: who sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<BusSender>,
    /// When the kernel saw it (wall clock).
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// CLOCK_BOOTTIME of the event, ns (for latency and ordering).
    pub boot_ns: u64,
    /// When the shutdown will go ahead regardless (a delay lock's limit).
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub deadline: Option<SystemTime>,
    pub detail: Detail,
}

impl ShutdownSignal {
    /// The kernel is already shutting down, or a caller that can do it
    /// skips the service stop jobs: no time. (The hooks say what the caller
    /// asked, `forced`; this is the one place that says what it leaves.)
    pub fn leaves_no_time(&self) -> bool {
        self.forced
            || matches!(
                self.source,
                Source::RebootSyscall
                    | Source::KernelHook
                    | Source::ShutdownHook
                    | Source::FinalUnit
                    | Source::FinalSweep
            )
            || self.is_pid1_shutdown()
    }

    /// A reboot(2) that returned: its entry record already said who called
    /// (the enrichment from /proc is not read again for it).
    pub fn is_return(&self) -> bool {
        matches!(self.detail, Detail::Reboot { ret: Some(_), .. })
    }

    /// PID 1 exec'ing systemd-shutdown: the end of an orderly shutdown,
    /// services already stopped.
    pub fn is_pid1_shutdown(&self) -> bool {
        let Detail::Exec { path, .. } = &self.detail else {
            return false;
        };
        self.actor.as_ref().is_some_and(|a| a.ns_pid == 1) && path.ends_with("/systemd-shutdown")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_shown_to_people_are_serdes() {
        assert_eq!(Source::RebootSyscall.to_string(), "reboot-syscall");
        assert_eq!(Source::SignalPid1.to_string(), "signal-pid1");
        assert_eq!(Kind::SoftReboot.to_string(), "soft-reboot");
        assert_eq!(Scope::Container.to_string(), "container");
        for e in [
            Effect::Now,
            Effect::Scheduled {
                at: None,
                spec: "+5".into(),
            },
            Effect::Cancel,
            Effect::None { why: "x".into() },
            Effect::Failed { why: "x".into() },
        ] {
            assert_eq!(serde_json::to_value(&e).unwrap()["effect"], e.name());
        }
    }

    #[test]
    fn only_a_reboot_that_returned_is_a_return() {
        let call = |ret| Detail::Reboot {
            magic1: 0xfee1_dead,
            magic2: 672_274_793,
            cmd: 0x4321_fedc,
            valid_magic: true,
            ret,
        };
        let mut s = ShutdownSignal::of(Source::RebootSyscall, Kind::Poweroff);
        s.detail = call(None);
        assert!(!s.is_return());
        s.detail = call(Some(-1));
        assert!(s.is_return());
    }
}
