//! `syscalls/sys_exit_reboot`: a reboot(2) that returns did not happen (or
//! was not a shutdown: CAD_ON, bad magic). Reported with the call's own
//! arguments, kept by `reboot.rs`, and its return value.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext,
};
use lastgasp_common::{tp::SYSCALL_RET, SRC_REBOOT_EXIT};

use crate::{
    event::{emit, new_event},
    reboot::REBOOT_CALLS,
};

#[tracepoint]
pub fn sys_exit_reboot(ctx: TracePointContext) -> u32 {
    let _ = try_sys_exit_reboot(&ctx);
    0
}

fn try_sys_exit_reboot(ctx: &TracePointContext) -> Result<(), i32> {
    let id = bpf_get_current_pid_tgid();
    let args = *unsafe { REBOOT_CALLS.get(id) }.ok_or(0)?;
    let _ = REBOOT_CALLS.remove(id);
    let ret: i64 = unsafe { ctx.read_at(SYSCALL_RET)? };
    let ev = new_event(SRC_REBOOT_EXIT).ok_or(0)?;
    ev.a = [args[0], args[1], args[2], ret as u64];
    emit(ev);
    Ok(())
}
