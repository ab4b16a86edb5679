//! Loads the eBPF programs, arms each hook (naming the ones the kernel
//! refuses), and turns ring-buffer records into `ShutdownSignal`s.
use std::{
    fmt,
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{HashMap, MapData, PerCpuArray, RingBuf},
    programs::{FEntry, KProbe, TracePoint},
    Btf, Ebpf, EbpfLoader,
};
use lastgasp_common::{self as common, RawEvent};
use tokio::io::unix::AsyncFd;

use super::decode::{self, Intent};
use crate::{
    node::NodePidNs,
    signal::{Actor, Detail, Effect, Parent, Scope, ShutdownSignal, Source},
};

static EBPF_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lastgasp.bpf.o"));

/// Basenames the exec hook matches, and their `TOOLS` ids.
pub const TOOLS: &[(&str, u32)] = &[
    ("systemctl", 1),
    ("shutdown", 2),
    ("reboot", 3),
    ("poweroff", 4),
    ("halt", 5),
    ("init", 6),
    ("telinit", 7),
    ("kexec", 8),
    ("systemd-shutdown", 9),
    ("busybox", common::TOOL_BUSYBOX),
];

const TRACEPOINTS: &[(&str, &str, &str)] = &[
    ("sys_enter_reboot", "syscalls", "sys_enter_reboot"),
    ("sys_exit_reboot", "syscalls", "sys_exit_reboot"),
    ("sched_process_exec", "sched", "sched_process_exec"),
    ("signal_generate", "signal", "signal_generate"),
];

const KERNEL_FUNCTIONS: &[&str] = &[
    "kernel_power_off",
    "kernel_restart",
    "kernel_halt",
    "emergency_restart",
];

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

impl fmt::Display for HookReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            HookState::Armed => "armed".to_string(),
            HookState::Degraded(why) => format!("armed, degraded: {why}"),
            HookState::Unavailable(why) => format!("unavailable: {why}"),
        };
        write!(f, "{:<20} {:<34} {}", self.hook, self.attach, state)
    }
}

pub struct EbpfDetector {
    // Owns the programs and links: dropping it detaches everything.
    _bpf: Ebpf,
    /// The node's records, and containers' (rate-limited in the kernel).
    node_events: AsyncFd<RingBuf<MapData>>,
    container_events: AsyncFd<RingBuf<MapData>>,
    drops: PerCpuArray<MapData, u64>,
    pub report: Vec<HookReport>,
}

/// Records lost before userspace saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drops {
    /// The node's ring buffer was full.
    pub node_full: u64,
    /// The containers' ring buffer was full.
    pub container_full: u64,
    /// Over the containers' rate in the kernel.
    pub container_rate_limited: u64,
}

impl Drops {
    pub fn total(&self) -> u64 {
        self.node_full + self.container_full + self.container_rate_limited
    }
}

/// At most this many records per `next_batch`, the node's first: the loop
/// stays fair to the buses and the heartbeat during a flood.
const BATCH: usize = 256;

/// Kernel struct offsets the programs need, from the running kernel's BTF:
/// argv at exec, and the acting task's parent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskOffsets {
    pub task_mm: u64,
    pub mm_arg_start: u64,
    pub mm_arg_end: u64,
    pub task_real_parent: u64,
    pub task_tgid: u64,
    pub task_comm: u64,
    pub task_cred: u64,
    pub cred_euid: u64,
    pub cred_cap_effective: u64,
    pub cred_user_ns: u64,
    pub user_ns_level: u64,
}

impl TaskOffsets {
    pub fn from_btf(path: &str) -> Result<Self> {
        let data = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        let btf = super::btf::Btf::parse(&data)?;
        Ok(TaskOffsets {
            task_mm: btf.member_offset("task_struct", "mm")?,
            mm_arg_start: btf.member_offset("mm_struct", "arg_start")?,
            mm_arg_end: btf.member_offset("mm_struct", "arg_end")?,
            task_real_parent: btf.member_offset("task_struct", "real_parent")?,
            task_tgid: btf.member_offset("task_struct", "tgid")?,
            task_comm: btf.member_offset("task_struct", "comm")?,
            task_cred: btf.member_offset("task_struct", "cred")?,
            cred_euid: btf.member_offset("cred", "euid")?,
            cred_cap_effective: btf.member_offset("cred", "cap_effective")?,
            cred_user_ns: btf.member_offset("cred", "user_ns")?,
            user_ns_level: btf.member_offset("user_namespace", "level")?,
        })
    }
}

impl EbpfDetector {
    /// Loads and attaches every hook. Fails only when nothing could be armed.
    pub fn load(node: NodePidNs) -> Result<Self> {
        if EBPF_OBJ.is_empty() {
            bail!("this lastgasp binary was built without its eBPF object; build it with `cargo xtask build`");
        }
        crate::node::require_bpf_caps()?;
        crate::node::ensure_tracefs()?;
        let mut report = Vec::new();

        let offsets = match TaskOffsets::from_btf("/sys/kernel/btf/vmlinux") {
            Ok(o) => Some(o),
            Err(e) => {
                report.push(HookReport {
                    hook: "task offsets".into(),
                    attach: "/sys/kernel/btf/vmlinux".into(),
                    state: HookState::Degraded(format!(
                        "no kernel BTF ({e:#}): exec without argv, actors without parent or credentials (who can reboot is judged by uid 0 alone)"
                    )),
                });
                None
            }
        };
        let o = offsets.unwrap_or_default();
        let mut bpf = EbpfLoader::new()
            .override_global("NODE_PIDNS_DEV", &node.dev, true)
            .override_global("NODE_PIDNS_INO", &node.ino, true)
            .override_global("NODE_INIT_PID", &node.init_pid, true)
            .override_global("TASK_MM_OFF", &o.task_mm, true)
            .override_global("MM_ARG_START_OFF", &o.mm_arg_start, true)
            .override_global("MM_ARG_END_OFF", &o.mm_arg_end, true)
            .override_global("TASK_REAL_PARENT_OFF", &o.task_real_parent, true)
            .override_global("TASK_TGID_OFF", &o.task_tgid, true)
            .override_global("TASK_COMM_OFF", &o.task_comm, true)
            .override_global("TASK_CRED_OFF", &o.task_cred, true)
            .override_global("CRED_EUID_OFF", &o.cred_euid, true)
            .override_global("CRED_CAP_EFFECTIVE_OFF", &o.cred_cap_effective, true)
            .override_global("CRED_USER_NS_OFF", &o.cred_user_ns, true)
            .override_global("USER_NS_LEVEL_OFF", &o.user_ns_level, true)
            .load(EBPF_OBJ)
            .context("loading the eBPF object")?;

        let mut tools: HashMap<_, [u8; common::TOOL_NAME_LEN], u32> =
            HashMap::try_from(bpf.map_mut("TOOLS").context("no TOOLS map")?)?;
        for (name, id) in TOOLS {
            tools.insert(common::tool_key(name.as_bytes()), id, 0)?;
        }

        for (prog, category, name) in TRACEPOINTS {
            let state = match attach_tracepoint(&mut bpf, prog, category, name) {
                Ok(()) => HookState::Armed,
                Err(e) => HookState::Unavailable(format!("{e:#}")),
            };
            report.push(HookReport {
                hook: prog.to_string(),
                attach: format!("tracepoint {category}/{name}"),
                state,
            });
        }
        if report
            .iter()
            .all(|r| r.hook != "sys_enter_reboot" || r.state != HookState::Armed)
        {
            let why = report
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join("; ");
            bail!("the kernel refused the reboot(2) tracepoint, so lastgasp cannot work: {why}");
        }
        arm_kernel_hooks(&mut bpf, &mut report);

        let ring = |bpf: &mut Ebpf, name: &str| -> Result<AsyncFd<RingBuf<MapData>>> {
            let rb = RingBuf::try_from(
                bpf.take_map(name)
                    .with_context(|| format!("no {name} map"))?,
            )?;
            // SAFETY: the ring buffer owns its fd and keeps it open while the
            // AsyncFd holds it.
            Ok(unsafe { AsyncFd::register(rb)? })
        };
        let node_events = ring(&mut bpf, "EVENTS_NODE")?;
        let container_events = ring(&mut bpf, "EVENTS_CONTAINER")?;
        let drops = PerCpuArray::try_from(bpf.take_map("DROPS").context("no DROPS map")?)?;
        Ok(EbpfDetector {
            _bpf: bpf,
            node_events,
            container_events,
            drops,
            report,
        })
    }

    /// Records lost in the kernel, all CPUs.
    pub fn drops_by_cause(&self) -> Drops {
        let slot = |i: u32| -> u64 { self.drops.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0) };
        Drops {
            node_full: slot(common::DROP_NODE_FULL),
            container_full: slot(common::DROP_CONTAINER_FULL),
            container_rate_limited: slot(common::DROP_CONTAINER_RATE),
        }
    }

    /// Records lost in the kernel, every cause.
    pub fn drops(&self) -> u64 {
        self.drops_by_cause().total()
    }

    /// Waits for the next records and returns them decoded (not yet enriched
    /// from /proc: see `actor::enrich`): the node's first, at most `BATCH`.
    pub async fn next_batch(&mut self) -> Result<Vec<ShutdownSignal>> {
        loop {
            let mut out = Vec::new();
            drain(&mut self.node_events, &mut out, BATCH);
            drain(&mut self.container_events, &mut out, BATCH);
            if !out.is_empty() {
                return Ok(out);
            }
            tokio::select! {
                g = self.node_events.readable_mut() => g?.clear_ready(),
                g = self.container_events.readable_mut() => g?.clear_ready(),
            }
        }
    }
}

/// Takes up to `max` records (in all) from `rb` into `out`.
fn drain(rb: &mut AsyncFd<RingBuf<MapData>>, out: &mut Vec<ShutdownSignal>, max: usize) {
    let rb = rb.get_mut();
    while out.len() < max {
        let Some(item) = rb.next() else { break };
        match RawEvent::from_bytes(&item) {
            Some(raw) => out.push(decode_raw(&raw, now_pair())),
            None => tracing::warn!(len = item.len(), "short ring-buffer record"),
        }
    }
}

fn attach_tracepoint(bpf: &mut Ebpf, prog: &str, category: &str, name: &str) -> Result<()> {
    let p: &mut TracePoint = bpf
        .program_mut(prog)
        .context("program missing from the object")?
        .try_into()?;
    p.load()?;
    p.attach(category, name)?;
    Ok(())
}

/// fentry first, kprobe second; both feature-probed by trying them.
fn arm_kernel_hooks(bpf: &mut Ebpf, report: &mut Vec<HookReport>) {
    let btf = Btf::from_sys_fs().map_err(|e| format!("no kernel BTF: {e}"));
    for func in KERNEL_FUNCTIONS {
        let fentry = match &btf {
            Ok(btf) => (|| -> Result<()> {
                let p: &mut FEntry = bpf
                    .program_mut(&format!("fentry_{func}"))
                    .context("missing")?
                    .try_into()?;
                p.load(func, btf)?;
                p.attach()?;
                Ok(())
            })()
            .map_err(|e| refusal(&e)),
            Err(e) => Err(e.clone()),
        };
        let state = match fentry {
            Ok(()) => {
                report.push(HookReport {
                    hook: func.to_string(),
                    attach: format!("fentry {func}"),
                    state: HookState::Armed,
                });
                continue;
            }
            Err(fentry_err) => {
                let kprobe = (|| -> Result<()> {
                    let p: &mut KProbe = bpf
                        .program_mut(&format!("kprobe_{func}"))
                        .context("missing")?
                        .try_into()?;
                    p.load()?;
                    p.attach(func, 0)?;
                    Ok(())
                })();
                match kprobe {
                    Ok(()) => HookState::Armed,
                    Err(e) => HookState::Unavailable(format!(
                        "fentry: {fentry_err}; kprobe: {}",
                        refusal(&e)
                    )),
                }
            }
        };
        let attach = if state == HookState::Armed {
            format!("kprobe {func}")
        } else {
            format!("fentry|kprobe {func}")
        };
        report.push(HookReport {
            hook: func.to_string(),
            attach,
            state,
        });
    }
}

/// A short reason for a refused hook, naming the usual causes.
fn refusal(e: &anyhow::Error) -> String {
    let s = format!("{e:#}");
    if s.contains("kprobe/type") {
        "the kernel has no kprobes (CONFIG_KPROBES off)".into()
    } else if s.contains("Operation not permitted") {
        "program load refused with EPERM (kernel lockdown, or no BPF trampoline)".into()
    } else {
        s
    }
}

/// (wall clock, CLOCK_BOOTTIME) read together, to date kernel timestamps.
pub fn now_pair() -> (SystemTime, u64) {
    let wall = SystemTime::now();
    (wall, boottime_ns())
}

pub fn boottime_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).expect("CLOCK_BOOTTIME");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

fn cstr(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A syscall's return value as text: "0", or "-1 EPERM (Operation not permitted)".
fn errno_text(ret: i64) -> String {
    if ret >= 0 {
        return ret.to_string();
    }
    let errno = nix::errno::Errno::from_raw(i32::try_from(-ret).unwrap_or(0));
    format!("-1 {errno:?} ({})", errno.desc())
}

const SIGNAL_RESULTS: &[&str] = &[
    "delivered",
    "ignored",
    "already-pending",
    "overflow-fail",
    "lose-info",
];

/// Turns one kernel record into a signal. Pure: `now` is (wall, boottime ns).
pub fn decode_raw(raw: &RawEvent, now: (SystemTime, u64)) -> ShutdownSignal {
    let at = now.0 - Duration::from_nanos(now.1.saturating_sub(raw.boot_ns));
    let in_node = raw.flags & common::FLAG_NODE_PIDNS != 0;
    let creds = raw.flags & common::FLAG_CREDS != 0;
    let actor = Actor {
        pid: raw.tgid,
        ns_pid: raw.ns_tgid,
        comm: cstr(&raw.comm),
        uid: raw.uid,
        euid: creds.then_some(raw.euid),
        cap_sys_boot: creds.then_some(raw.flags & common::FLAG_CAP_SYS_BOOT != 0),
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
    let mut scope = if in_node {
        Scope::Node
    } else {
        Scope::Container
    };
    let (source, intent, detail) = match raw.source {
        common::SRC_REBOOT => {
            let (m1, m2, cmd) = (raw.a[0] as u32, raw.a[1] as u32, raw.a[2] as u32);
            let mut intent = decode::decode_reboot(m1, m2, cmd);
            if in_node && raw.ns_tgid == 1 {
                // The node's init finishing an orderly shutdown (systemd-shutdown).
                intent.forced = false;
                intent.bypasses_logind = false;
            }
            if in_node && intent.effect == Effect::Now && actor.cap_sys_boot == Some(false) {
                intent.effect = Effect::None {
                    why: format!(
                        "the caller (euid {}) lacks CAP_SYS_BOOT in the initial user namespace: reboot(2) fails with EPERM",
                        raw.euid
                    ),
                };
            }
            let valid_magic = decode::valid_reboot_magic(m1, m2);
            (
                Source::RebootSyscall,
                intent,
                Detail::Reboot {
                    magic1: m1,
                    magic2: m2,
                    cmd,
                    valid_magic,
                },
            )
        }
        common::SRC_REBOOT_EXIT => {
            let (m1, m2, cmd) = (raw.a[0] as u32, raw.a[1] as u32, raw.a[2] as u32);
            let ret = raw.a[3] as i64;
            let mut intent = decode::decode_reboot(m1, m2, cmd);
            // Only a shutdown that returns has failed; CAD_ON returning 0, or
            // a bad magic's EINVAL, changes nothing.
            intent.effect = match intent.effect {
                Effect::Now => Effect::Failed {
                    why: format!("reboot(2) cmd {cmd:#x} returned {}", errno_text(ret)),
                },
                _ => Effect::None {
                    why: format!("reboot(2) cmd {cmd:#x} returned {}", errno_text(ret)),
                },
            };
            (
                Source::RebootSyscall,
                intent,
                Detail::Reboot {
                    magic1: m1,
                    magic2: m2,
                    cmd,
                    valid_magic: decode::valid_reboot_magic(m1, m2),
                },
            )
        }
        common::SRC_EXEC => {
            let path_len = (raw.path_len as usize).min(common::PATH_LEN);
            let path = &raw.path[..path_len];
            let path = &path[..path.iter().position(|&b| b == 0).unwrap_or(path.len())];
            let args = &raw.args[..(raw.args_len as usize).min(common::ARGS_LEN)];
            let truncated = raw.flags & common::FLAG_ARGS_TRUNCATED != 0;
            let argv = decode::split_argv(args);
            let mut intent = decode::decode_exec(path, &argv, truncated, at);
            if raw.flags & common::FLAG_ARGS_MISSING != 0 {
                intent = Intent {
                    effect: Effect::Now,
                    ..intent
                };
                intent.kind = crate::signal::Kind::Unknown;
            }
            let mut path_s = String::from_utf8_lossy(path).into_owned();
            if raw.flags & common::FLAG_PATH_TRUNCATED != 0 {
                path_s.insert_str(0, "...");
            }
            let detail = Detail::Exec {
                path: path_s,
                argv: argv
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect(),
                raw: decode::escape_bytes(args),
                truncated,
            };
            (Source::Exec, intent, detail)
        }
        common::SRC_SIGNAL => {
            let signo = raw.a[0] as u32;
            scope = Scope::Node;
            let result = SIGNAL_RESULTS
                .get(raw.a[2] as usize)
                .unwrap_or(&"unknown")
                .to_string();
            let detail = Detail::Signal {
                signo,
                name: decode::signal_name(signo),
                result,
            };
            (
                Source::SignalPid1,
                decode::decode_signal_to_init(signo),
                detail,
            )
        }
        common::SRC_KERNEL => {
            use crate::signal::Kind;
            let (function, kind) = match raw.a[0] {
                common::KHOOK_POWER_OFF => ("kernel_power_off", Kind::Poweroff),
                common::KHOOK_RESTART => ("kernel_restart", Kind::Reboot),
                common::KHOOK_HALT => ("kernel_halt", Kind::Halt),
                common::KHOOK_EMERGENCY_RESTART => ("emergency_restart", Kind::Reboot),
                _ => ("unknown", Kind::Unknown),
            };
            scope = Scope::Node;
            let via = if raw.flags & common::FLAG_FENTRY != 0 {
                "fentry"
            } else {
                "kprobe"
            };
            let intent = Intent {
                kind,
                forced: true,
                bypasses_logind: true,
                effect: Effect::Now,
            };
            (
                Source::KernelHook,
                intent,
                Detail::Kernel {
                    function: function.into(),
                    via: via.into(),
                },
            )
        }
        other => {
            let intent = Intent {
                kind: crate::signal::Kind::Unknown,
                forced: false,
                bypasses_logind: false,
                effect: Effect::None {
                    why: format!("unknown record source {other}"),
                },
            };
            (
                Source::KernelHook,
                intent,
                Detail::Kernel {
                    function: format!("source {other}"),
                    via: "?".into(),
                },
            )
        }
    };
    ShutdownSignal {
        source,
        kind: intent.kind,
        forced: intent.forced,
        bypasses_logind: intent.bypasses_logind,
        scope,
        effect: intent.effect,
        actor: Some(actor),
        sender: None,
        at,
        boot_ns: raw.boot_ns,
        deadline: None,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signal::Kind;

    fn raw(source: u32, flags: u32) -> RawEvent {
        let mut r = RawEvent::ZERO;
        r.source = source;
        r.flags = flags;
        r.tgid = 4242;
        r.boot_ns = 1_000_000_000;
        r.comm[..4].copy_from_slice(b"test");
        r
    }

    fn now() -> (SystemTime, u64) {
        (
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            3_000_000_000,
        )
    }

    #[test]
    fn kernel_hook_records_are_forced_node_shutdowns() {
        let mut r = raw(common::SRC_KERNEL, common::FLAG_FENTRY);
        r.a[0] = common::KHOOK_POWER_OFF;
        let s = decode_raw(&r, now());
        assert_eq!(
            (s.source, s.kind, s.forced, s.scope),
            (Source::KernelHook, Kind::Poweroff, true, Scope::Node)
        );
        assert_eq!(
            s.detail,
            Detail::Kernel {
                function: "kernel_power_off".into(),
                via: "fentry".into()
            }
        );
        assert_eq!(
            s.at,
            now().0 - Duration::from_secs(2),
            "dated from CLOCK_BOOTTIME"
        );
    }

    #[test]
    fn exec_without_argv_is_unknown_but_kept() {
        let mut r = raw(
            common::SRC_EXEC,
            common::FLAG_NODE_PIDNS | common::FLAG_ARGS_MISSING,
        );
        r.path[..13].copy_from_slice(b"/sbin/reboot\0");
        r.path_len = 13;
        let s = decode_raw(&r, now());
        assert_eq!(
            (s.kind, s.effect.clone(), s.scope),
            (Kind::Unknown, Effect::Now, Scope::Node)
        );
        assert!(matches!(s.detail, Detail::Exec { ref path, .. } if path == "/sbin/reboot"));
    }

    #[test]
    fn init_of_the_node_finishing_a_shutdown_is_not_forced() {
        let mut r = raw(common::SRC_REBOOT, common::FLAG_NODE_PIDNS);
        r.ns_tgid = 1;
        r.a = [0xfee1dead, 672274793, 0x4321fedc, 0];
        let s = decode_raw(&r, now());
        assert_eq!(
            (s.kind, s.forced, s.effect.clone()),
            (Kind::Poweroff, false, Effect::Now)
        );
        r.ns_tgid = 77;
        assert!(
            decode_raw(&r, now()).forced,
            "anyone else's reboot(2) is forced"
        );
    }

    #[test]
    fn garbage_records_never_panic() {
        let mut r = raw(99, 0xffff_ffff);
        r.path_len = u32::MAX;
        r.args_len = u32::MAX;
        r.a = [u64::MAX; 4];
        let s = decode_raw(&r, now());
        assert!(matches!(s.effect, Effect::None { .. }));
        for src in 1..=4 {
            r.source = src;
            let _ = decode_raw(&r, now());
        }
    }
}
