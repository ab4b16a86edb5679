//! `syscalls/sys_enter_reboot`: every reboot(2), valid magic or not. Its
//! arguments are kept by thread until `sys_exit_reboot` (`reboot_exit.rs`)
//! says whether it returned.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use lastgasp_common::{tp::SYSCALL_ARG0, RebootCall, RecordSource};

use crate::event::{done, emit, new_event};

/// Calls in flight, by pid_tgid.
#[map]
pub static REBOOT_CALLS: LruHashMap<u64, RebootCall> = LruHashMap::with_max_entries(1024, 0);

#[tracepoint]
pub fn sys_enter_reboot(ctx: TracePointContext) -> u32 {
    done(RecordSource::Reboot, try_sys_enter_reboot(&ctx))
}

fn try_sys_enter_reboot(ctx: &TracePointContext) -> Result<(), i64> {
    let ev = new_event(RecordSource::Reboot).ok_or(-1)?;
    let arg = |i: usize| unsafe { ctx.read_at::<u64>(SYSCALL_ARG0 + 8 * i) };
    let call = RebootCall {
        magic1: arg(0)? as u32,
        magic2: arg(1)? as u32,
        cmd: arg(2)? as u32,
        ret: 0,
    };
    ev.set(&call);
    let _ = REBOOT_CALLS.insert(bpf_get_current_pid_tgid(), call, 0);
    emit(ev);
    Ok(())
}
