//! `signal/signal_generate` aimed at the node's PID 1 with a signal systemd
//! treats as a shutdown request.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use lastgasp_common::{tp, RecordSource, SignalSent, SHUTDOWN_SIGNAL_MASK};

use crate::event::{done, emit, global, new_event, NODE_INIT_PID};

#[tracepoint]
pub fn signal_generate(ctx: TracePointContext) -> u32 {
    done(RecordSource::Signal, try_signal_generate(&ctx))
}

fn try_signal_generate(ctx: &TracePointContext) -> Result<(), i64> {
    let target: u32 = unsafe { ctx.read_at(tp::SIG_PID)? };
    if target != global(&NODE_INIT_PID) {
        return Ok(());
    }
    let sig: u32 = unsafe { ctx.read_at(tp::SIG_SIG)? };
    if sig >= 64 || (SHUTDOWN_SIGNAL_MASK >> sig) & 1 == 0 {
        return Ok(());
    }
    let ev = new_event(RecordSource::Signal).ok_or(-1)?;
    ev.set(&SignalSent {
        sig,
        code: unsafe { ctx.read_at(tp::SIG_CODE)? },
        result: unsafe { ctx.read_at(tp::SIG_RESULT)? },
        group: unsafe { ctx.read_at(tp::SIG_GROUP)? },
    });
    emit(ev);
    Ok(())
}
