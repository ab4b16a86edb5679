//! `signal/signal_generate` aimed at the node's PID 1 with a signal systemd
//! treats as a shutdown request.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use lastgasp_common::{tp, SHUTDOWN_SIGNAL_MASK, SRC_SIGNAL};

use crate::event::{emit, global, new_event, NODE_INIT_PID};

#[tracepoint]
pub fn signal_generate(ctx: TracePointContext) -> u32 {
    let _ = try_signal_generate(&ctx);
    0
}

fn try_signal_generate(ctx: &TracePointContext) -> Result<(), i32> {
    let target: u32 = unsafe { ctx.read_at(tp::SIG_PID)? };
    if target != global(&NODE_INIT_PID) {
        return Ok(());
    }
    let sig: u32 = unsafe { ctx.read_at(tp::SIG_SIG)? };
    if sig >= 64 || (SHUTDOWN_SIGNAL_MASK >> sig) & 1 == 0 {
        return Ok(());
    }
    let ev = new_event(SRC_SIGNAL).ok_or(0)?;
    ev.a[0] = sig as u64;
    ev.a[1] = unsafe { ctx.read_at::<i32>(tp::SIG_CODE)? } as u64;
    ev.a[2] = unsafe { ctx.read_at::<i32>(tp::SIG_RESULT)? } as u64;
    ev.a[3] = unsafe { ctx.read_at::<i32>(tp::SIG_GROUP)? } as u64;
    emit(ev);
    Ok(())
}
