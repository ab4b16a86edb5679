//! The record the eBPF programs write to the ring buffer, shared by both sides.
#![no_std]

pub const COMM_LEN: usize = 16;
/// Bytes of the exec'd path kept (the tracepoint's `filename`).
pub const PATH_LEN: usize = 128;
/// Bytes of the NUL-separated argv kept for a matched exec.
pub const ARGS_LEN: usize = 256;
/// Tools are matched on the exec'd task's comm: the basename's first 15
/// bytes, zero-padded to 16 (TASK_COMM_LEN).
pub const TOOL_NAME_LEN: usize = 16;

/// `RawEvent::source`.
pub const SRC_REBOOT: u32 = 1;
pub const SRC_EXEC: u32 = 2;
pub const SRC_SIGNAL: u32 = 3;
pub const SRC_KERNEL: u32 = 4;
/// `sys_exit_reboot` of a call whose entry was seen: the call returned.
pub const SRC_REBOOT_EXIT: u32 = 5;

/// `RawEvent::flags`.
/// The acting task is in the node's PID namespace (else: a child namespace).
pub const FLAG_NODE_PIDNS: u32 = 1;
/// argv was longer than `ARGS_LEN` and was cut.
pub const FLAG_ARGS_TRUNCATED: u32 = 2;
/// argv could not be read (no BTF offsets, or the read faulted).
pub const FLAG_ARGS_MISSING: u32 = 4;
/// The kernel hook fired from an fentry program (else a kprobe).
pub const FLAG_FENTRY: u32 = 8;
/// The exec'd path was longer than `PATH_LEN`: `path` holds its tail.
pub const FLAG_PATH_TRUNCATED: u32 = 16;
/// The task's credentials were read (`euid`, `FLAG_CAP_SYS_BOOT`).
pub const FLAG_CREDS: u32 = 32;
/// The task holds CAP_SYS_BOOT in its effective set, in the initial user
/// namespace: its reboot(2) can work.
pub const FLAG_CAP_SYS_BOOT: u32 = 64;

/// `DROPS` map slots: records lost, by scope and why. "Capable": the node's
/// records from callers that can shut it down (see `emit`); "node": the
/// node's others; "container": a child PID namespace's.
pub const DROP_NODE_FULL: u32 = 0;
pub const DROP_CONTAINER_FULL: u32 = 1;
pub const DROP_CONTAINER_RATE: u32 = 2;
pub const DROP_NODE_RATE: u32 = 3;
pub const DROP_CAPABLE_FULL: u32 = 4;
pub const DROP_SLOTS: u32 = 5;

/// CAP_SYS_BOOT's bit in a capability set.
pub const CAP_SYS_BOOT: u64 = 22;

/// `TOOLS` map values: which shutdown tool a basename names.
pub const TOOL_SYSTEMCTL: u32 = 1;
pub const TOOL_SHUTDOWN: u32 = 2;
pub const TOOL_REBOOT: u32 = 3;
pub const TOOL_POWEROFF: u32 = 4;
pub const TOOL_HALT: u32 = 5;
pub const TOOL_INIT: u32 = 6;
pub const TOOL_TELINIT: u32 = 7;
pub const TOOL_KEXEC: u32 = 8;
pub const TOOL_SYSTEMD_SHUTDOWN: u32 = 9;
/// busybox: the applet is argv[1] (or argv[0] through a symlink).
pub const TOOL_BUSYBOX: u32 = 100;

/// The basenames the exec hook matches, and their ids: the one list that
/// fills the kernel's `TOOLS` map and that the decoder reads.
pub const TOOLS: &[(&str, u32)] = &[
    ("systemctl", TOOL_SYSTEMCTL),
    ("shutdown", TOOL_SHUTDOWN),
    ("reboot", TOOL_REBOOT),
    ("poweroff", TOOL_POWEROFF),
    ("halt", TOOL_HALT),
    ("init", TOOL_INIT),
    ("telinit", TOOL_TELINIT),
    ("kexec", TOOL_KEXEC),
    ("systemd-shutdown", TOOL_SYSTEMD_SHUTDOWN),
    ("busybox", TOOL_BUSYBOX),
];

/// Kernel functions hooked by `kernel_hooks`, as `RawEvent::a[0]`.
pub const KHOOK_POWER_OFF: u64 = 1;
pub const KHOOK_RESTART: u64 = 2;
pub const KHOOK_HALT: u64 = 3;
pub const KHOOK_EMERGENCY_RESTART: u64 = 4;

/// Kernel signal numbers (SIGRTMIN is 32 in the kernel; glibc's SIGRTMIN, which
/// systemd uses, is 34, so systemd's "SIGRTMIN+4" is kernel signal 38).
pub const SIGINT: u32 = 2;
pub const SIGRTMIN_GLIBC: u32 = 34;

/// Signals to PID 1 that systemd treats as shutdown requests (systemd(1)):
/// SIGINT (ctrl-alt-del), SIGRTMIN+3..+7 (halt, poweroff, reboot, kexec,
/// soft-reboot) and SIGRTMIN+13..+17 (their immediate forms).
pub const SHUTDOWN_SIGNAL_MASK: u64 =
    (1 << SIGINT) | (0b11111 << (SIGRTMIN_GLIBC + 3)) | (0b11111 << (SIGRTMIN_GLIBC + 13));

/// Tracepoint field offsets (from `events/*/format`, checked by a test).
pub mod tp {
    /// `syscalls/sys_enter_*`: the syscall's arguments, 8 bytes each.
    pub const SYSCALL_ARG0: usize = 16;
    /// `syscalls/sys_exit_*`: `long ret`.
    pub const SYSCALL_RET: usize = 16;
    /// `sched/sched_process_exec`: `__data_loc char[] filename`.
    pub const EXEC_FILENAME_LOC: usize = 8;
    /// `signal/signal_generate`.
    pub const SIG_SIG: usize = 8;
    pub const SIG_CODE: usize = 16;
    pub const SIG_PID: usize = 36;
    pub const SIG_GROUP: usize = 40;
    pub const SIG_RESULT: usize = 44;
}

/// One detection, as written by every hook.
///
/// `a` holds the hook's own values:
/// - reboot: magic1, magic2, cmd, 0;
/// - reboot exit: magic1, magic2, cmd, the return value (as i64);
/// - signal: signal number, si_code, result, group;
/// - kernel: a `KHOOK_*`;
/// - exec: the `TOOLS` value of the basename.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawEvent {
    pub source: u32,
    pub flags: u32,
    /// CLOCK_BOOTTIME nanoseconds.
    pub boot_ns: u64,
    /// Global (initial namespace) thread id and thread-group id.
    pub pid: u32,
    pub tgid: u32,
    /// The same ids as seen in the node's PID namespace (0 outside it).
    pub ns_pid: u32,
    pub ns_tgid: u32,
    pub uid: u32,
    pub gid: u32,
    /// Global tgid of the parent (real_parent), 0 when unknown.
    pub ppid: u32,
    /// Effective uid (in the initial user namespace), with `FLAG_CREDS`.
    pub euid: u32,
    pub cgroup_id: u64,
    pub comm: [u8; COMM_LEN],
    pub parent_comm: [u8; COMM_LEN],
    pub a: [u64; 4],
    pub path_len: u32,
    pub args_len: u32,
    pub path: [u8; PATH_LEN],
    pub args: [u8; ARGS_LEN],
}

impl RawEvent {
    pub const ZERO: RawEvent = RawEvent {
        source: 0,
        flags: 0,
        boot_ns: 0,
        pid: 0,
        tgid: 0,
        ns_pid: 0,
        ns_tgid: 0,
        uid: 0,
        gid: 0,
        ppid: 0,
        euid: 0,
        cgroup_id: 0,
        comm: [0; COMM_LEN],
        parent_comm: [0; COMM_LEN],
        a: [0; 4],
        path_len: 0,
        args_len: 0,
        path: [0; PATH_LEN],
        args: [0; ARGS_LEN],
    };

    /// Reads a record from ring-buffer bytes; `None` if it is too short.
    #[allow(unsafe_code)] // the loader's read of the kernel's record
    pub fn from_bytes(bytes: &[u8]) -> Option<RawEvent> {
        if bytes.len() < core::mem::size_of::<RawEvent>() {
            return None;
        }
        // SAFETY: RawEvent is plain old data and the length was checked.
        Some(unsafe { core::ptr::read_unaligned(bytes.as_ptr().cast::<RawEvent>()) })
    }
}

/// Packs a basename into a `TOOLS` map key, as the kernel makes comm: cut to
/// 15 bytes, zero-padded.
pub const fn tool_key(name: &[u8]) -> [u8; TOOL_NAME_LEN] {
    let mut key = [0u8; TOOL_NAME_LEN];
    let mut i = 0;
    while i < name.len() && i < TOOL_NAME_LEN - 1 {
        key[i] = name[i];
        i += 1;
    }
    key
}
