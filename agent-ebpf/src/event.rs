//! What every hook shares: the maps, the node's identity, and `emit`.
use aya_ebpf::{
    bindings::bpf_pidns_info,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
        bpf_probe_read_kernel,
        generated::{
            bpf_get_current_cgroup_id, bpf_get_current_task, bpf_get_ns_current_pid_tgid,
            bpf_ktime_get_boot_ns,
        },
    },
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use lastgasp_common::{
    DropCause, Flag, RawEvent, RecordSource, CAP_SYS_BOOT, DROP_SLOTS, ERROR_SLOTS,
};

/// The node's PID namespace (st_dev/st_ino of its `ns/pid` file) and the
/// global pid of its init; set by userspace before load.
#[unsafe(no_mangle)]
static NODE_PIDNS_DEV: u64 = 0;
#[unsafe(no_mangle)]
static NODE_PIDNS_INO: u64 = 0;
#[unsafe(no_mangle)]
pub static NODE_INIT_PID: u32 = 1;

/// Offsets of task_struct.real_parent, .tgid and .comm from the kernel's BTF
/// (0: the parent is not read).
#[unsafe(no_mangle)]
static TASK_REAL_PARENT_OFF: u64 = 0;
#[unsafe(no_mangle)]
static TASK_TGID_OFF: u64 = 0;
#[unsafe(no_mangle)]
static TASK_COMM_OFF: u64 = 0;

/// Offsets of task_struct.cred, cred.euid, cred.cap_effective, cred.user_ns
/// and user_namespace.level (0: credentials are not read).
#[unsafe(no_mangle)]
static TASK_CRED_OFF: u64 = 0;
#[unsafe(no_mangle)]
static CRED_EUID_OFF: u64 = 0;
#[unsafe(no_mangle)]
static CRED_CAP_EFFECTIVE_OFF: u64 = 0;
#[unsafe(no_mangle)]
static CRED_USER_NS_OFF: u64 = 0;
#[unsafe(no_mangle)]
static USER_NS_LEVEL_OFF: u64 = 0;

/// Records from callers that cannot shut the node down, per scope: at most
/// `*_BURST` at once per CPU, refilled at `*_PER_SEC` per CPU.
#[unsafe(no_mangle)]
static CONTAINER_PER_SEC: u64 = 50;
#[unsafe(no_mangle)]
static CONTAINER_BURST: u64 = 100;
#[unsafe(no_mangle)]
static NODE_PER_SEC: u64 = 50;
#[unsafe(no_mangle)]
static NODE_BURST: u64 = 100;

/// Three rings, so that no flood fills another's: the node's records from
/// callers that can shut it down (never rate-limited: only they can flood
/// it, and they can power off anyway), the node's others, containers'.
#[map]
static EVENTS_CAPABLE: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);
#[map]
static EVENTS_NODE: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);
#[map]
static EVENTS_CONTAINER: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Records lost, by `DropCause` slot; userspace sums the CPUs.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DROP_SLOTS, 0);

/// Records a hook failed to write (a helper or a read that failed), by
/// `RecordSource`; userspace sums the CPUs. Not counted: records that are not
/// the hook's business.
#[map]
static ERRORS: PerCpuArray<u64> = PerCpuArray::with_max_entries(ERROR_SLOTS, 0);

/// A hook's exit: its failure counted. Tracing programs return 0 either way.
#[inline(always)]
pub fn done<E>(source: RecordSource, r: Result<(), E>) -> u32 {
    if r.is_err() {
        if let Some(n) = ERRORS.get_ptr_mut(source as u32) {
            unsafe { *n += 1 };
        }
    }
    0
}

/// A token bucket per CPU and scope (`BUCKET_*`): (tokens × 1e9, last
/// refill ns). Per CPU, so no lock: the limit is per CPU.
#[map]
static BUCKET: PerCpuArray<[u64; 2]> = PerCpuArray::with_max_entries(2, 0);
const BUCKET_CONTAINER: u32 = 0;
const BUCKET_NODE: u32 = 1;

/// One record per CPU to build events in (too large for the 512-byte stack).
#[map]
static SCRATCH: PerCpuArray<RawEvent> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
pub fn global<T: Copy>(v: &T) -> T {
    // SAFETY: a read of a loader-set global; volatile keeps the compiler from
    // folding in the default.
    unsafe { core::ptr::read_volatile(v) }
}

/// This CPU's record to build an event in.
#[inline(always)]
pub fn scratch() -> Option<&'static mut RawEvent> {
    // SAFETY: tracing programs do not nest on one CPU, so nothing else holds it.
    Some(unsafe { &mut *SCRATCH.get_ptr_mut(0)? })
}

/// The per-CPU record, with the acting task's identity filled in.
#[inline(always)]
pub fn new_event(source: RecordSource) -> Option<&'static mut RawEvent> {
    let ev = scratch()?;
    fill_actor(ev, source);
    ev.path_len = 0;
    ev.args_len = 0;
    Some(ev)
}

/// Sets `source`, the time, `flags` and the acting task's identity, and
/// clears the payload.
#[inline(always)]
pub fn fill_actor(ev: &mut RawEvent, source: RecordSource) {
    ev.source = source as u32;
    ev.boot_ns = unsafe { bpf_ktime_get_boot_ns() };
    let pid_tgid = bpf_get_current_pid_tgid();
    ev.pid = pid_tgid as u32;
    ev.tgid = (pid_tgid >> 32) as u32;
    let uid_gid = bpf_get_current_uid_gid();
    ev.uid = uid_gid as u32;
    ev.gid = (uid_gid >> 32) as u32;
    ev.cgroup_id = unsafe { bpf_get_current_cgroup_id() };
    ev.comm = bpf_get_current_comm().unwrap_or([0; 16]);
    // The parent as it is now: userspace may find it gone from /proc.
    ev.ppid = 0;
    ev.parent_comm = [0; 16];
    let parent_off = global(&TASK_REAL_PARENT_OFF);
    if parent_off != 0 {
        unsafe {
            let task = bpf_get_current_task() as *const u8;
            if let Ok(parent) =
                bpf_probe_read_kernel(task.add(parent_off as usize) as *const *const u8)
            {
                ev.ppid = bpf_probe_read_kernel(
                    parent.add(global(&TASK_TGID_OFF) as usize) as *const u32
                )
                .unwrap_or(0);
                ev.parent_comm = bpf_probe_read_kernel(
                    parent.add(global(&TASK_COMM_OFF) as usize) as *const [u8; 16]
                )
                .unwrap_or([0; 16]);
            }
        }
    }
    ev.payload = [0; 4];
    ev.euid = 0;
    let creds = read_creds();
    let mut ns = bpf_pidns_info { pid: 0, tgid: 0 };
    let rc = unsafe {
        bpf_get_ns_current_pid_tgid(
            global(&NODE_PIDNS_DEV),
            global(&NODE_PIDNS_INO),
            &mut ns,
            core::mem::size_of::<bpf_pidns_info>() as u32,
        )
    };
    if rc == 0 {
        ev.flags = Flag::NodePidns.bit();
        ev.ns_pid = ns.pid;
        ev.ns_tgid = ns.tgid;
    } else {
        ev.flags = 0;
        ev.ns_pid = 0;
        ev.ns_tgid = 0;
    }
    if let Some((euid, flags)) = creds {
        ev.euid = euid;
        ev.flags |= flags;
    }
}

/// The current task's effective uid, and `Flag::Creds` plus
/// `Flag::CapSysBoot` when it holds CAP_SYS_BOOT in its effective set in
/// the initial user namespace (level 0). `None` without BTF offsets.
#[inline(always)]
fn read_creds() -> Option<(u32, u32)> {
    let cred_off = global(&TASK_CRED_OFF);
    if cred_off == 0 {
        return None;
    }
    unsafe {
        let task = bpf_get_current_task() as *const u8;
        let cred = bpf_probe_read_kernel(task.add(cred_off as usize) as *const *const u8).ok()?;
        let euid =
            bpf_probe_read_kernel(cred.add(global(&CRED_EUID_OFF) as usize) as *const u32).ok()?;
        // kernel_cap_t: `u64 val` (6.3+) or `u32 cap[2]`: the same 8 bytes.
        let caps =
            bpf_probe_read_kernel(cred.add(global(&CRED_CAP_EFFECTIVE_OFF) as usize) as *const u64)
                .ok()?;
        let user_ns =
            bpf_probe_read_kernel(cred.add(global(&CRED_USER_NS_OFF) as usize) as *const *const u8)
                .ok()?;
        let level =
            bpf_probe_read_kernel(user_ns.add(global(&USER_NS_LEVEL_OFF) as usize) as *const u32)
                .ok()?;
        let mut flags = Flag::Creds.bit();
        if level == 0 && caps & (1 << CAP_SYS_BOOT) != 0 {
            flags |= Flag::CapSysBoot.bit();
        }
        Some((euid, flags))
    }
}

/// Whether a record of `bucket`'s scope may go out now (a token is taken).
#[inline(always)]
fn token(bucket: u32, now: u64, per_sec: u64, burst: u64) -> bool {
    let Some(b) = BUCKET.get_ptr_mut(bucket) else {
        return false;
    };
    let b = unsafe { &mut *b };
    const NS: u64 = 1_000_000_000;
    let cap = burst * NS;
    let elapsed = now.wrapping_sub(b[1]).min(cap);
    b[1] = now;
    let tokens = (b[0] + elapsed * per_sec).min(cap);
    if tokens < NS {
        b[0] = tokens;
        return false;
    }
    b[0] = tokens - NS;
    true
}

#[inline(always)]
fn count_drop(cause: DropCause) {
    if let Some(n) = DROPS.get_ptr_mut(cause as u32) {
        unsafe { *n += 1 };
    }
}

/// Whether the record's caller can shut the node down: the kernel's own
/// hooks; a signal to the node's PID 1 (the kernel checked the sender's
/// permission before the tracepoint); the end of a tool the agent asked to
/// watch; in the node's PID namespace, its PID 1 or a task holding
/// CAP_SYS_BOOT in the initial user namespace (root when the credentials
/// could not be read), unless an exec just lent it (`Flag::Borrowed`). A
/// container's reboot(2) ends only its own PID namespace, capable or not.
#[inline(always)]
pub fn capable(ev: &RawEvent) -> bool {
    if ev.source == RecordSource::Kernel as u32
        || ev.source == RecordSource::Signal as u32
        || ev.source == RecordSource::ToolEnd as u32
    {
        return true;
    }
    ev.flags & Flag::NodePidns.bit() != 0
        && ev.flags & Flag::Borrowed.bit() == 0
        && (ev.ns_tgid == 1
            || ev.flags & Flag::CapSysBoot.bit() != 0
            || (ev.flags & Flag::Creds.bit() == 0 && ev.uid == 0))
}

/// Sends the record to its ring: a capable caller's always; the node's
/// others and containers' each within their own rate.
#[inline(always)]
pub fn emit(ev: &RawEvent) {
    if capable(ev) {
        if EVENTS_CAPABLE.output::<RawEvent>(ev, 0).is_err() {
            count_drop(DropCause::CapableFull);
        }
    } else if ev.flags & Flag::NodePidns.bit() != 0 {
        if !token(
            BUCKET_NODE,
            ev.boot_ns,
            global(&NODE_PER_SEC),
            global(&NODE_BURST),
        ) {
            count_drop(DropCause::NodeRate);
        } else if EVENTS_NODE.output::<RawEvent>(ev, 0).is_err() {
            count_drop(DropCause::NodeFull);
        }
    } else if !token(
        BUCKET_CONTAINER,
        ev.boot_ns,
        global(&CONTAINER_PER_SEC),
        global(&CONTAINER_BURST),
    ) {
        count_drop(DropCause::ContainerRate);
    } else if EVENTS_CONTAINER.output::<RawEvent>(ev, 0).is_err() {
        count_drop(DropCause::ContainerFull);
    }
}
