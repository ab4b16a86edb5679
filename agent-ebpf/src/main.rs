//! lastgasp's kernel side: one hook per file, named as its reader in the
//! agent's `detect/hooks/`, each writing the shared `RawEvent` with its own
//! payload type (the rings and the rate limits in `event.rs`). Each hook's
//! `try_*` returns `Ok` for a record that is not its business and `Err` for
//! a failure, which is counted (`ERRORS`).
#![no_std]
#![no_main]
// The product crates keep functions within 80 lines (clippy.toml); a
// table may say why it does not.
#![warn(clippy::too_many_lines)]

mod event;
mod exec;
mod kernel;
mod reboot;
mod reboot_exit;
mod signal;
mod tool_end;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
