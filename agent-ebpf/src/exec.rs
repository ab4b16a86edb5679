//! `sched/sched_process_exec`: a successful exec whose basename names a
//! shutdown tool (the `TOOLS` map), with its first arguments, the file name
//! of the binary really executed, and whether the exec lent its caller
//! privilege (AT_SECURE). Any other exec costs one comm read and two hash
//! lookups (the second: `tool_end`'s, for a watched tool exec'ing away), and
//! never reaches the ring buffer.
//! This tracepoint also sees the kernel's own usermode-helper execs (e.g.
//! orderly_poweroff running /sbin/poweroff), which syscall hooks would miss.
use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_probe_read_kernel,
        bpf_probe_read_kernel_buf, bpf_probe_read_kernel_str_bytes, generated,
    },
    macros::{map, tracepoint},
    maps::HashMap,
    programs::TracePointContext,
    EbpfContext,
};
use lastgasp_common::{
    tp::EXEC_FILENAME_LOC, Flag, RecordSource, ToolEnded, ToolExec, ToolId, ARGS_LEN, EXE_NAME_LEN,
    PATH_LEN, TOOL_NAME_LEN,
};

use crate::{
    event::{capable, done, emit, fill_actor, global, scratch},
    tool_end,
};

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

/// Offsets of mm_struct.exe_file, of file.f_path.dentry, of
/// dentry.d_name.name and of mm_struct.saved_auxv (0: not read).
#[unsafe(no_mangle)]
static MM_EXE_FILE_OFF: u64 = 0;
#[unsafe(no_mangle)]
static FILE_DENTRY_OFF: u64 = 0;
#[unsafe(no_mangle)]
static DENTRY_NAME_OFF: u64 = 0;
#[unsafe(no_mangle)]
static MM_SAVED_AUXV_OFF: u64 = 0;

const AT_NULL: u64 = 0;
const AT_SECURE: u64 = 23;
/// AT_SECURE comes about 15th in the ELF loader's auxv (fs/binfmt_elf.c).
const AUXV_SCAN: u64 = 32;

#[tracepoint]
pub fn sched_process_exec(ctx: TracePointContext) -> u32 {
    done(RecordSource::Exec, try_sched_process_exec(&ctx))
}

fn try_sched_process_exec(ctx: &TracePointContext) -> Result<(), i64> {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // A watched tool that exec's anything is gone (a tool is watched anew).
    done(
        RecordSource::ToolEnd,
        tool_end::ended(tgid, ToolEnded::Execd),
    );
    // The kernel has just set comm to the basename of the exec'd file (cut to
    // 15 bytes, zero-padded): the `TOOLS` key as it is. No loop, no copy.
    let comm = bpf_get_current_comm()?;
    let Some(&tool) = (unsafe { TOOLS.get(comm) }) else {
        return Ok(()); // not a shutdown tool
    };

    let ev = scratch().ok_or(-1)?;
    let mm = current_mm()?;
    let (args_len, args_flags) = read_args(ev, mm)?;
    if tool == ToolId::Busybox as u32 {
        // `busybox reboot -f`: the applet is argv[1].
        let Some(key) = argv1_key(&ev.args, args_len as usize)? else {
            return Ok(()); // no applet to read
        };
        match unsafe { TOOLS.get(key) } {
            Some(&t) if t != ToolId::Busybox as u32 => {}
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
        flags |= Flag::PathTruncated.bit();
    }
    let src = unsafe { (ctx.as_ptr() as *const u8).add(off) };
    unsafe { bpf_probe_read_kernel_buf(src, &mut ev.path)? };

    fill_actor(ev, RecordSource::Exec);
    ev.flags |= flags;
    ev.path_len = len.min(PATH_LEN) as u32;
    ev.args_len = args_len;
    let mut exe = [0u8; EXE_NAME_LEN];
    if let Some(secure) = read_exe(mm, &mut exe) {
        ev.flags |= Flag::ExecRead.bit();
        // Root had it all before; anyone else was lent it by this exec.
        if secure && ev.uid != 0 {
            ev.flags |= Flag::Borrowed.bit();
        }
    }
    ev.set(&ToolExec { exe });
    if capable(ev) {
        tool_end::watch(tgid);
    }
    emit(ev);
    Ok(())
}

/// The current task's mm (0 without the offset).
#[inline(always)]
fn current_mm() -> Result<u64, i64> {
    let mm_off = global(&TASK_MM_OFF);
    if mm_off == 0 {
        return Ok(0);
    }
    let task = unsafe { generated::bpf_get_current_task() } as *const u8;
    Ok(unsafe { bpf_probe_read_kernel(task.add(mm_off as usize) as *const u64)? })
}

/// The file name of `mm`'s executable into `exe`, and whether the kernel
/// set AT_SECURE for this exec; `None` when either cannot be read.
#[inline(always)]
fn read_exe(mm: u64, exe: &mut [u8; EXE_NAME_LEN]) -> Option<bool> {
    let (exe_off, auxv_off) = (global(&MM_EXE_FILE_OFF), global(&MM_SAVED_AUXV_OFF));
    if mm == 0 || exe_off == 0 || auxv_off == 0 {
        return None;
    }
    unsafe {
        let file: u64 = bpf_probe_read_kernel((mm + exe_off) as *const u64).ok()?;
        let dentry: u64 =
            bpf_probe_read_kernel((file + global(&FILE_DENTRY_OFF)) as *const u64).ok()?;
        let name: u64 =
            bpf_probe_read_kernel((dentry + global(&DENTRY_NAME_OFF)) as *const u64).ok()?;
        bpf_probe_read_kernel_str_bytes(name as *const u8, exe).ok()?;
    }
    at_secure(mm + auxv_off)
}

/// AT_SECURE from the auxv the ELF loader saved for this exec.
#[inline(always)]
fn at_secure(auxv: u64) -> Option<bool> {
    for i in 0..AUXV_SCAN {
        let pair: [u64; 2] =
            unsafe { bpf_probe_read_kernel((auxv + 16 * i) as *const [u64; 2]) }.ok()?;
        if pair[0] == AT_SECURE {
            return Some(pair[1] != 0);
        }
        if pair[0] == AT_NULL {
            return None;
        }
    }
    None
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

/// Reads the new image's argv (NUL-separated) from `mm` into `ev.args`;
/// returns its length and the `Flag::Args*` that apply.
fn read_args(ev: &mut lastgasp_common::RawEvent, mm: u64) -> Result<(u32, u32), i64> {
    if mm == 0 {
        return Ok((0, Flag::ArgsMissing.bit()));
    }
    let start: u64 =
        unsafe { bpf_probe_read_kernel((mm + global(&MM_ARG_START_OFF)) as *const u64)? };
    let end: u64 = unsafe { bpf_probe_read_kernel((mm + global(&MM_ARG_END_OFF)) as *const u64)? };
    let mut len = end.wrapping_sub(start);
    let mut flags = 0;
    if len > ARGS_LEN as u64 {
        len = ARGS_LEN as u64;
        flags = Flag::ArgsTruncated.bit();
    }
    let rc = unsafe {
        generated::bpf_probe_read_user(
            ev.args.as_mut_ptr() as *mut _,
            len as u32,
            start as *const _,
        )
    };
    if rc != 0 {
        return Ok((0, Flag::ArgsMissing.bit()));
    }
    Ok((len as u32, flags))
}
