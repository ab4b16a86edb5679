//! `sched_process_exit` and the exec hook (`agent-ebpf/src/tool_end.rs`):
//! a tool whose exec the agent holds as a proof of death (it marked it,
//! [`crate::detect::ebpf::EbpfDetector::watch`]) ended without the kernel
//! going down. Its proof is withdrawn (`decide`).
use std::time::SystemTime;

use lastgasp_common::{RecordSource, ToolEnd, ToolEnded};

use super::{Attach, Decoded, Hook, Intent, KernelRecord};
use crate::signal::{Actor, Detail, Effect, Kind, Scope, ShutdownSignal, Source};

pub(crate) const HOOK: Hook = Hook {
    source: RecordSource::ToolEnd,
    attach: Attach::Tracepoint {
        prog: "sched_process_exit",
        category: "sched",
        name: "sched_process_exit",
        required: false,
    },
    decode: end,
};

fn end(r: &KernelRecord) -> Decoded {
    let ToolEnd { how } = r.raw.payload().unwrap_or(ToolEnd { how: None });
    Decoded {
        source: Source::ToolEnd,
        intent: Intent::new(Kind::Unknown, ended(how), false, false),
        detail: Detail::ToolEnd {
            how: how_name(how).into(),
        },
        scope: None,
    }
}

/// The end of the tool in `pid`, found when the agent asked to watch it:
/// it had ended already.
pub fn gone(pid: u32, (at, boot_ns): (SystemTime, u64)) -> ShutdownSignal {
    ShutdownSignal {
        source: Source::ToolEnd,
        kind: Kind::Unknown,
        forced: false,
        bypasses_logind: false,
        calls_reboot: false,
        scope: Scope::Node,
        effect: ended(None),
        actor: Some(Actor {
            pid,
            ..Actor::default()
        }),
        sender: None,
        at,
        boot_ns,
        deadline: None,
        detail: Detail::ToolEnd {
            how: how_name(None).into(),
        },
    }
}

/// The tool's end as the decider reads it: what it proved is withdrawn.
pub(crate) fn ended(how: Option<ToolEnded>) -> Effect {
    Effect::Failed {
        why: format!(
            "the tool {} without a reboot(2) reaching the kernel",
            how_name(how)
        ),
    }
}

fn how_name(how: Option<ToolEnded>) -> &'static str {
    match how {
        Some(ToolEnded::Exited) => "exited",
        Some(ToolEnded::Execd) => "exec'd another program",
        None => "ended",
    }
}

#[cfg(test)]
mod tests {
    use lastgasp_common::Flag;

    use super::{
        super::{decode, expect::*},
        *,
    };

    #[test]
    fn a_watched_tool_that_ends_has_failed() {
        let mut r = raw(RecordSource::ToolEnd as u32, Flag::NodePidns.bit());
        r.set(&ToolEnd {
            how: Some(ToolEnded::Exited),
        });
        let s = decode(&r, now());
        assert_eq!(s.source, Source::ToolEnd);
        assert_eq!(
            s.effect,
            Effect::Failed {
                why: "the tool exited without a reboot(2) reaching the kernel".into()
            }
        );
        assert_eq!(
            s.detail,
            Detail::ToolEnd {
                how: "exited".into()
            }
        );
        r.set(&ToolEnd {
            how: Some(ToolEnded::Execd),
        });
        assert_eq!(
            decode(&r, now()).detail,
            Detail::ToolEnd {
                how: "exec'd another program".into()
            }
        );
    }
}
