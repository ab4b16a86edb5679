//! Kernel timestamps are CLOCK_BOOTTIME; signals carry wall-clock time.
use std::time::SystemTime;

/// (wall clock, CLOCK_BOOTTIME) read together, to date kernel timestamps.
pub fn now_pair() -> (SystemTime, u64) {
    let wall = SystemTime::now();
    (wall, boottime_ns())
}

pub fn boottime_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).expect("CLOCK_BOOTTIME");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}
