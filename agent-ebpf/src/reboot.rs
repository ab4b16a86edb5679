//! `syscalls/sys_enter_reboot`: every reboot(2), valid magic or not. Its
//! arguments are kept by thread until `sys_exit_reboot` (`reboot_exit.rs`)
//! says whether it returned.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use lastgasp_common::{tp::SYSCALL_ARG0, SRC_REBOOT};

use crate::event::{emit, new_event};

/// Calls in flight: pid_tgid -> (magic1, magic2, cmd).
#[map]
pub static REBOOT_CALLS: LruHashMap<u64, [u64; 3]> = LruHashMap::with_max_entries(1024, 0);

#[tracepoint]
pub fn sys_enter_reboot(ctx: TracePointContext) -> u32 {
    let _ = try_sys_enter_reboot(&ctx);
    0
}

fn try_sys_enter_reboot(ctx: &TracePointContext) -> Result<(), i32> {
    let ev = new_event(SRC_REBOOT).ok_or(0)?;
    for i in 0..3 {
        ev.a[i] = unsafe { ctx.read_at::<u64>(SYSCALL_ARG0 + 8 * i)? };
    }
    let args = [ev.a[0], ev.a[1], ev.a[2]];
    let _ = REBOOT_CALLS.insert(bpf_get_current_pid_tgid(), args, 0);
    emit(ev);
    Ok(())
}
