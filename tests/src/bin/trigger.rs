//! Safe shutdown triggers for tests, in a single-threaded process of its own.
//!
//! A reboot(2) with valid magic powers off whatever PID namespace it runs in.
//! Here it only ever runs as PID 1 of a PID namespace this process created,
//! after checking in code that getpid() == 1 and that the namespace is neither
//! the parent's nor the initial one. Then it only ends that namespace.
#![allow(unsafe_code)] // reboot(2), fork and signal set-up by raw syscalls, in a process of its own
use std::{
    os::unix::fs::MetadataExt,
    process::exit,
    sync::atomic::{AtomicU64, Ordering},
};

use nix::{
    sched::{unshare, CloneFlags},
    sys::wait::{waitpid, WaitStatus},
    unistd::{fork, getpid, ForkResult},
};

const INIT_PIDNS_INO: u64 = 0xEFFF_FFFC;
const MAGIC1: libc::c_long = 0xfee1dead;
const MAGIC2: libc::c_long = 672274793;
const CMD_RESTART: libc::c_long = 0x01234567;
const CMD_HALT: libc::c_long = 0xCDEF0123;
const CMD_POWER_OFF: libc::c_long = 0x4321FEDC;

fn usage() -> ! {
    eprintln!(
        "usage: LASTGASP_STANDIN=sleep:MS|exec:MS:PATH lastgasp-trigger (a copy under a tool's name) | lastgasp-trigger bad-magic-reboot CMD_HEX | bad-magic-reboots N INTERVAL_MS | unprivileged-reboot-flood SECS | pidns-reboot poweroff|restart|halt | fake-init | nobody-init | reboot-init | exec-in-pidns PATH [ARGS...] | exec-loop N | exec-loop-in-pidns N PATH [ARGS...]"
    );
    exit(2)
}

/// Copied under a shutdown tool's name, a tool that never reboots:
/// `sleep:MS` runs MS milliseconds and exits 0; `exec:MS:PATH` runs MS
/// milliseconds, then exec's PATH.
fn stand_in_tool(how: &str) -> ! {
    use std::os::unix::process::CommandExt;
    let mut parts = how.splitn(3, ':');
    let (what, ms) = (parts.next(), parts.next().and_then(|m| m.parse().ok()));
    let Some(ms) = ms else { usage() };
    std::thread::sleep(std::time::Duration::from_millis(ms));
    match (what, parts.next()) {
        (Some("sleep"), None) => exit(0),
        (Some("exec"), Some(path)) => {
            let e = std::process::Command::new(path).exec();
            eprintln!("exec {path}: {e}");
            exit(1)
        }
        _ => usage(),
    }
}

fn pidns_ino() -> u64 {
    std::fs::metadata("/proc/self/ns/pid")
        .expect("stat /proc/self/ns/pid")
        .ino()
}

fn main() {
    if let Ok(how) = std::env::var("LASTGASP_STANDIN") {
        stand_in_tool(&how);
    }
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("bad-magic-reboot") => {
            let cmd = args
                .get(2)
                .map(|s| i64::from_str_radix(s.trim_start_matches("0x"), 16))
                .unwrap_or_else(|| usage());
            let cmd = cmd.unwrap_or_else(|_| usage());
            // magic1 = 0 is never valid: the kernel answers EINVAL and does nothing.
            let errno = bad_magic_reboot(cmd as libc::c_long);
            println!("errno {errno:?}");
            exit(if errno == Some(libc::EINVAL) { 0 } else { 1 });
        }
        Some("bad-magic-reboots") => {
            // N reboot(2) calls with magic1 = 0 (EINVAL, harmless) and cmd
            // MARKER_CMD + i: each one's record can be told apart.
            let n: u32 = args
                .get(2)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| usage());
            let gap: u64 = args
                .get(3)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| usage());
            for i in 0..n {
                let rc = bad_magic_reboot(MARKER_CMD + i as libc::c_long);
                if rc != Some(libc::EINVAL) {
                    eprintln!("marker {i}: expected EINVAL, got {rc:?}");
                    exit(1);
                }
                std::thread::sleep(std::time::Duration::from_millis(gap));
            }
            println!("markers {n}");
            exit(0)
        }
        Some("unprivileged-reboot-flood") => {
            let secs: u64 = args
                .get(2)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| usage());
            unprivileged_flood(std::time::Duration::from_secs(secs))
        }
        Some("pidns-reboot") => {
            let cmd = match args.get(2).map(String::as_str) {
                Some("poweroff") => CMD_POWER_OFF,
                Some("restart") => CMD_RESTART,
                Some("halt") => CMD_HALT,
                _ => usage(),
            };
            in_fresh_pidns(|| namespace_reboot(cmd))
        }
        Some("fake-init") => in_fresh_pidns(|| fake_init()),
        Some("nobody-init") => in_fresh_pidns(|| usr1_init(true)),
        Some("reboot-init") => in_fresh_pidns(|| usr1_init(false)),
        Some("exec-loop-in-pidns") if args.len() > 3 => {
            let n: u32 = args[2].parse().unwrap_or_else(|_| usage());
            in_fresh_pidns(|| {
                let start = std::time::Instant::now();
                for _ in 0..n {
                    let _ = std::process::Command::new(&args[3])
                        .args(&args[4..])
                        .status();
                }
                eprintln!("{n} execs in {:.2} s", start.elapsed().as_secs_f64());
            })
        }
        Some("exec-loop") => {
            // fork+exec+wait of /usr/bin/true N times; prints µs per exec.
            let n: u32 = args
                .get(2)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| usage());
            let start = std::time::Instant::now();
            for _ in 0..n {
                std::process::Command::new("/usr/bin/true")
                    .status()
                    .expect("exec /usr/bin/true");
            }
            println!("{:.3}", start.elapsed().as_secs_f64() * 1e6 / n as f64);
        }
        Some("exec-in-pidns") if args.len() > 2 => in_fresh_pidns(|| {
            use std::os::unix::process::CommandExt;
            let err = std::process::Command::new(&args[2]).args(&args[3..]).exec();
            eprintln!("exec {}: {err}", args[2]);
        }),
        _ => usage(),
    }
}

/// The first marker's cmd (not a reboot(2) command).
const MARKER_CMD: libc::c_long = 0x1000;

/// reboot(2) with magic1 = 0, never valid: the kernel refuses it (EINVAL for
/// a caller with CAP_SYS_BOOT, EPERM for others) and does nothing. The errno.
fn bad_magic_reboot(cmd: libc::c_long) -> Option<i32> {
    let rc = unsafe {
        libc::syscall(
            libc::SYS_reboot,
            0 as libc::c_long,
            0 as libc::c_long,
            cmd,
            0,
        )
    };
    (rc == -1).then(|| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// One process per CPU, pinned to it, as uid/gid 65534 (no capabilities),
/// calling reboot(2) as fast as it can for `secs`; prints the calls made.
fn unprivileged_flood(secs: std::time::Duration) -> ! {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let mut children = Vec::new();
    for cpu in 0..cpus {
        let (r, w) = nix::unistd::pipe().expect("pipe");
        // SAFETY: single-threaded process.
        match unsafe { fork() }.expect("fork") {
            ForkResult::Child => {
                drop(r);
                let mut set = nix::sched::CpuSet::new();
                let _ = set.set(cpu);
                let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
                let nobody = nix::unistd::Gid::from_raw(65534);
                nix::unistd::setgroups(&[]).expect("setgroups");
                nix::unistd::setresgid(nobody, nobody, nobody).expect("setresgid");
                let nobody = nix::unistd::Uid::from_raw(65534);
                nix::unistd::setresuid(nobody, nobody, nobody).expect("setresuid");
                let end = std::time::Instant::now() + secs;
                let mut calls: u64 = 0;
                while std::time::Instant::now() < end {
                    for _ in 0..1000 {
                        if bad_magic_reboot(0) != Some(libc::EPERM) {
                            eprintln!("an unprivileged reboot(2) did not fail with EPERM");
                            exit(1);
                        }
                    }
                    calls += 1000;
                }
                let _ = nix::unistd::write(&w, &calls.to_le_bytes());
                exit(0)
            }
            ForkResult::Parent { child } => {
                drop(w);
                children.push((child, r));
            }
        }
    }
    let mut total = 0u64;
    let mut ok = true;
    for (child, r) in children {
        let mut buf = [0u8; 8];
        let _ = nix::unistd::read(&r, &mut buf);
        total += u64::from_le_bytes(buf);
        ok &= matches!(waitpid(child, None), Ok(WaitStatus::Exited(_, 0)));
    }
    println!("calls {total} cpus {cpus}");
    exit(if ok { 0 } else { 1 })
}

/// Runs `init` as PID 1 of a new PID namespace; prints its global pid, then
/// how it ended, and exits.
fn in_fresh_pidns<F: FnOnce()>(init: F) -> ! {
    let parent_ns = pidns_ino();
    PARENT_NS.store(parent_ns, Ordering::SeqCst);
    unshare(CloneFlags::CLONE_NEWPID).expect("unshare(CLONE_NEWPID) (needs CAP_SYS_ADMIN)");
    // SAFETY: single-threaded process.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            if !in_fresh_pidns_as_init() {
                eprintln!("refusing: not PID 1 of a fresh PID namespace");
                exit(99);
            }
            init();
            exit(3)
        }
        ForkResult::Parent { child } => {
            println!("init {}", child.as_raw());
            let how = match waitpid(child, None).expect("waitpid") {
                WaitStatus::Signaled(_, sig, _) => format!("signal {sig:?}"),
                WaitStatus::Exited(_, code) => format!("exit {code}"),
                other => format!("{other:?}"),
            };
            println!("ended {how}");
            exit(0)
        }
    }
}

static PARENT_NS: AtomicU64 = AtomicU64::new(INIT_PIDNS_INO);

/// PID 1 of a PID namespace that is neither our parent's nor the initial one.
fn in_fresh_pidns_as_init() -> bool {
    let ns = pidns_ino();
    getpid().as_raw() == 1 && ns != PARENT_NS.load(Ordering::SeqCst) && ns != INIT_PIDNS_INO
}

/// reboot(2) with valid magic, only as PID 1 of a fresh PID namespace
/// (checked here again): the kernel then ends this namespace only.
fn namespace_reboot(cmd: libc::c_long) -> ! {
    if !in_fresh_pidns_as_init() {
        eprintln!("refusing reboot(2): not PID 1 of a fresh PID namespace");
        exit(99);
    }
    let rc = unsafe { libc::syscall(libc::SYS_reboot, MAGIC1, MAGIC2, cmd, 0) };
    eprintln!("reboot returned {rc}: {}", std::io::Error::last_os_error());
    exit(3)
}

extern "C" fn noop(_: libc::c_int) {}

/// Waits for SIGUSR1 (not a shutdown signal), then calls reboot(2) with
/// valid magic, power off: as root, the namespace ends (SIGINT); with
/// `nobody`, it first becomes uid/gid 65534 (which clears every capability,
/// CAP_SYS_BOOT among them): the kernel refuses it with EPERM, and the call
/// returns.
fn usr1_init(nobody: bool) -> ! {
    // SAFETY: plain libc calls in a single-threaded process.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = noop as extern "C" fn(libc::c_int) as usize;
        libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut());
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        while libc::sigwaitinfo(&set, std::ptr::null_mut()) <= 0 {}
        if nobody
            && (libc::setresgid(65534, 65534, 65534) != 0
                || libc::setresuid(65534, 65534, 65534) != 0)
        {
            eprintln!("setresuid(65534): {}", std::io::Error::last_os_error());
            exit(4);
        }
    }
    if !in_fresh_pidns_as_init() {
        eprintln!("refusing reboot(2): not PID 1 of a fresh PID namespace");
        exit(99);
    }
    let rc = unsafe { libc::syscall(libc::SYS_reboot, MAGIC1, MAGIC2, CMD_POWER_OFF, 0) };
    let err = std::io::Error::last_os_error();
    eprintln!("reboot returned {rc}: {err}");
    exit(if rc == -1 && err.raw_os_error() == Some(libc::EPERM) {
        0
    } else {
        5
    })
}

/// A tiny init that does what systemd does with the shutdown signals: ends
/// its namespace with the matching reboot(2) command.
fn fake_init() -> ! {
    let rtmin = libc::SIGRTMIN();
    let signals: Vec<i32> = std::iter::once(libc::SIGINT)
        .chain((3..=7).chain(13..=17).map(|o| rtmin + o))
        .collect();
    // SAFETY: plain libc signal set-up in a single-threaded process. A
    // handler (not SIG_DFL) is needed: an init ignores default-action signals.
    let sig = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in &signals {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = noop as extern "C" fn(libc::c_int) as usize;
            libc::sigaction(s, &act, std::ptr::null_mut());
            libc::sigaddset(&mut set, s);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        loop {
            let s = libc::sigwaitinfo(&set, std::ptr::null_mut());
            if s > 0 {
                break s;
            }
        }
    };
    let cmd = match (sig, sig - rtmin) {
        (libc::SIGINT, _) => CMD_RESTART,
        (_, 3 | 13) => CMD_HALT,
        (_, 4 | 14) => CMD_POWER_OFF,
        _ => CMD_RESTART,
    };
    namespace_reboot(cmd)
}
