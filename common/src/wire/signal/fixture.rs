//! Signals as each source reports them, for tests (the `fixtures` feature):
//! one place for a record's shape, so that a test states only what it is
//! about (`ShutdownSignal::of(Source::Exec, Kind::Reboot).forced(true)`).
use std::time::SystemTime;

use super::{Actor, BusSender, Detail, Effect, Kind, Scope, ShutdownSignal, Source};

/// The valid reboot(2) magic and a power-off command.
pub const REBOOT_POWER_OFF: Detail = Detail::Reboot {
    magic1: 0xfee1_dead,
    magic2: 672_274_793,
    cmd: 0x4321_fedc,
    valid_magic: true,
    ret: None,
};

impl ShutdownSignal {
    /// `kind` from `source`, as that source reports it: node scope, now, at
    /// the epoch; forced where the source is (a reboot(2), the kernel);
    /// a bus signal from the name's owner; no actor.
    pub fn of(source: Source, kind: Kind) -> Self {
        let detail = match source {
            Source::Exec => Detail::Exec {
                path: "/usr/bin/systemctl".into(),
                binary: None,
                argv: vec!["systemctl".into()],
                raw: String::new(),
                truncated: false,
            },
            Source::RebootSyscall => REBOOT_POWER_OFF,
            Source::SignalPid1 => Detail::Signal {
                signo: 38,
                name: "SIGRTMIN+4".into(),
                result: "delivered".into(),
            },
            Source::KernelHook => Detail::Kernel {
                function: "kernel_power_off".into(),
                via: "kprobe".into(),
            },
            Source::Logind | Source::Systemd => Detail::Dbus {
                member: "PrepareForShutdown".into(),
                unit: None,
            },
            Source::ShutdownHook | Source::FinalUnit | Source::FinalSweep => Detail::Hook {
                verb: "poweroff".into(),
            },
            Source::ToolEnd => Detail::ToolEnd {
                how: "exited".into(),
            },
        };
        let bus = matches!(source, Source::Logind | Source::Systemd);
        ShutdownSignal {
            source,
            kind,
            forced: false,
            bypasses_logind: false,
            calls_reboot: false,
            scope: Scope::Node,
            effect: Effect::Now,
            actor: None,
            sender: bus.then(|| BusSender {
                unique: ":1.1".into(),
                owns_name: true,
            }),
            at: SystemTime::UNIX_EPOCH,
            boot_ns: 0,
            deadline: None,
            detail,
        }
        .effect_of(source)
        .forced(matches!(source, Source::RebootSyscall | Source::KernelHook))
    }

    /// Forced or not; past logind when forced or from anything but logind
    /// or an exec.
    pub fn forced(mut self, forced: bool) -> Self {
        self.forced = forced;
        self.bypasses_logind = forced || !matches!(self.source, Source::Logind | Source::Exec);
        self
    }

    /// A tool's end says only that its proof fails.
    fn effect_of(mut self, source: Source) -> Self {
        if source == Source::ToolEnd {
            self.effect = Effect::Failed {
                why: "the tool exited without a reboot(2) reaching the kernel".into(),
            };
        }
        self
    }

    /// The tool calls reboot(2) itself (`poweroff -f`).
    pub fn calling_reboot(mut self) -> Self {
        self.calls_reboot = true;
        self
    }

    pub fn effect(mut self, effect: Effect) -> Self {
        self.effect = effect;
        self
    }

    pub fn at(mut self, at: SystemTime) -> Self {
        self.at = at;
        self
    }

    pub fn boot_ns(mut self, boot_ns: u64) -> Self {
        self.boot_ns = boot_ns;
        self
    }

    pub fn by(mut self, actor: Actor) -> Self {
        self.actor = Some(actor);
        self
    }

    pub fn deadline(mut self, deadline: SystemTime) -> Self {
        self.deadline = Some(deadline);
        self
    }

    pub fn detail(mut self, detail: Detail) -> Self {
        self.detail = detail;
        self
    }

    /// A bus signal with no sender recorded.
    pub fn without_sender(mut self) -> Self {
        self.sender = None;
        self
    }
}
