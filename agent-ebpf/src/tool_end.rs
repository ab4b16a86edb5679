//! `sched/sched_process_exit`, and every exec (`exec.rs` calls [`ended`]):
//! a tool whose exec the agent holds as a proof of death ended without the
//! kernel going down: its process exited (or was killed), or it exec'd
//! another program. `exec.rs` puts every capable caller's tool exec in
//! `WATCH`, unmarked; the agent marks the one its proof rests on, and only
//! a marked one's end is reported. Any other exit costs one hash lookup.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use lastgasp_common::{RecordSource, ToolEnd, ToolEnded};

use crate::event::{done, emit, new_event};

/// Capable callers' tool execs, by tgid: 0 unmarked, 1 marked by the agent.
#[map]
static WATCH: LruHashMap<u32, u32> = LruHashMap::with_max_entries(256, 0);

#[tracepoint]
pub fn sched_process_exit(_ctx: TracePointContext) -> u32 {
    done(RecordSource::ToolEnd, try_sched_process_exit())
}

fn try_sched_process_exit() -> Result<(), i64> {
    let id = bpf_get_current_pid_tgid();
    if id as u32 != (id >> 32) as u32 {
        return Ok(()); // a thread: the process goes on
    }
    ended((id >> 32) as u32, ToolEnded::Exited)
}

/// A capable caller's tool now runs in `tgid`: watched, unmarked.
#[inline(always)]
pub fn watch(tgid: u32) {
    let _ = WATCH.insert(tgid, 0, 0);
}

/// `tgid` runs its tool no more: reported when the agent marked it.
#[inline(always)]
pub fn ended(tgid: u32, how: ToolEnded) -> Result<(), i64> {
    let Some(&mark) = (unsafe { WATCH.get(tgid) }) else {
        return Ok(()); // not a watched tool
    };
    let _ = WATCH.remove(tgid);
    if mark == 0 {
        return Ok(());
    }
    let ev = new_event(RecordSource::ToolEnd).ok_or(-1)?;
    ev.set(&ToolEnd { how: Some(how) });
    emit(ev);
    Ok(())
}
