// TEMPORARY STUB: replaced by the real decoder.
use crate::signal::{Effect, Kind};
use std::time::SystemTime;
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intent {
    pub kind: Kind,
    pub forced: bool,
    pub bypasses_logind: bool,
    pub effect: Effect,
}
pub fn split_argv(raw: &[u8]) -> Vec<&[u8]> {
    raw.split(|b| *b == 0).filter(|s| !s.is_empty()).collect()
}
pub fn escape_bytes(raw: &[u8]) -> String {
    raw.escape_ascii().to_string()
}
pub fn decode_exec(_path: &[u8], _argv: &[&[u8]], _t: bool, _now: SystemTime) -> Intent {
    Intent {
        kind: Kind::Unknown,
        forced: false,
        bypasses_logind: false,
        effect: Effect::Now,
    }
}
pub fn decode_reboot(_m1: u32, _m2: u32, _cmd: u32) -> Intent {
    Intent {
        kind: Kind::Unknown,
        forced: true,
        bypasses_logind: true,
        effect: Effect::Now,
    }
}
pub fn valid_reboot_magic(m1: u32, _m2: u32) -> bool {
    m1 == 0xfee1dead
}
pub fn decode_signal_to_init(_s: u32) -> Intent {
    Intent {
        kind: Kind::Unknown,
        forced: false,
        bypasses_logind: true,
        effect: Effect::Now,
    }
}
pub fn signal_name(s: u32) -> String {
    format!("SIG{s}")
}
