//! `sched/sched_process_exec`: a successful exec whose basename names a
//! shutdown tool (the `TOOLS` map), with its first arguments. Any other exec
//! costs one comm read and one hash lookup, and never reaches the ring buffer.
//! This tracepoint also sees the kernel's own usermode-helper execs (e.g.
//! orderly_poweroff running /sbin/poweroff), which syscall hooks would miss.
use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_probe_read_kernel, bpf_probe_read_kernel_buf, generated},
    macros::{map, tracepoint},
    maps::HashMap,
    programs::TracePointContext,
    EbpfContext,
};
use lastgasp_common::{
    tp::EXEC_FILENAME_LOC, RecordSource, ToolExec, ARGS_LEN, FLAG_ARGS_MISSING,
    FLAG_ARGS_TRUNCATED, FLAG_PATH_TRUNCATED, PATH_LEN, TOOL_BUSYBOX, TOOL_NAME_LEN,
};

use crate::event::{done, emit, fill_actor, global, scratch};

/// Basename (zero-padded) -> tool id; filled by userspace.
#[map]
static TOOLS: HashMap<[u8; TOOL_NAME_LEN], u32> = HashMap::with_max_entries(64, 0);

/// Offsets of task_struct.mm, mm_struct.arg_start and mm_struct.arg_end, read
/// by userspace from the kernel's BTF (a hand-done CO-RE). 0: argv unknown.
#[unsafe(no_mangle)]
static TASK_MM_OFF: u64 = 0;
#[unsafe(no_mangle)]
static MM_ARG_START_OFF: u64 = 0;
#[unsafe(no_mangle)]
static MM_ARG_END_OFF: u64 = 0;

#[tracepoint]
pub fn sched_process_exec(ctx: TracePointContext) -> u32 {
    done(RecordSource::Exec, try_sched_process_exec(&ctx))
}

fn try_sched_process_exec(ctx: &TracePointContext) -> Result<(), i64> {
    // The kernel has just set comm to the basename of the exec'd file (cut to
    // 15 bytes, zero-padded): the `TOOLS` key as it is. No loop, no copy.
    let comm = bpf_get_current_comm()?;
    let Some(&tool) = (unsafe { TOOLS.get(comm) }) else {
        return Ok(()); // not a shutdown tool
    };
    let mut tool = tool;

    let ev = scratch().ok_or(-1)?;
    let (args_len, args_flags) = read_args(ev)?;
    if tool == TOOL_BUSYBOX {
        // `busybox reboot -f`: the applet is argv[1].
        let Some(key) = argv1_key(&ev.args, args_len as usize)? else {
            return Ok(()); // no applet to read
        };
        match unsafe { TOOLS.get(key) } {
            Some(&t) if t != TOOL_BUSYBOX => tool = t,
            _ => return Ok(()), // not a shutdown applet
        }
    }

    let loc: u32 = unsafe { ctx.read_at(EXEC_FILENAME_LOC)? };
    // __data_loc: offset in the low 16 bits, length (with the NUL) in the high.
    // A long path keeps its tail, where the basename is.
    let len = (loc >> 16) as usize;
    let mut off = (loc & 0xffff) as usize;
    let mut flags = args_flags;
    if len > PATH_LEN {
        off += len - PATH_LEN;
        flags |= FLAG_PATH_TRUNCATED;
    }
    let src = unsafe { (ctx.as_ptr() as *const u8).add(off) };
    unsafe { bpf_probe_read_kernel_buf(src, &mut ev.path)? };

    fill_actor(ev, RecordSource::Exec);
    ev.flags |= flags;
    ev.path_len = len.min(PATH_LEN) as u32;
    ev.args_len = args_len;
    ev.set(&ToolExec { tool });
    emit(ev);
    Ok(())
}

/// argv[1] as a `TOOLS` key, when argv[0] (busybox's path) is under 64
/// bytes and argv[1] was captured (`None` otherwise).
// An index loop with a constant bound is what the verifier reads best.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn argv1_key(args: &[u8; ARGS_LEN], len: usize) -> Result<Option<[u8; TOOL_NAME_LEN]>, i64> {
    const ARGV0_MAX: usize = 64;
    let mut start = 0;
    for i in 0..ARGV0_MAX {
        if args[i] == 0 {
            start = i + 1;
            break;
        }
    }
    if start == 0 || start >= len {
        return Ok(None);
    }
    let mut key: [u8; TOOL_NAME_LEN] =
        unsafe { bpf_probe_read_kernel(args.as_ptr().add(start) as *const [u8; TOOL_NAME_LEN])? };
    key[TOOL_NAME_LEN - 1] = 0;
    let mut ended = false;
    for b in key.iter_mut() {
        ended |= *b == 0;
        if ended {
            *b = 0;
        }
    }
    Ok(Some(key))
}

/// Reads the new image's argv (NUL-separated) into `ev.args`; returns its
/// length and the `FLAG_ARGS_*` that apply.
fn read_args(ev: &mut lastgasp_common::RawEvent) -> Result<(u32, u32), i64> {
    let mm_off = global(&TASK_MM_OFF);
    if mm_off == 0 {
        return Ok((0, FLAG_ARGS_MISSING));
    }
    let task = unsafe { generated::bpf_get_current_task() } as *const u8;
    let mm: u64 = unsafe { bpf_probe_read_kernel(task.add(mm_off as usize) as *const u64)? };
    let start: u64 =
        unsafe { bpf_probe_read_kernel((mm + global(&MM_ARG_START_OFF)) as *const u64)? };
    let end: u64 = unsafe { bpf_probe_read_kernel((mm + global(&MM_ARG_END_OFF)) as *const u64)? };
    let mut len = end.wrapping_sub(start);
    let mut flags = 0;
    if len > ARGS_LEN as u64 {
        len = ARGS_LEN as u64;
        flags = FLAG_ARGS_TRUNCATED;
    }
    let rc = unsafe {
        generated::bpf_probe_read_user(
            ev.args.as_mut_ptr() as *mut _,
            len as u32,
            start as *const _,
        )
    };
    if rc != 0 {
        return Ok((0, FLAG_ARGS_MISSING));
    }
    Ok((len as u32, flags))
}
