//! `sys_exit_reboot` (`agent-ebpf/src/reboot_exit.rs`): a reboot(2) that
//! returned, with the arguments its entry had.
use lastgasp_common::{RebootReturn, RecordSource};

use super::{
    reboot::{decode_reboot, detail},
    Attach, Decoded, Hook, KernelRecord,
};
use crate::signal::{Effect, Source};

pub(crate) const HOOK: Hook = Hook {
    source: RecordSource::RebootExit,
    attach: Attach::Tracepoint {
        prog: "sys_exit_reboot",
        category: "syscalls",
        name: "sys_exit_reboot",
        required: false,
    },
    decode: exit,
};

fn exit(r: &KernelRecord) -> Decoded {
    let RebootReturn(call) = r.raw.payload().unwrap_or_default();
    let (cmd, ret) = (call.cmd, call.ret);
    let mut intent = decode_reboot(call.magic1, call.magic2, cmd);
    // Only a shutdown that returns has failed; CAD_ON returning 0, or a bad
    // magic's EINVAL, changes nothing.
    let why = format!("reboot(2) cmd {cmd:#x} returned {}", errno_text(ret));
    intent.effect = match intent.effect {
        Effect::Now => Effect::Failed { why },
        _ => Effect::None { why },
    };
    Decoded {
        source: Source::RebootSyscall,
        intent,
        detail: detail(&call, Some(ret)),
        scope: None,
    }
}

/// A syscall's return value as text: "0", or "-1 EPERM (Operation not permitted)".
fn errno_text(ret: i64) -> String {
    if ret >= 0 {
        return ret.to_string();
    }
    // i64::MIN has no negation (found by fuzzing): errno 0, "unknown".
    let raw = ret
        .checked_neg()
        .and_then(|e| i32::try_from(e).ok())
        .unwrap_or(0);
    let errno = nix::errno::Errno::from_raw(raw);
    format!("-1 {errno:?} ({})", errno.desc())
}

#[cfg(test)]
mod tests {
    use lastgasp_common::{Flag, RebootCall};

    use super::{
        super::{decode, expect::*, reboot::tests::POWEROFF},
        *,
    };
    use crate::signal::Detail;

    #[test]
    fn a_shutdown_call_that_returned_has_failed() {
        let mut r = raw(RecordSource::RebootExit as u32, Flag::NodePidns.bit());
        r.set(&RebootReturn(RebootCall {
            ret: -1,
            ..POWEROFF
        }));
        let s = decode(&r, now());
        assert_eq!(
            s.effect,
            Effect::Failed {
                why: "reboot(2) cmd 0x4321fedc returned -1 EPERM (Operation not permitted)".into()
            }
        );
        assert!(
            matches!(s.detail, Detail::Reboot { ret: Some(-1), .. }),
            "{:?}",
            s.detail
        );
        // CAD_ON returning 0 changes nothing.
        r.set(&RebootReturn(RebootCall {
            cmd: 0x89ab_cdef,
            ret: 0,
            ..POWEROFF
        }));
        assert!(matches!(decode(&r, now()).effect, Effect::None { .. }));
    }
}
