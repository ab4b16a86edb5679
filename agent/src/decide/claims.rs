//! What a signal claims and who could cause it: its authority, whether it
//! leaves time, whether it can happen at all, and the proof of death it
//! carries (what shows that the node's kernel goes down now; its types are
//! the contract in `lastgasp_common::wire::episode`).
use super::{episode::Live, Authority};
pub use lastgasp_common::wire::episode::{Death, Proof};

use crate::signal::{Detail, Effect, Kind, Scope, ShutdownSignal, Source};

/// logind, systemd, or PID 1's final stage: not only the caller's own word.
pub(super) fn confirms_as_host(s: &ShutdownSignal) -> bool {
    matches!(
        s.source,
        Source::Logind
            | Source::Systemd
            | Source::KernelHook
            | Source::ShutdownHook
            | Source::FinalUnit
            | Source::FinalSweep
    ) || s.is_pid1_shutdown()
        || (s.source == Source::RebootSyscall && s.actor.as_ref().is_some_and(|a| a.ns_pid == 1))
}

/// Why a signal cannot end in a shutdown: a signal PID 1 never got, or a
/// forced request from a caller the kernel refuses (EPERM).
pub(super) fn cannot_happen(s: &ShutdownSignal) -> Option<String> {
    if let Detail::Signal { result, .. } = &s.detail {
        if result != "delivered" {
            return Some(format!("the signal was not delivered to PID 1 ({result})"));
        }
    }
    if s.source == Source::Exec && s.forced && can_reboot(s) != Some(true) {
        let borrowed = s.actor.as_ref().is_some_and(|a| a.borrowed == Some(true));
        return Some(if borrowed {
            format!(
                "a forced request whose privilege the exec lent ({}): the tool's own reboot(2), if any, is judged when it comes",
                who(s)
            )
        } else {
            format!(
                "a forced request from a caller that cannot reboot ({}): it fails with EPERM",
                who(s)
            )
        });
    }
    None
}

/// Whether the caller can reboot the node: CAP_SYS_BOOT in the initial user
/// namespace as the kernel read it, else (no credentials read) euid/uid 0.
/// An exec's privilege counts only where the kernel read that the exec did
/// not lend it (`Actor::borrowed`): a setuid program run under a tool's
/// name proves nothing.
pub(super) fn can_reboot(s: &ShutdownSignal) -> Option<bool> {
    let a = s.actor.as_ref()?;
    if s.source == Source::Exec && a.borrowed != Some(false) {
        return Some(false);
    }
    Some(match a.cap_sys_boot {
        Some(cap) => cap,
        None => a.euid.unwrap_or(a.uid) == 0,
    })
}

pub(super) fn authority(s: &ShutdownSignal) -> Authority {
    match s.source {
        Source::Logind | Source::Systemd => Authority::Host,
        Source::KernelHook
        | Source::RebootSyscall
        | Source::ShutdownHook
        | Source::FinalUnit
        | Source::FinalSweep => Authority::Kernel,
        // The kernel checked the sender's right to signal PID 1.
        Source::SignalPid1 => Authority::Privileged,
        Source::Exec if s.is_pid1_shutdown() => Authority::Kernel,
        Source::Exec if can_reboot(s) == Some(true) => Authority::Privileged,
        Source::Exec | Source::ToolEnd => Authority::Request,
    }
}

pub(super) fn authority_name(a: Authority) -> &'static str {
    match a {
        Authority::Request => "an unprivileged request",
        Authority::Privileged => "a privileged caller",
        Authority::Host => "logind or systemd",
        Authority::Kernel => "the kernel",
    }
}

pub(super) fn who(s: &ShutdownSignal) -> String {
    match &s.actor {
        Some(a) => format!(
            "{} (pid {}, euid {}{})",
            a.comm,
            a.pid,
            a.euid.unwrap_or(a.uid),
            match (a.cap_sys_boot, a.borrowed) {
                (_, Some(true)) =>
                    ", privilege lent by the exec (setuid, setgid or file capabilities)",
                (Some(true), _) => ", CAP_SYS_BOOT",
                (Some(false), _) => ", no CAP_SYS_BOOT",
                (None, _) => "",
            }
        ),
        None => "an unknown caller".into(),
    }
}

pub(super) fn summary(s: &ShutdownSignal) -> String {
    let what = match &s.detail {
        Detail::Exec { argv, .. } => argv.join(" "),
        Detail::Reboot { cmd, .. } => format!("reboot(2) cmd {cmd:#x}"),
        Detail::Signal { name, .. } => format!("{name} to PID 1"),
        Detail::Kernel { function, .. } => function.clone(),
        Detail::Dbus { member, unit } => match unit {
            Some(u) => format!("{member} {u}"),
            None => member.clone(),
        },
        Detail::Hook { verb } if s.source == Source::FinalUnit => {
            format!("lastgasp's final unit, every unit stopped ({verb})")
        }
        Detail::Hook { verb } if s.source == Source::FinalSweep => {
            format!("systemd-shutdown's kill sweep ended every process ({verb})")
        }
        Detail::Hook { verb } => format!("systemd-shutdown's final hook ({verb})"),
        Detail::ToolEnd { how } => format!("the tool {how}"),
    };
    let by = s
        .actor
        .as_ref()
        .map(|a| format!(" by {} ({})", a.comm, a.pid))
        .unwrap_or_default();
    format!("{what}{by}")
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
pub(super) fn prove(ep: &mut Live, s: &ShutdownSignal) -> bool {
    match proof_of(s) {
        Some(d) if ep.death.as_ref().is_none_or(|old| d.proof > old.proof) => {
            ep.death = Some(d);
            true
        }
        _ => false,
    }
}
