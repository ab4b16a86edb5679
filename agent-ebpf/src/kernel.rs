//! The kernel's own power-off paths (kernel_power_off, kernel_restart,
//! kernel_halt, emergency_restart), as fentry where the kernel allows it, else
//! kprobe. Userspace probes both at start; either may be refused.
use aya_ebpf::{
    macros::{fentry, kprobe},
    programs::{FEntryContext, ProbeContext},
};
use lastgasp_common::{
    Flag, KernelCall,
    KernelFunction::{self, EmergencyRestart, Halt, PowerOff, Restart},
    RecordSource,
};

use crate::event::{done, emit, new_event};

fn kernel_hook(function: KernelFunction, flags: u32) -> u32 {
    let Some(ev) = new_event(RecordSource::Kernel) else {
        return done(RecordSource::Kernel, Err(()));
    };
    ev.flags |= flags;
    ev.set(&KernelCall {
        function: Some(function),
    });
    emit(ev);
    0
}

#[fentry(function = "kernel_power_off")]
pub fn fentry_kernel_power_off(_ctx: FEntryContext) -> u32 {
    kernel_hook(PowerOff, Flag::Fentry.bit())
}

#[fentry(function = "kernel_restart")]
pub fn fentry_kernel_restart(_ctx: FEntryContext) -> u32 {
    kernel_hook(Restart, Flag::Fentry.bit())
}

#[fentry(function = "kernel_halt")]
pub fn fentry_kernel_halt(_ctx: FEntryContext) -> u32 {
    kernel_hook(Halt, Flag::Fentry.bit())
}

#[fentry(function = "emergency_restart")]
pub fn fentry_emergency_restart(_ctx: FEntryContext) -> u32 {
    kernel_hook(EmergencyRestart, Flag::Fentry.bit())
}

#[kprobe]
pub fn kprobe_kernel_power_off(_ctx: ProbeContext) -> u32 {
    kernel_hook(PowerOff, 0)
}

#[kprobe]
pub fn kprobe_kernel_restart(_ctx: ProbeContext) -> u32 {
    kernel_hook(Restart, 0)
}

#[kprobe]
pub fn kprobe_kernel_halt(_ctx: ProbeContext) -> u32 {
    kernel_hook(Halt, 0)
}

#[kprobe]
pub fn kprobe_emergency_restart(_ctx: ProbeContext) -> u32 {
    kernel_hook(EmergencyRestart, 0)
}
