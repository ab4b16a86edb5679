//! The proof of death: what shows that the node's kernel goes down now.
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::{
    claims::{can_reboot, summary},
    Episode,
};
use crate::signal::{Effect, Kind, Scope, ShutdownSignal, Source};

/// How sure the agent is that the node's kernel goes down now, weakest
/// first.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Proof {
    /// A caller that can reboot ran a tool that calls reboot(2) itself at
    /// once: nothing is stopped first, the kubelet lives until the kernel
    /// goes down, so its silence is the kernel's end.
    DirectTool,
    /// systemd's final stage: systemd-shutdown ran its own hooks (every
    /// service stopped, every other process killed, the file systems
    /// unmounted; only the final sync and reboot(2) left, and they wait for
    /// the agent's word), or lastgasp's final unit ran, right before
    /// systemd-{verb}.service: every unit stopped (every pod's scope, the
    /// kubelet, the runtime), every mount unit unmounted.
    FinalStage,
    /// The kernel's own power-off: a reboot(2) from a caller that can reboot,
    /// in the node's PID namespace (PID 1's last step after every process
    /// was stopped, or a direct caller), or the kernel's power-off functions.
    Kernel,
}

/// The proof of death an episode carries into the record.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Death {
    pub proof: Proof,
    /// When the signal that proves it was seen (the node's clock).
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// What was seen, and by whom.
    pub by: String,
    /// The process (global pid) whose exec or reboot(2) proves it: its end
    /// without the kernel going down withdraws the proof.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

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
