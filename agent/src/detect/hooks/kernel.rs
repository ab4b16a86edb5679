//! `kernel_power_off`, `kernel_restart`, `kernel_halt`, `emergency_restart`
//! (`agent-ebpf/src/kernel.rs`): the kernel's own last steps, seen
//! whatever path led there. fentry where the kernel has BPF trampolines,
//! kprobes else; either may be missing (this machine has neither).
use anyhow::{Context, Result};
use aya::{
    programs::{FEntry, KProbe},
    Btf, Ebpf,
};
use lastgasp_common::{self as common, KernelCall, KernelFunction, RecordSource};

use super::{Attach, Decoded, Hook, HookReport, HookState, Intent, KernelRecord};
use crate::signal::{Detail, Effect, Kind, Scope, Source};

pub(crate) const HOOK: Hook = Hook {
    source: RecordSource::Kernel,
    attach: Attach::KernelFunctions(&[
        "kernel_power_off",
        "kernel_restart",
        "kernel_halt",
        "emergency_restart",
    ]),
    decode: record,
};

fn record(r: &KernelRecord) -> Decoded {
    let call = r.raw.payload::<KernelCall>();
    let (function, kind) = match call.and_then(|c| c.function) {
        Some(KernelFunction::PowerOff) => ("kernel_power_off", Kind::Poweroff),
        Some(KernelFunction::Restart) => ("kernel_restart", Kind::Reboot),
        Some(KernelFunction::Halt) => ("kernel_halt", Kind::Halt),
        Some(KernelFunction::EmergencyRestart) => ("emergency_restart", Kind::Reboot),
        None => ("unknown", Kind::Unknown),
    };
    let via = if r.raw.flags & common::Flag::Fentry.bit() != 0 {
        "fentry"
    } else {
        "kprobe"
    };
    Decoded {
        source: Source::KernelHook,
        intent: Intent::new(kind, Effect::Now, true, true),
        detail: Detail::Kernel {
            function: function.into(),
            via: via.into(),
        },
        // The kernel going down is the node's, whichever task carries it.
        scope: Some(Scope::Node),
    }
}

/// Arms each function: fentry first, kprobe second; both feature-probed by
/// trying them. One report line per function.
pub(crate) fn arm(
    bpf: &mut Ebpf,
    btf: Result<&Btf, &str>,
    functions: &[&str],
    report: &mut Vec<HookReport>,
) {
    for func in functions {
        let fentry = match btf {
            Ok(btf) => (|| -> Result<()> {
                let p: &mut FEntry = bpf
                    .program_mut(&format!("fentry_{func}"))
                    .context("missing")?
                    .try_into()?;
                p.load(func, btf)?;
                p.attach()?;
                Ok(())
            })()
            .map_err(|e| refusal(&e)),
            Err(e) => Err(e.to_string()),
        };
        let state = match fentry {
            Ok(()) => {
                report.push(HookReport {
                    hook: func.to_string(),
                    attach: format!("fentry {func}"),
                    state: HookState::Armed,
                });
                continue;
            }
            Err(fentry_err) => {
                let kprobe = (|| -> Result<()> {
                    let p: &mut KProbe = bpf
                        .program_mut(&format!("kprobe_{func}"))
                        .context("missing")?
                        .try_into()?;
                    p.load()?;
                    p.attach(func, 0)?;
                    Ok(())
                })();
                match kprobe {
                    Ok(()) => HookState::Armed,
                    Err(e) => HookState::Unavailable(format!(
                        "fentry: {fentry_err}; kprobe: {}",
                        refusal(&e)
                    )),
                }
            }
        };
        let attach = if state == HookState::Armed {
            format!("kprobe {func}")
        } else {
            format!("fentry|kprobe {func}")
        };
        report.push(HookReport {
            hook: func.to_string(),
            attach,
            state,
        });
    }
}

/// A short reason for a refused hook, naming the usual causes.
fn refusal(e: &anyhow::Error) -> String {
    let s = format!("{e:#}");
    if s.contains("kprobe/type") {
        "the kernel has no kprobes (CONFIG_KPROBES off)".into()
    } else if s.contains("Operation not permitted") {
        "program load refused with EPERM (kernel lockdown, or no BPF trampoline)".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{
        super::{decode, expect::*},
        *,
    };

    #[test]
    fn kernel_hook_records_are_forced_node_shutdowns() {
        let mut r = raw(RecordSource::Kernel as u32, common::Flag::Fentry.bit());
        r.set(&KernelCall {
            function: Some(KernelFunction::PowerOff),
        });
        let s = decode(&r, now());
        assert_eq!(
            (s.source, s.kind, s.forced, s.scope),
            (Source::KernelHook, Kind::Poweroff, true, Scope::Node)
        );
        assert_eq!(
            s.detail,
            Detail::Kernel {
                function: "kernel_power_off".into(),
                via: "fentry".into()
            }
        );
        assert_eq!(
            s.at,
            now().0 - Duration::from_secs(2),
            "dated from CLOCK_BOOTTIME"
        );
    }
}
