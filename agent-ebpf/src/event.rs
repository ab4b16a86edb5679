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
use lastgasp_common::{RawEvent, FLAG_NODE_PIDNS};

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

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Records the ring buffer refused (full); userspace sums the CPUs.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

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
pub fn new_event(source: u32) -> Option<&'static mut RawEvent> {
    let ev = scratch()?;
    fill_actor(ev, source);
    ev.path_len = 0;
    ev.args_len = 0;
    Some(ev)
}

/// Sets `source`, the time, `flags` and the acting task's identity, and
/// clears `a`.
#[inline(always)]
pub fn fill_actor(ev: &mut RawEvent, source: u32) {
    ev.source = source;
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
            if let Ok(parent) = bpf_probe_read_kernel(task.add(parent_off as usize) as *const *const u8) {
                ev.ppid = bpf_probe_read_kernel(parent.add(global(&TASK_TGID_OFF) as usize) as *const u32).unwrap_or(0);
                ev.parent_comm = bpf_probe_read_kernel(parent.add(global(&TASK_COMM_OFF) as usize) as *const [u8; 16])
                    .unwrap_or([0; 16]);
            }
        }
    }
    ev.a = [0; 4];
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
        ev.flags = FLAG_NODE_PIDNS;
        ev.ns_pid = ns.pid;
        ev.ns_tgid = ns.tgid;
    } else {
        ev.flags = 0;
        ev.ns_pid = 0;
        ev.ns_tgid = 0;
    }
}

#[inline(always)]
pub fn emit(ev: &RawEvent) {
    if EVENTS.output::<RawEvent>(ev, 0).is_err() {
        if let Some(n) = DROPS.get_ptr_mut(0) {
            unsafe { *n += 1 };
        }
    }
}
