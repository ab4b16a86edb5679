//! `syscalls/sys_enter_reboot`: every reboot(2), valid magic or not.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use lastgasp_common::{tp::SYSCALL_ARG0, SRC_REBOOT};

use crate::event::{emit, new_event};

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
    emit(ev);
    Ok(())
}
