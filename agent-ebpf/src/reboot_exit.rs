//! `syscalls/sys_exit_reboot`: a reboot(2) that returns did not happen (or
//! was not a shutdown: CAD_ON, bad magic). Reported with the call's own
//! arguments, kept by `reboot.rs`, and its return value.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext,
};
use lastgasp_common::{tp::SYSCALL_RET, RebootCall, RebootReturn, RecordSource};

use crate::{
    event::{done, emit, new_event},
    reboot::REBOOT_CALLS,
};

#[tracepoint]
pub fn sys_exit_reboot(ctx: TracePointContext) -> u32 {
    done(RecordSource::RebootExit, try_sys_exit_reboot(&ctx))
}

fn try_sys_exit_reboot(ctx: &TracePointContext) -> Result<(), i64> {
    let id = bpf_get_current_pid_tgid();
    let Some(&call) = (unsafe { REBOOT_CALLS.get(id) }) else {
        return Ok(()); // its entry was not seen
    };
    let _ = REBOOT_CALLS.remove(id);
    let ret: i64 = unsafe { ctx.read_at(SYSCALL_RET)? };
    let ev = new_event(RecordSource::RebootExit).ok_or(-1)?;
    ev.set(&RebootReturn(RebootCall { ret, ..call }));
    emit(ev);
    Ok(())
}
