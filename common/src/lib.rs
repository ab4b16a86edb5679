//! The record the eBPF programs write to the ring buffer, shared by both
//! sides; the names lastgasp writes on Nodes; and, with the `std` feature,
//! the wire types every reader shares (`wire`).
#![cfg_attr(not(feature = "std"), no_std)]
// The product crates keep functions within 80 lines (clippy.toml); a
// table may say why it does not.
#![warn(clippy::too_many_lines)]

pub mod names;
#[cfg(feature = "std")]
pub mod wire;

pub const COMM_LEN: usize = 16;
/// Bytes of the exec'd path kept (the tracepoint's `filename`).
pub const PATH_LEN: usize = 128;
/// Bytes of the NUL-separated argv kept for a matched exec.
pub const ARGS_LEN: usize = 256;
/// Tools are matched on the exec'd task's comm: the basename's first 15
/// bytes, zero-padded to 16 (TASK_COMM_LEN).
pub const TOOL_NAME_LEN: usize = 16;
/// Bytes of the exec'd binary's own file name kept (NUL-padded; a longer
/// name is cut, and then names no tool).
pub const EXE_NAME_LEN: usize = 24;

/// Which hook wrote a record (`RawEvent::source`): one per file of
/// `agent-ebpf/src/` and of the agent's `detect/hooks/`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordSource {
    Reboot = 1,
    Exec = 2,
    Signal = 3,
    Kernel = 4,
    /// `sys_exit_reboot` of a call whose entry was seen: the call returned.
    RebootExit = 5,
    /// A tool the agent watches (its proof of death) ended without the
    /// kernel going down: it exited, or exec'd something else.
    ToolEnd = 6,
}

impl RecordSource {
    pub const ALL: [RecordSource; 6] = [
        RecordSource::Reboot,
        RecordSource::Exec,
        RecordSource::Signal,
        RecordSource::Kernel,
        RecordSource::RebootExit,
        RecordSource::ToolEnd,
    ];

    pub const fn from_raw(v: u32) -> Option<RecordSource> {
        match v {
            1 => Some(RecordSource::Reboot),
            2 => Some(RecordSource::Exec),
            3 => Some(RecordSource::Signal),
            4 => Some(RecordSource::Kernel),
            5 => Some(RecordSource::RebootExit),
            6 => Some(RecordSource::ToolEnd),
            _ => None,
        }
    }

    /// The hook's name (its files' name), as metrics label it.
    pub const fn name(self) -> &'static str {
        match self {
            RecordSource::Reboot => "reboot",
            RecordSource::Exec => "exec",
            RecordSource::Signal => "signal",
            RecordSource::Kernel => "kernel",
            RecordSource::RebootExit => "reboot_exit",
            RecordSource::ToolEnd => "tool_end",
        }
    }
}

/// `ERRORS` map slots: one per `RecordSource` (its value), slot 0 unused.
pub const ERROR_SLOTS: u32 = 7;

/// What a hook found, one type per hook, packed into `RawEvent::payload`
/// and read back by the same type: no positional meaning leaks out.
pub trait Payload: Sized {
    /// The hook whose records carry it.
    const SOURCE: RecordSource;
    fn pack(&self) -> [u64; 4];
    fn unpack(p: &[u64; 4]) -> Self;
}

/// `reboot.rs` (entry) and `reboot_exit.rs`: the call's arguments, and at
/// exit its return value (0 at entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebootCall {
    pub magic1: u32,
    pub magic2: u32,
    pub cmd: u32,
    pub ret: i64,
}

/// `signal.rs`: a shutdown signal generated for the node's PID 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SignalSent {
    pub sig: u32,
    pub code: i32,
    /// The tracepoint's `result` (TRACE_SIGNAL_*: delivered, ignored, ...).
    pub result: i32,
    pub group: i32,
}

/// The kernel functions `kernel.rs` hooks.
#[repr(u64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFunction {
    PowerOff = 1,
    Restart = 2,
    Halt = 3,
    EmergencyRestart = 4,
}

/// `kernel.rs`: which power-off path the kernel entered (`None`: a value
/// this agent does not know).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelCall {
    pub function: Option<KernelFunction>,
}

/// `exec.rs`: the file name of the binary really executed (`mm->exe_file`:
/// behind every symlink; for a `#!` script, its interpreter), NUL-padded
/// (all zero: not read). The tool is read from it, or from the exec'd path
/// (the kernel's `TOOLS` lookup only chose to send the record).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ToolExec {
    pub exe: [u8; EXE_NAME_LEN],
}

/// `tool_end.rs`: how a watched tool ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolEnded {
    /// Its process exited (or was killed).
    Exited,
    /// It exec'd another program: the tool is gone from the process.
    Execd,
}

/// `tool_end.rs`'s payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolEnd {
    /// `None`: a value this agent does not know.
    pub how: Option<ToolEnded>,
}

/// `RawEvent::flags`: one bit each.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
    /// The acting task is in the node's PID namespace (else: a child namespace).
    NodePidns = 1,
    /// argv was longer than `ARGS_LEN` and was cut.
    ArgsTruncated = 2,
    /// argv could not be read (no BTF offsets, or the read faulted).
    ArgsMissing = 4,
    /// The kernel hook fired from an fentry program (else a kprobe).
    Fentry = 8,
    /// The exec'd path was longer than `PATH_LEN`: `path` holds its tail.
    PathTruncated = 16,
    /// The task's credentials were read (`euid`, `CapSysBoot`).
    Creds = 32,
    /// The task holds CAP_SYS_BOOT in its effective set, in the initial
    /// user namespace: its reboot(2) can work.
    CapSysBoot = 64,
    /// An exec: the binary really executed and the kernel's AT_SECURE were
    /// read (without it, whose privilege the exec carries is unknown).
    ExecRead = 128,
    /// An exec that gave its caller privilege it did not have: AT_SECURE
    /// (a setuid or setgid binary, file capabilities, an LSM's transition)
    /// for a caller whose real uid is not root. Its credentials are
    /// borrowed.
    Borrowed = 256,
}

impl Flag {
    pub const fn bit(self) -> u32 {
        self as u32
    }

    /// Whether `flags` has this one.
    pub const fn is_in(self, flags: u32) -> bool {
        flags & self as u32 != 0
    }
}

/// `DROPS` map slots: records lost, by scope and why. "Capable": the node's
/// records from callers that can shut it down (see `emit`); "node": the
/// node's others; "container": a child PID namespace's.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropCause {
    NodeFull = 0,
    ContainerFull = 1,
    ContainerRate = 2,
    NodeRate = 3,
    CapableFull = 4,
}

/// How many `DropCause`s there are (the `DROPS` map's size).
pub const DROP_SLOTS: u32 = 5;

/// CAP_SYS_BOOT's bit in a capability set.
pub const CAP_SYS_BOOT: u64 = 22;

/// `TOOLS` map values: which shutdown tool a basename names.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolId {
    Systemctl = 1,
    Shutdown = 2,
    Reboot = 3,
    Poweroff = 4,
    Halt = 5,
    Init = 6,
    Telinit = 7,
    Kexec = 8,
    SystemdShutdown = 9,
    /// busybox: the applet is argv[1] (or argv[0] through a symlink).
    Busybox = 100,
}

/// The basenames the exec hook matches, and their ids: the one list that
/// fills the kernel's `TOOLS` map and that the decoder reads.
pub const TOOLS: &[(&str, ToolId)] = &[
    ("systemctl", ToolId::Systemctl),
    ("shutdown", ToolId::Shutdown),
    ("reboot", ToolId::Reboot),
    ("poweroff", ToolId::Poweroff),
    ("halt", ToolId::Halt),
    ("init", ToolId::Init),
    ("telinit", ToolId::Telinit),
    ("kexec", ToolId::Kexec),
    ("systemd-shutdown", ToolId::SystemdShutdown),
    ("busybox", ToolId::Busybox),
];

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

/// One detection, as written by every hook: who acted, and in `payload`
/// what the hook found (its `Payload` type, by `source`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawEvent {
    /// A `RecordSource` value.
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
    /// The hook's `Payload`, packed: read it with `RawEvent::payload`.
    pub payload: [u64; 4],
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
        payload: [0; 4],
        path_len: 0,
        args_len: 0,
        path: [0; PATH_LEN],
        args: [0; ARGS_LEN],
    };

    /// The hook that wrote it.
    pub const fn source(&self) -> Option<RecordSource> {
        RecordSource::from_raw(self.source)
    }

    /// What the hook found, when the record is `P`'s hook's.
    pub fn payload<P: Payload>(&self) -> Option<P> {
        (self.source == P::SOURCE as u32).then(|| P::unpack(&self.payload))
    }

    /// Sets the source and the payload together.
    #[inline(always)]
    pub fn set<P: Payload>(&mut self, p: &P) {
        self.source = P::SOURCE as u32;
        self.payload = p.pack();
    }

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

impl Payload for RebootCall {
    const SOURCE: RecordSource = RecordSource::Reboot;
    #[inline(always)]
    fn pack(&self) -> [u64; 4] {
        [
            self.magic1 as u64,
            self.magic2 as u64,
            self.cmd as u64,
            self.ret as u64,
        ]
    }
    fn unpack(p: &[u64; 4]) -> Self {
        RebootCall {
            magic1: p[0] as u32,
            magic2: p[1] as u32,
            cmd: p[2] as u32,
            ret: p[3] as i64,
        }
    }
}

/// `reboot_exit.rs`'s payload: the call as it was entered, with its return.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebootReturn(pub RebootCall);

impl Payload for RebootReturn {
    const SOURCE: RecordSource = RecordSource::RebootExit;
    #[inline(always)]
    fn pack(&self) -> [u64; 4] {
        self.0.pack()
    }
    fn unpack(p: &[u64; 4]) -> Self {
        RebootReturn(RebootCall::unpack(p))
    }
}

impl Payload for SignalSent {
    const SOURCE: RecordSource = RecordSource::Signal;
    #[inline(always)]
    fn pack(&self) -> [u64; 4] {
        [
            self.sig as u64,
            self.code as i64 as u64,
            self.result as i64 as u64,
            self.group as i64 as u64,
        ]
    }
    fn unpack(p: &[u64; 4]) -> Self {
        SignalSent {
            sig: p[0] as u32,
            code: p[1] as i32,
            result: p[2] as i32,
            group: p[3] as i32,
        }
    }
}

impl Payload for KernelCall {
    const SOURCE: RecordSource = RecordSource::Kernel;
    #[inline(always)]
    fn pack(&self) -> [u64; 4] {
        [self.function.map_or(0, |f| f as u64), 0, 0, 0]
    }
    fn unpack(p: &[u64; 4]) -> Self {
        let function = match p[0] {
            1 => Some(KernelFunction::PowerOff),
            2 => Some(KernelFunction::Restart),
            3 => Some(KernelFunction::Halt),
            4 => Some(KernelFunction::EmergencyRestart),
            _ => None,
        };
        KernelCall { function }
    }
}

impl Payload for ToolExec {
    const SOURCE: RecordSource = RecordSource::Exec;
    #[inline(always)]
    fn pack(&self) -> [u64; 4] {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&self.exe[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        [word(0), word(1), word(2), 0]
    }
    fn unpack(p: &[u64; 4]) -> Self {
        let mut exe = [0u8; EXE_NAME_LEN];
        for i in 0..3 {
            exe[i * 8..i * 8 + 8].copy_from_slice(&p[i].to_le_bytes());
        }
        ToolExec { exe }
    }
}

impl Payload for ToolEnd {
    const SOURCE: RecordSource = RecordSource::ToolEnd;
    #[inline(always)]
    fn pack(&self) -> [u64; 4] {
        let how = match self.how {
            Some(ToolEnded::Exited) => 1,
            Some(ToolEnded::Execd) => 2,
            None => 0,
        };
        [how, 0, 0, 0]
    }
    fn unpack(p: &[u64; 4]) -> Self {
        let how = match p[0] {
            1 => Some(ToolEnded::Exited),
            2 => Some(ToolEnded::Execd),
            _ => None,
        };
        ToolEnd { how }
    }
}
