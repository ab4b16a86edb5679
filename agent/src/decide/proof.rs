//! The proof of death: what shows that the node's kernel goes down now
//! (its types are the contract in `lastgasp_common::wire::episode`).
use super::{
    claims::{can_reboot, summary},
    Episode,
};
pub use lastgasp_common::wire::episode::{Death, Proof};

use crate::signal::{Effect, Kind, Scope, ShutdownSignal, Source};

/// The proof of death `s` carries, if any (its caller's power is judged
/// here: a claim that cannot cause the end proves nothing).
pub fn proof_of(s: &ShutdownSignal) -> Option<Death> {
    if s.scope != Scope::Node || s.effect != Effect::Now {
        return None;
    }
    // A process's own call or exec: its end can take it back.
    let mut pid = s.actor.as_ref().map(|a| a.pid);
    let proof = match s.source {
        Source::KernelHook => {
            pid = None;
            Proof::Kernel
        }
        // Its detector checked that PID 1 is systemd-shutdown; the final
        // unit's courier, that systemd runs it for the shutdown and no pod
        // lives; the sweep's reader, that PID 1 exec'd systemd-shutdown and
        // its sweep left no process it would kill, nor any pod's.
        Source::ShutdownHook | Source::FinalUnit | Source::FinalSweep => {
            pid = None;
            Proof::FinalStage
        }
        // These commands do not return; a kexec does when no kernel is loaded.
        Source::RebootSyscall
            if can_reboot(s) == Some(true)
                && matches!(s.kind, Kind::Poweroff | Kind::Halt | Kind::Reboot) =>
        {
            Proof::Kernel
        }
        Source::Exec if s.forced && s.calls_reboot && can_reboot(s) == Some(true) => {
            Proof::DirectTool
        }
        _ => return None,
    };
    Some(Death {
        proof,
        at: s.at,
        by: summary(s),
        pid,
    })
}

/// Keeps the stronger proof: the first of equal strength stays.
pub(super) fn prove(ep: &mut Episode, s: &ShutdownSignal) -> bool {
    match proof_of(s) {
        Some(d) if ep.death.as_ref().is_none_or(|old| d.proof > old.proof) => {
            ep.death = Some(d);
            true
        }
        _ => false,
    }
}
