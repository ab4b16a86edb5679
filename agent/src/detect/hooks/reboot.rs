//! `sys_enter_reboot` (`agent-ebpf/src/reboot.rs`): every reboot(2); its
//! arguments read here, for `reboot_exit.rs` too.
use lastgasp_common::{RebootCall, RecordSource};

use super::{Attach, Decoded, Hook, Intent, KernelRecord};
use crate::signal::{Detail, Effect, Kind, Source};

pub(crate) const HOOK: Hook = Hook {
    source: RecordSource::Reboot,
    attach: Attach::Tracepoint {
        prog: "sys_enter_reboot",
        category: "syscalls",
        name: "sys_enter_reboot",
        required: true,
    },
    decode: entry,
};

fn entry(r: &KernelRecord) -> Decoded {
    let raw = r.raw;
    let call: RebootCall = raw.payload().unwrap_or_default();
    let mut intent = decode_reboot(call.magic1, call.magic2, call.cmd);
    if r.in_node && raw.ns_tgid == 1 {
        // The node's init finishing an orderly shutdown (systemd-shutdown).
        intent.forced = false;
        intent.bypasses_logind = false;
    }
    if r.in_node && intent.effect == Effect::Now && r.actor.cap_sys_boot == Some(false) {
        intent.effect = Effect::None {
            why: format!(
                "the caller (euid {}) lacks CAP_SYS_BOOT in the initial user namespace: reboot(2) fails with EPERM",
                raw.euid
            ),
        };
    }
    Decoded {
        source: Source::RebootSyscall,
        intent,
        detail: detail(&call, None),
        scope: None,
    }
}

pub(super) fn detail(call: &RebootCall, ret: Option<i64>) -> Detail {
    Detail::Reboot {
        magic1: call.magic1,
        magic2: call.magic2,
        cmd: call.cmd,
        valid_magic: valid_reboot_magic(call.magic1, call.magic2),
        ret,
    }
}

/// The first argument to reboot(2).
pub(crate) const REBOOT_MAGIC1: u32 = 0xfee1_dead;
/// The second arguments to reboot(2) the kernel accepts.
pub(crate) const REBOOT_MAGIC2: [u32; 4] = [672_274_793, 85_072_278, 369_367_448, 537_993_216];

pub(crate) fn valid_reboot_magic(magic1: u32, magic2: u32) -> bool {
    magic1 == REBOOT_MAGIC1 && REBOOT_MAGIC2.contains(&magic2)
}

/// Decodes reboot(2) arguments (as the raw u32 values).
pub(crate) fn decode_reboot(magic1: u32, magic2: u32, cmd: u32) -> Intent {
    let kind = match cmd {
        0x0123_4567 | 0xa1b2_c3d4 => Kind::Reboot, // RESTART, RESTART2
        0x4321_fedc => Kind::Poweroff,
        0xcdef_0123 => Kind::Halt,
        0x4558_4543 => Kind::Kexec,
        _ => Kind::Unknown,
    };
    if !valid_reboot_magic(magic1, magic2) {
        return Intent::nothing(kind, "invalid magic: the kernel refuses it");
    }
    match cmd {
        0x89ab_cdef | 0 => Intent::nothing(Kind::Unknown, "sets ctrl-alt-del behaviour"),
        0xd000_fce2 => Intent::nothing(Kind::Unknown, "hibernation"),
        _ if kind == Kind::Unknown => {
            Intent::nothing(Kind::Unknown, format!("unknown command {cmd:#010x}"))
        }
        _ => Intent::new(kind, Effect::Now, true, true),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::{
        super::{decode, expect::*},
        *,
    };
    use lastgasp_common::Flag;

    use crate::signal::Scope;

    pub(in super::super) const POWEROFF: RebootCall = RebootCall {
        magic1: REBOOT_MAGIC1,
        magic2: 672_274_793,
        cmd: 0x4321_fedc,
        ret: 0,
    };

    #[test]
    fn reboot_syscall() {
        use Kind::*;
        const M1: u32 = REBOOT_MAGIC1;
        const M2: u32 = 672_274_793;
        let cases = [
            (0x0123_4567, forced(Reboot)),
            (0xa1b2_c3d4, forced(Reboot)),
            (0x4321_fedc, forced(Poweroff)),
            (0xcdef_0123, forced(Halt)),
            (0x4558_4543, forced(Kexec)),
            (0x89ab_cdef, none(Unknown)),
            (0x0000_0000, none(Unknown)),
            (0xd000_fce2, none(Unknown)),
            (0x1234_5678, none(Unknown)),
        ];
        for (cmd, want) in cases {
            assert_intent(&format!("{cmd:#x}"), &decode_reboot(M1, M2, cmd), &want);
        }
        for m2 in [672_274_793, 85_072_278, 369_367_448, 537_993_216] {
            assert!(valid_reboot_magic(M1, m2));
            assert_eq!(decode_reboot(M1, m2, 0x4321_fedc), forced(Poweroff));
        }
        assert_eq!(
            decode_reboot(M1, M2, 0xd000_fce2).effect,
            Effect::None {
                why: "hibernation".into()
            }
        );
        assert_eq!(
            decode_reboot(M1, M2, 0).effect,
            Effect::None {
                why: "sets ctrl-alt-del behaviour".into()
            }
        );
        assert_eq!(
            decode_reboot(M1, M2, 0x1234_5678).effect,
            Effect::None {
                why: "unknown command 0x12345678".into()
            }
        );
        // Bad magic: the kernel refuses, the kind is still decoded.
        let refused = Effect::None {
            why: "invalid magic: the kernel refuses it".into(),
        };
        for (m1, m2) in [(0xfee1_deae, M2), (M1, 0), (M1, 672_274_794), (0, 0)] {
            assert!(!valid_reboot_magic(m1, m2));
            let got = decode_reboot(m1, m2, 0x0123_4567);
            assert_eq!(got, Intent::new(Reboot, refused.clone(), false, false));
        }
        assert_eq!(decode_reboot(0, 0, 0x4558_4543).kind, Kexec);
        assert_eq!(decode_reboot(0, 0, 0xd000_fce2).kind, Unknown);
    }

    #[test]
    fn init_of_the_node_finishing_a_shutdown_is_not_forced() {
        let mut r = raw(RecordSource::Reboot as u32, Flag::NodePidns.bit());
        r.ns_tgid = 1;
        r.set(&POWEROFF);
        let s = decode(&r, now());
        assert_eq!(
            (s.kind, s.forced, s.effect.clone(), s.scope),
            (Kind::Poweroff, false, Effect::Now, Scope::Node)
        );
        r.ns_tgid = 77;
        assert!(
            decode(&r, now()).forced,
            "anyone else's reboot(2) is forced"
        );
    }
}
