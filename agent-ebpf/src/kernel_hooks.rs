//! The kernel's own power-off paths (kernel_power_off, kernel_restart,
//! kernel_halt, emergency_restart), as fentry where the kernel allows it, else
//! kprobe. Userspace probes both at start; either may be refused.
use aya_ebpf::{
    macros::{fentry, kprobe},
    programs::{FEntryContext, ProbeContext},
};
use lastgasp_common::{
    FLAG_FENTRY, KHOOK_EMERGENCY_RESTART, KHOOK_HALT, KHOOK_POWER_OFF, KHOOK_RESTART, SRC_KERNEL,
};

use crate::event::{emit, new_event};

fn kernel_hook(hook: u64, flags: u32) -> u32 {
    if let Some(ev) = new_event(SRC_KERNEL) {
        ev.flags |= flags;
        ev.a[0] = hook;
        emit(ev);
    }
    0
}

#[fentry(function = "kernel_power_off")]
pub fn fentry_kernel_power_off(_ctx: FEntryContext) -> u32 {
    kernel_hook(KHOOK_POWER_OFF, FLAG_FENTRY)
}

#[fentry(function = "kernel_restart")]
pub fn fentry_kernel_restart(_ctx: FEntryContext) -> u32 {
    kernel_hook(KHOOK_RESTART, FLAG_FENTRY)
}

#[fentry(function = "kernel_halt")]
pub fn fentry_kernel_halt(_ctx: FEntryContext) -> u32 {
    kernel_hook(KHOOK_HALT, FLAG_FENTRY)
}

#[fentry(function = "emergency_restart")]
pub fn fentry_emergency_restart(_ctx: FEntryContext) -> u32 {
    kernel_hook(KHOOK_EMERGENCY_RESTART, FLAG_FENTRY)
}

#[kprobe]
pub fn kprobe_kernel_power_off(_ctx: ProbeContext) -> u32 {
    kernel_hook(KHOOK_POWER_OFF, 0)
}

#[kprobe]
pub fn kprobe_kernel_restart(_ctx: ProbeContext) -> u32 {
    kernel_hook(KHOOK_RESTART, 0)
}

#[kprobe]
pub fn kprobe_kernel_halt(_ctx: ProbeContext) -> u32 {
    kernel_hook(KHOOK_HALT, 0)
}

#[kprobe]
pub fn kprobe_emergency_restart(_ctx: ProbeContext) -> u32 {
    kernel_hook(KHOOK_EMERGENCY_RESTART, 0)
}
