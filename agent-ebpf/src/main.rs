//! lastgasp's kernel side: one tracepoint (or kernel hook) per file, all
//! writing the shared `RawEvent` (the node's to one ring buffer, containers'
//! to another, rate-limited).
#![no_std]
#![no_main]

mod event;
mod exec;
mod kernel_hooks;
mod reboot;
mod reboot_exit;
mod signal;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
