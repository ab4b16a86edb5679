//! The decision core: a pure state machine over `ShutdownSignal`s. No I/O.
//!
//! One shutdown is usually seen several times (the exec of `systemctl`, then
//! logind's PrepareForShutdown, then systemd's job, then the final reboot(2)):
//! those merge into one episode with a timeline. Each signal yields the
//! action to take now:
//! - graceful: time is known to be available (a delay lock, a scheduled time,
//!   or service stop jobs ahead);
//! - immediate: no time (a forced path, a reboot(2) in progress);
//! - audit-only: a container's own namespace, or nothing that shuts the node;
//! - a graceful episode turns immediate the moment a forced signal arrives;
//! - a cancellation returns the node to normal.
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::signal::{Effect, Kind, Scope, ShutdownSignal, Source};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Path {
    /// A shutdown is announced for later: warn, nothing to stop yet.
    Scheduled,
    Graceful,
    Immediate,
    Cancelled,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "action")]
pub enum Action {
    /// Record it; the node is not affected.
    AuditOnly { why: String },
    /// A shutdown is due at `due`: tell the cluster early.
    Warn {
        #[serde(with = "humantime_serde")]
        due: Option<SystemTime>,
    },
    /// Start (or, from a warning, begin) the graceful path.
    Graceful {
        #[serde(with = "humantime_serde")]
        deadline: Option<SystemTime>,
        /// A logind delay lock holds the shutdown for us.
        protected: bool,
    },
    /// No time: send the last gasp now. `escalated` when a graceful episode
    /// was under way.
    Immediate { escalated: bool },
    /// The shutdown was called off: undo what the episode did.
    Cancel,
    /// Part of the episode under way; nothing new to do.
    Join,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TimelineEntry {
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    pub source: Source,
    pub kind: Kind,
    pub summary: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Episode {
    /// 1, 2, ... within this boot.
    pub id: u32,
    pub kind: Kind,
    pub path: Path,
    /// Every signal that joined, in order.
    pub timeline: Vec<TimelineEntry>,
    #[serde(with = "humantime_serde")]
    pub deadline: Option<SystemTime>,
    pub protected: bool,
    pub forced: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub action: Action,
    /// The episode after this signal (none for audit-only outside one).
    pub episode: Option<Episode>,
}

#[derive(Default)]
pub struct Decider {
    current: Option<Episode>,
    episodes: u32,
    lock_held: bool,
}

impl Decider {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the agent holds a logind delay lock (told by the logind
    /// detector): a graceful path started from another source is then
    /// protected too.
    pub fn set_lock_held(&mut self, held: bool) {
        self.lock_held = held;
    }

    pub fn episode(&self) -> Option<&Episode> {
        self.current.as_ref()
    }

    pub fn decide(&mut self, s: &ShutdownSignal) -> Decision {
        let action = self.action(s);
        if let Some(ep) = self.current.as_mut() {
            if !matches!(action, Action::AuditOnly { .. }) {
                ep.timeline.push(TimelineEntry {
                    at: s.at,
                    source: s.source,
                    kind: s.kind,
                    summary: summary(s),
                });
                if ep.kind == Kind::Unknown {
                    ep.kind = s.kind;
                }
            }
        }
        let episode = self.current.clone();
        if matches!(action, Action::Cancel) {
            self.current = None;
        }
        Decision { action, episode }
    }

    fn action(&mut self, s: &ShutdownSignal) -> Action {
        if s.scope == Scope::Container {
            return Action::AuditOnly {
                why: "a container's own PID namespace: the node is not affected".into(),
            };
        }
        let path = self.current.as_ref().map(|e| e.path);
        match &s.effect {
            Effect::None { why } | Effect::Failed { why } => Action::AuditOnly { why: why.clone() },
            Effect::Cancel => match path {
                Some(Path::Scheduled | Path::Graceful) => {
                    self.current.as_mut().unwrap().path = Path::Cancelled;
                    Action::Cancel
                }
                Some(Path::Immediate) => Action::AuditOnly {
                    why: "a forced shutdown cannot be cancelled".into(),
                },
                _ => Action::AuditOnly {
                    why: "no shutdown under way to cancel".into(),
                },
            },
            Effect::Scheduled { at, .. } => match path {
                None | Some(Path::Cancelled) => {
                    self.open(s, Path::Scheduled);
                    Action::Warn { due: *at }
                }
                Some(Path::Scheduled) => {
                    let ep = self.current.as_mut().unwrap();
                    ep.deadline = *at;
                    Action::Warn { due: *at }
                }
                Some(_) => Action::Join,
            },
            Effect::Now => self.now(s, path),
        }
    }

    fn now(&mut self, s: &ShutdownSignal, path: Option<Path>) -> Action {
        // The kernel is already shutting down: no time, whoever asked.
        let no_time = s.forced || matches!(s.source, Source::RebootSyscall | Source::KernelHook);
        if no_time {
            return match path {
                Some(Path::Immediate) => Action::Join,
                Some(Path::Graceful) | Some(Path::Scheduled) => {
                    let ep = self.current.as_mut().unwrap();
                    ep.path = Path::Immediate;
                    ep.forced |= s.forced;
                    Action::Immediate { escalated: true }
                }
                None | Some(Path::Cancelled) => {
                    self.open(s, Path::Immediate);
                    Action::Immediate { escalated: false }
                }
            };
        }
        // A request whose arguments could not be read: its confirmation
        // (logind, systemd's job, reboot(2)) will follow if it is real.
        if s.kind == Kind::Unknown && s.source == Source::Exec {
            return Action::AuditOnly {
                why: "an undecodable shutdown command: waiting for its effect".into(),
            };
        }
        // `systemctl soft-reboot` is refused by systemd < 254 (the verb is
        // unknown to PID 1), and the exec alone cannot tell: wait, as for an
        // unknown kind, for logind or systemd's soft-reboot job to confirm it.
        if s.kind == Kind::SoftReboot && s.source == Source::Exec {
            return Action::AuditOnly {
                why: "soft-reboot requested: waiting for systemd's job (systemd < 254 refuses it)"
                    .into(),
            };
        }
        let protected = s.source == Source::Logind || (self.lock_held && !s.bypasses_logind);
        match path {
            Some(Path::Graceful) => {
                let ep = self.current.as_mut().unwrap();
                ep.protected |= protected;
                if s.deadline.is_some() {
                    ep.deadline = s.deadline;
                }
                Action::Join
            }
            Some(Path::Immediate) => Action::Join,
            Some(Path::Scheduled) => {
                let ep = self.current.as_mut().unwrap();
                ep.path = Path::Graceful;
                ep.protected = protected;
                ep.deadline = s.deadline;
                Action::Graceful {
                    deadline: s.deadline,
                    protected,
                }
            }
            None | Some(Path::Cancelled) => {
                self.open(s, Path::Graceful);
                let ep = self.current.as_mut().unwrap();
                ep.protected = protected;
                Action::Graceful {
                    deadline: s.deadline,
                    protected,
                }
            }
        }
    }

    fn open(&mut self, s: &ShutdownSignal, path: Path) {
        self.episodes += 1;
        let deadline = match &s.effect {
            Effect::Scheduled { at, .. } => *at,
            _ => s.deadline,
        };
        self.current = Some(Episode {
            id: self.episodes,
            kind: s.kind,
            path,
            timeline: Vec::new(),
            deadline,
            protected: false,
            forced: s.forced,
        });
    }
}

fn summary(s: &ShutdownSignal) -> String {
    use crate::signal::Detail;
    let what = match &s.detail {
        Detail::Exec { argv, .. } => argv.join(" "),
        Detail::Reboot { cmd, .. } => format!("reboot(2) cmd {cmd:#x}"),
        Detail::Signal { name, .. } => format!("{name} to PID 1"),
        Detail::Kernel { function, .. } => function.clone(),
        Detail::Dbus { member, unit } => match unit {
            Some(u) => format!("{member} {u}"),
            None => member.clone(),
        },
    };
    let by = s
        .actor
        .as_ref()
        .map(|a| format!(" by {} ({})", a.comm, a.pid))
        .unwrap_or_default();
    format!("{what}{by}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::signal::{Actor, Detail};

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn sig(source: Source, kind: Kind, forced: bool, effect: Effect) -> ShutdownSignal {
        let detail = match source {
            Source::Exec => Detail::Exec {
                path: "/usr/bin/systemctl".into(),
                argv: vec!["systemctl".into()],
                raw: String::new(),
                truncated: false,
            },
            Source::RebootSyscall => Detail::Reboot {
                magic1: 0xfee1dead,
                magic2: 672274793,
                cmd: 0x4321fedc,
                valid_magic: true,
            },
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
        };
        ShutdownSignal {
            source,
            kind,
            forced,
            bypasses_logind: forced || !matches!(source, Source::Logind | Source::Exec),
            scope: Scope::Node,
            effect,
            actor: Some(Actor {
                pid: 100,
                comm: "x".into(),
                ..Default::default()
            }),
            sender: None,
            at: t(0),
            boot_ns: 0,
            deadline: None,
            detail,
        }
    }

    use Kind::*;
    use Source::*;

    fn exec(kind: Kind, forced: bool) -> ShutdownSignal {
        sig(Exec, kind, forced, Effect::Now)
    }
    fn logind(effect: Effect) -> ShutdownSignal {
        let mut s = sig(Logind, Unknown, false, effect);
        if s.effect == Effect::Now {
            s.deadline = Some(t(30));
        }
        s
    }
    fn job(kind: Kind) -> ShutdownSignal {
        sig(Systemd, kind, false, Effect::Now)
    }
    fn reboot2(kind: Kind, forced: bool) -> ShutdownSignal {
        sig(RebootSyscall, kind, forced, Effect::Now)
    }
    fn scheduled(at: u64) -> Effect {
        Effect::Scheduled {
            at: Some(t(at)),
            spec: format!("+{at}s"),
        }
    }
    fn none() -> Effect {
        Effect::None { why: "test".into() }
    }

    fn short(a: &Action) -> &'static str {
        match a {
            Action::AuditOnly { .. } => "audit",
            Action::Warn { .. } => "warn",
            Action::Graceful {
                protected: true, ..
            } => "graceful(protected)",
            Action::Graceful {
                protected: false, ..
            } => "graceful",
            Action::Immediate { escalated: false } => "immediate",
            Action::Immediate { escalated: true } => "escalate",
            Action::Cancel => "cancel",
            Action::Join => "join",
        }
    }

    /// Sequences of signals and the action each must yield, plus the episode
    /// ids they belong to (0: none).
    #[test]
    fn decision_table() {
        let container = {
            let mut s = reboot2(Poweroff, true);
            s.scope = Scope::Container;
            s
        };
        // (name, signals, the action each yields, the episode each joins)
        type Case = (
            &'static str,
            Vec<ShutdownSignal>,
            Vec<&'static str>,
            Vec<u32>,
        );
        let cases: Vec<Case> = vec![
            (
                "systemctl poweroff through logind, to the end",
                vec![
                    exec(Poweroff, false),
                    logind(Effect::Now),
                    job(Poweroff),
                    exec(Poweroff, false),
                    reboot2(Poweroff, false),
                ],
                vec!["graceful", "join", "join", "join", "escalate"],
                vec![1, 1, 1, 1, 1],
            ),
            (
                "logind first",
                vec![logind(Effect::Now), job(Poweroff)],
                vec!["graceful(protected)", "join"],
                vec![1, 1],
            ),
            (
                "reboot -ff",
                vec![exec(Reboot, true), reboot2(Reboot, true)],
                vec!["immediate", "join"],
                vec![1, 1],
            ),
            (
                "bare reboot(2)",
                vec![reboot2(Reboot, true)],
                vec!["immediate"],
                vec![1],
            ),
            (
                "forced during graceful escalates at once",
                vec![
                    logind(Effect::Now),
                    exec(Poweroff, true),
                    reboot2(Poweroff, true),
                ],
                vec!["graceful(protected)", "escalate", "join"],
                vec![1, 1, 1],
            ),
            (
                "systemctl start poweroff.target: a job, unprotected",
                vec![exec(Poweroff, false), job(Poweroff)],
                vec!["graceful", "join"],
                vec![1, 1],
            ),
            (
                "SIGRTMIN+4 to PID 1",
                vec![sig(SignalPid1, Poweroff, false, Effect::Now), job(Poweroff)],
                vec!["graceful", "join"],
                vec![1, 1],
            ),
            (
                "SIGRTMIN+14 to PID 1",
                vec![sig(SignalPid1, Poweroff, true, Effect::Now)],
                vec!["immediate"],
                vec![1],
            ),
            (
                "cancel then a second shutdown: a new episode",
                vec![
                    logind(Effect::Now),
                    logind(Effect::Cancel),
                    logind(Effect::Now),
                ],
                vec!["graceful(protected)", "cancel", "graceful(protected)"],
                vec![1, 1, 2],
            ),
            (
                "scheduled, then cancelled",
                vec![
                    sig(Exec, Poweroff, false, scheduled(300)),
                    sig(Logind, Poweroff, false, scheduled(300)),
                    exec(Poweroff, false).with_effect(Effect::Cancel),
                ],
                vec!["warn", "warn", "cancel"],
                vec![1, 1, 1],
            ),
            (
                "scheduled, then due: the warning turns graceful",
                vec![
                    sig(Exec, Poweroff, false, scheduled(60)),
                    logind(Effect::Now),
                    job(Poweroff),
                ],
                vec!["warn", "graceful(protected)", "join"],
                vec![1, 1, 1],
            ),
            (
                "container scope is audit only",
                vec![container.clone(), container],
                vec!["audit", "audit"],
                vec![0, 0],
            ),
            (
                "nothing to cancel; bad magic; queries",
                vec![
                    logind(Effect::Cancel),
                    reboot2(Poweroff, true).with_effect(none()),
                    exec(Unknown, false).with_effect(none()),
                ],
                vec!["audit", "audit", "audit"],
                vec![0, 0, 0],
            ),
            (
                "a forced shutdown cannot be cancelled",
                vec![exec(Poweroff, true), logind(Effect::Cancel)],
                vec!["immediate", "audit"],
                vec![1, 1],
            ),
            (
                "an undecodable command waits for its effect",
                vec![exec(Unknown, false), logind(Effect::Now)],
                vec!["audit", "graceful(protected)"],
                vec![0, 1],
            ),
            (
                "a container reboot during a node graceful episode changes nothing",
                vec![logind(Effect::Now), {
                    let mut s = reboot2(Reboot, true);
                    s.scope = Scope::Container;
                    s
                }],
                vec!["graceful(protected)", "audit"],
                vec![1, 1],
            ),
            (
                "systemctl soft-reboot waits for systemd's job (refused before systemd 254)",
                vec![exec(SoftReboot, false), job(SoftReboot)],
                vec!["audit", "graceful"],
                vec![0, 1],
            ),
            (
                "a refused soft-reboot (no job follows) never drains the node",
                vec![exec(SoftReboot, false)],
                vec!["audit"],
                vec![0],
            ),
            (
                "kernel hook alone",
                vec![sig(KernelHook, Poweroff, true, Effect::Now)],
                vec!["immediate"],
                vec![1],
            ),
        ];
        for (name, signals, want, ids) in cases {
            let mut d = Decider::new();
            let got: Vec<(&str, u32)> = signals
                .iter()
                .map(|s| {
                    let dec = d.decide(s);
                    (short(&dec.action), dec.episode.map(|e| e.id).unwrap_or(0))
                })
                .collect();
            let want: Vec<(&str, u32)> = want.into_iter().zip(ids).collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn the_episode_keeps_a_timeline_kind_and_deadline() {
        let mut d = Decider::new();
        d.decide(&exec(Poweroff, false));
        let dec = d.decide(&logind(Effect::Now));
        let ep = dec.episode.unwrap();
        assert_eq!(
            (ep.kind, ep.path, ep.deadline, ep.protected),
            (Poweroff, Path::Graceful, Some(t(30)), true)
        );
        assert_eq!(
            ep.timeline.iter().map(|e| e.source).collect::<Vec<_>>(),
            vec![Exec, Logind]
        );
        assert!(ep.timeline[0].summary.contains("by x (100)"));
    }

    #[test]
    fn a_held_lock_protects_a_graceful_path_started_by_exec() {
        let mut d = Decider::new();
        d.set_lock_held(true);
        assert_eq!(
            short(&d.decide(&exec(Reboot, false)).action),
            "graceful(protected)"
        );
        let mut d = Decider::new();
        d.set_lock_held(true);
        assert_eq!(
            short(&d.decide(&job(Reboot)).action),
            "graceful",
            "a bypassing job is not protected by our lock"
        );
    }

    #[test]
    fn unknown_kind_is_filled_in_by_later_signals() {
        let mut d = Decider::new();
        d.decide(&logind(Effect::Now));
        let ep = d.decide(&job(Reboot)).episode.unwrap();
        assert_eq!(ep.kind, Reboot);
    }

    impl ShutdownSignal {
        fn with_effect(mut self, e: Effect) -> Self {
            self.effect = e;
            self
        }
    }
}
