//! The decision core: a pure state machine over `ShutdownSignal`s and time.
//! No I/O.
//!
//! A signal is a *claim* (`docs/trust-model.md`): it counts only as
//! far as its source could really cause a shutdown.
//! - A request anyone can make (`systemctl poweroff`, `shutdown -h now`) opens
//!   a *pending* episode that does nothing until the host confirms it:
//!   logind's PrepareForShutdown(true), systemd's shutdown job, PID 1 running
//!   systemd-shutdown, or a reboot(2) from a caller that can reboot. Where no
//!   bus can be reached, a privileged caller's request is enough. A pending
//!   request that is never confirmed expires, audit-only.
//! - A forced request, a signal to PID 1, a reboot(2) and the kernel's own
//!   power-off act at once, when their caller can cause them.
//! - logind and systemd signals count only from the owner of their bus name
//!   (unless the policy trusts unowned senders, for test rigs).
//! - A cancel counts only from the authority that opened the episode, or a
//!   stronger one.
//! - Every acting episode has an expected end. Past it, the agent asks the
//!   host whether a shutdown is under way ([`Decider::tick`],
//!   [`Decider::host_answer`]); if none is, the episode is abandoned and every
//!   mark is undone. A reboot(2) that returns retracts what it started.
//!
//! One shutdown is usually seen several times (the exec of `systemctl`, then
//! logind, then systemd's job, then the final reboot(2)): those merge into one
//! episode with a timeline.
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::signal::{Detail, Effect, Kind, Scope, ShutdownSignal, Source};

/// Asks the host whether a shutdown is under way (logind, systemd).
pub type HostQuery = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = HostAnswer> + Send>>
        + Send
        + Sync,
>;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ShutdownPath {
    /// A request waits for the host to confirm it: nothing done yet.
    Pending,
    /// A shutdown is announced for later: warn, nothing to stop yet.
    Scheduled,
    Graceful,
    Immediate,
    Cancelled,
    /// The expected end passed and no shutdown came: marks undone.
    Abandoned,
    /// A pending request was never confirmed.
    Expired,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "action")]
pub enum Action {
    /// Record it; the node is not affected.
    AuditOnly { why: String },
    /// A request that may not happen: wait for the host to confirm it.
    Pending {
        #[serde(with = "humantime_serde")]
        expires: SystemTime,
    },
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
    /// The kernel itself is going down in an episode that already told the
    /// cluster: the record goes out once more, with the proof of death
    /// ([`Episode::death`]), as the agent's last word.
    LastWord,
    /// The shutdown was called off: undo what the episode did.
    Cancel,
    /// The episode's proof of death was wrong (its reboot(2) returned, its
    /// tool ended or outlived [`DecisionPolicy::direct_tool_within`]
    /// without one) and nothing else confirms the shutdown: every mark
    /// undone, the record closed as failed.
    Fail { why: String },
    /// The episode's proof of death was wrong, but logind, systemd or PID 1
    /// confirmed the shutdown: it goes on, and its record goes out again
    /// without the proof.
    Withdraw { why: String },
    /// The shutdown did not come: undo every mark the episode made.
    Abandon { why: String },
    /// A pending request ran out unconfirmed: nothing was done.
    Expire { why: String },
    /// Part of the episode under way; nothing new to do.
    Join,
}

/// As the audit writes it: `{"action":"audit-only","why":"..."}`.
impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let json = serde_json::to_string(self).map_err(|_| std::fmt::Error)?;
        f.write_str(&json)
    }
}

/// How strong a claim's source is: who could have caused it. A cancel needs
/// at least the strength that opened (or last confirmed) the episode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Authority {
    /// Anyone can ask (an unprivileged request).
    Request,
    /// A caller that can reboot (CAP_SYS_BOOT, or a signal the kernel let
    /// reach PID 1).
    Privileged,
    /// logind or systemd themselves (the owners of their bus names).
    Host,
    /// The kernel is shutting down: reboot(2), its power-off functions, PID 1
    /// running systemd-shutdown.
    Kernel,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TimelineEntry {
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    pub source: Source,
    pub kind: Kind,
    pub summary: String,
}

/// `t + d`, or the latest time a log can write when that is past it
/// (`timespan::latest`): a deadline from outside (a bus signal, a tool's
/// argument, the config) is never a panic, in the sum or in its record.
pub fn plus(t: SystemTime, d: Duration) -> SystemTime {
    let latest = crate::timespan::latest();
    t.checked_add(d)
        .map_or(latest, |x| x.min(latest))
        .max(t.min(latest))
}

/// An episode's timeline keeps its first entry and the newest, this many
/// in all: the episode (in every audit line and in the Node's record) stays
/// a few kilobytes however many requests join it.
pub const MAX_TIMELINE: usize = 32;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Episode {
    /// 1, 2, ... within this boot.
    pub id: u32,
    pub kind: Kind,
    pub path: ShutdownPath,
    /// Every signal that joined, in order: the first, then the newest
    /// (`MAX_TIMELINE` in all; a flood of joining requests cannot grow it).
    pub timeline: Vec<TimelineEntry>,
    /// Entries left out of `timeline` (after its first).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub timeline_omitted: u32,
    #[serde(with = "humantime_serde")]
    pub deadline: Option<SystemTime>,
    pub protected: bool,
    pub forced: bool,
    /// The strongest source that confirmed it.
    #[serde(default = "Authority::request")]
    pub authority: Authority,
    /// logind, systemd or PID 1 confirmed it (not only the caller's own
    /// request and reboot(2) call).
    #[serde(default)]
    pub host_confirmed: bool,
    /// The cluster was told (warn, graceful or immediate): undo on an end
    /// other than the shutdown itself.
    #[serde(default)]
    pub marked: bool,
    /// When the node should be gone (or the request confirmed) by.
    #[serde(default, with = "humantime_serde")]
    pub expected_end: Option<SystemTime>,
    /// What shows that the node's kernel is going down now, the strongest
    /// seen: the controller fences only on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub death: Option<Death>,
}

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
fn prove(ep: &mut Episode, s: &ShutdownSignal) -> bool {
    match proof_of(s) {
        Some(d) if ep.death.as_ref().is_none_or(|old| d.proof > old.proof) => {
            ep.death = Some(d);
            true
        }
        _ => false,
    }
}

impl Authority {
    fn request() -> Self {
        Authority::Request
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub action: Action,
    /// The episode after this signal (none for audit-only outside one).
    pub episode: Option<Episode>,
}

/// The decider's knobs (the config's `trust` section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionPolicy {
    /// How long a request waits for the host's confirmation.
    pub pending_expiry: Duration,
    /// How long an immediate shutdown may take before the host is asked.
    pub immediate_end: Duration,
    /// How far past a graceful deadline (or a scheduled time) the host is asked.
    pub graceful_margin: Duration,
    /// A graceful run's length when no deadline is known (the buckets' sum).
    pub graceful_length: Duration,
    /// After the host says a shutdown is under way, ask again this much later.
    pub recheck: Duration,
    /// How long a direct tool's exec stands as a proof of death without its
    /// reboot(2) reaching the kernel.
    pub direct_tool_within: Duration,
    /// Accept logind/systemd signals from peers that do not own the name
    /// (the kubelet's e2e `dbus-send` rig). Off in production.
    pub trust_unowned_bus_signals: bool,
}

impl Default for DecisionPolicy {
    fn default() -> Self {
        DecisionPolicy {
            pending_expiry: Duration::from_secs(60),
            immediate_end: Duration::from_secs(30),
            graceful_margin: Duration::from_secs(30),
            graceful_length: Duration::from_secs(30),
            recheck: Duration::from_secs(30),
            direct_tool_within: Duration::from_secs(5),
            trust_unowned_bus_signals: false,
        }
    }
}

/// What the host says when asked whether a shutdown is under way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostAnswer {
    /// Yes, with the evidence (logind preparing, a systemd shutdown job...).
    UnderWay(String),
    /// Neither logind nor systemd has a shutdown under way.
    NotUnderWay,
    /// Nobody could be asked (no bus), with why.
    Unknown(String),
}

#[derive(Default, Clone)]
pub struct Decider {
    policy: DecisionPolicy,
    current: Option<Episode>,
    episodes: u32,
    lock_held: bool,
    /// logind or systemd can be reached: requests wait for them.
    host_reachable: bool,
    /// A host check was asked for and not answered yet.
    asking: bool,
    /// The expected end the question was about: a later confirmation that
    /// moves it makes the answer moot.
    asked_end: Option<SystemTime>,
}

impl Decider {
    /// The default policy, with the host's buses assumed reachable.
    pub fn new() -> Self {
        Self::with_policy(DecisionPolicy::default())
    }

    pub fn with_policy(policy: DecisionPolicy) -> Self {
        Decider {
            policy,
            host_reachable: true,
            ..Default::default()
        }
    }

    /// Whether the agent holds a logind delay lock (told by the logind
    /// detector): a graceful path started from another source is then
    /// protected too.
    pub fn set_lock_held(&mut self, held: bool) {
        self.lock_held = held;
    }

    /// Whether logind or systemd can be reached. When neither can, nothing
    /// will confirm a request, and a privileged caller's is enough.
    pub fn set_host_reachable(&mut self, reachable: bool) {
        self.host_reachable = reachable;
    }

    pub fn episode(&self) -> Option<&Episode> {
        self.current.as_ref()
    }

    pub fn decide(&mut self, s: &ShutdownSignal) -> Decision {
        let action = self.action(s);
        if let Some(ep) = self.current.as_mut() {
            if !matches!(action, Action::AuditOnly { .. }) {
                if ep.timeline.len() >= MAX_TIMELINE {
                    ep.timeline.remove(1);
                    ep.timeline_omitted = ep.timeline_omitted.saturating_add(1);
                }
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
        self.finish(action)
    }

    /// Time passes: a pending request past its expiry is closed; an acting
    /// episode past its expected end asks the host (`true`: call
    /// [`Decider::host_answer`] with what the host says).
    pub fn tick(&mut self, now: SystemTime) -> Tick {
        let Some(ep) = self.current.as_ref() else {
            return Tick::Nothing;
        };
        let within = self.policy.direct_tool_within;
        if let Some(d) = ep
            .death
            .as_ref()
            .filter(|d| d.proof == Proof::DirectTool && now >= plus(d.at, within))
        {
            let why = format!(
                "{} reached the kernel with no reboot(2) within {}s",
                d.by,
                within.as_secs_f64()
            );
            let action = self.withdraw(why);
            return Tick::Decided(self.finish(action));
        }
        if self.asking || ep.expected_end.is_none_or(|end| now < end) {
            return Tick::Nothing;
        }
        match ep.path {
            ShutdownPath::Pending => {
                let why = format!(
                    "not confirmed by logind, systemd, PID 1 or a reboot(2) within {}s: the request did not happen",
                    self.policy.pending_expiry.as_secs()
                );
                self.current.as_mut().unwrap().path = ShutdownPath::Expired;
                Tick::Decided(self.finish(Action::Expire { why }))
            }
            ShutdownPath::Scheduled | ShutdownPath::Graceful | ShutdownPath::Immediate => {
                self.asking = true;
                self.asked_end = ep.expected_end;
                Tick::AskHost(ep.id)
            }
            ShutdownPath::Cancelled | ShutdownPath::Abandoned | ShutdownPath::Expired => {
                Tick::Nothing
            }
        }
    }

    /// The host's answer to a [`Tick::AskHost`] about episode `id`. An answer
    /// about an episode no longer current, or one whose end moved while the
    /// host was asked, changes nothing.
    pub fn host_answer(
        &mut self,
        id: u32,
        answer: HostAnswer,
        now: SystemTime,
    ) -> Option<Decision> {
        let recheck = self.policy.recheck;
        let ep = self.current.as_mut().filter(|e| e.id == id)?;
        self.asking = false;
        if !matches!(
            ep.path,
            ShutdownPath::Scheduled | ShutdownPath::Graceful | ShutdownPath::Immediate
        ) || ep.expected_end != self.asked_end
        {
            return None;
        }
        let why = match answer {
            HostAnswer::UnderWay(_) => {
                ep.expected_end = Some(now + recheck);
                return None;
            }
            // With nobody to ask, only a shutdown the host itself confirmed
            // is given more time: systemd-shutdown's last phase has no bus.
            HostAnswer::Unknown(_) if ep.host_confirmed => {
                ep.expected_end = Some(now + recheck);
                return None;
            }
            HostAnswer::Unknown(why) => format!(
                "the expected end passed, the agent is alive, and the host cannot be asked ({why})"
            ),
            HostAnswer::NotUnderWay => {
                "the expected end passed and neither logind nor systemd has a shutdown under way"
                    .to_string()
            }
        };
        ep.path = ShutdownPath::Abandoned;
        Some(self.finish(Action::Abandon { why }))
    }

    fn finish(&mut self, action: Action) -> Decision {
        let episode = self.current.clone();
        if matches!(
            action,
            Action::Cancel | Action::Abandon { .. } | Action::Expire { .. } | Action::Fail { .. }
        ) {
            self.current = None;
            self.asking = false;
        }
        Decision { action, episode }
    }

    fn action(&mut self, s: &ShutdownSignal) -> Action {
        if s.scope == Scope::Container {
            return audit("a container's own PID namespace: the node is not affected");
        }
        if let Some(why) = self.unauthentic(s) {
            return Action::AuditOnly { why };
        }
        let path = self
            .current
            .as_ref()
            .map(|e| e.path)
            .filter(|p| !closed(*p));
        match &s.effect {
            Effect::None { why } => Action::AuditOnly { why: why.clone() },
            Effect::Failed { why } => self.failed(s, why, path),
            Effect::Cancel => self.cancel(s, path),
            Effect::Scheduled { at, .. } => {
                let authority = authority(s);
                if s.source == Source::Exec && !self.acts_alone(s) {
                    return self.pend(s, path);
                }
                match path {
                    None | Some(ShutdownPath::Pending) => {
                        self.open_or_confirm(s, ShutdownPath::Scheduled, authority);
                        let ep = self.current.as_mut().unwrap();
                        ep.deadline = *at;
                        ep.marked = true;
                        ep.expected_end = Some(plus(
                            at.unwrap_or(plus(s.at, Duration::from_secs(3600))),
                            self.policy.graceful_margin,
                        ));
                        Action::Warn { due: *at }
                    }
                    Some(ShutdownPath::Scheduled) => {
                        let ep = self.current.as_mut().unwrap();
                        confirm(ep, s, authority);
                        ep.deadline = *at;
                        ep.expected_end = at.map(|t| t + self.policy.graceful_margin);
                        Action::Warn { due: *at }
                    }
                    Some(_) => Action::Join,
                }
            }
            Effect::Now => self.decide_now(s, path),
        }
    }

    /// Why a bus signal does not count: its sender does not own the name.
    fn unauthentic(&self, s: &ShutdownSignal) -> Option<String> {
        if !matches!(s.source, Source::Logind | Source::Systemd)
            || self.policy.trust_unowned_bus_signals
        {
            return None;
        }
        let sender = s.sender.as_ref()?;
        (!sender.owns_name).then(|| {
            let name = match s.source {
                Source::Logind => "org.freedesktop.login1",
                _ => "org.freedesktop.systemd1",
            };
            format!(
                "sent by {}, which does not own {name}: any peer on the bus can send this signal",
                sender.unique
            )
        })
    }

    /// Whether a request acts without confirmation: nothing can confirm it
    /// (no bus) and its caller can reboot.
    fn acts_alone(&self, s: &ShutdownSignal) -> bool {
        !self.host_reachable && can_reboot(s) == Some(true)
    }

    fn decide_now(&mut self, s: &ShutdownSignal, path: Option<ShutdownPath>) -> Action {
        if let Some(why) = cannot_happen(s) {
            return Action::AuditOnly { why };
        }
        let authority = authority(s);
        // PID 1 running systemd-shutdown ends an orderly shutdown: it confirms
        // a graceful one, and means no time is left where none was seen.
        if is_pid1_shutdown(s)
            && matches!(path, Some(ShutdownPath::Graceful | ShutdownPath::Scheduled))
        {
            confirm(self.current.as_mut().unwrap(), s, authority);
            return Action::Join;
        }
        if leaves_no_time(s) {
            return self.no_time_left(s, path, authority);
        }
        // A request is not a shutdown: it waits for the host (logind or
        // polkit may refuse it, a block inhibitor may hold it), unless
        // nothing can confirm it and its caller can reboot. One whose kind
        // the exec cannot settle (unreadable arguments, or `systemctl
        // soft-reboot`, which systemd < 254 refuses) always waits.
        let unsettled = matches!(s.kind, Kind::Unknown | Kind::SoftReboot);
        if s.source == Source::Exec && (unsettled || !self.acts_alone(s)) {
            return self.pend(s, path);
        }
        self.time_left(s, path, authority)
    }

    /// A shutdown that leaves no time: the last word, or an escalation.
    fn no_time_left(
        &mut self,
        s: &ShutdownSignal,
        path: Option<ShutdownPath>,
        authority: Authority,
    ) -> Action {
        match path {
            Some(ShutdownPath::Immediate) => {
                let ep = self.current.as_mut().unwrap();
                confirm(ep, s, authority);
                if prove(ep, s) {
                    Action::LastWord
                } else {
                    Action::Join
                }
            }
            Some(ShutdownPath::Graceful | ShutdownPath::Scheduled) => {
                let ep = self.current.as_mut().unwrap();
                confirm(ep, s, authority);
                prove(ep, s);
                ep.path = ShutdownPath::Immediate;
                ep.forced |= s.forced;
                ep.expected_end = Some(plus(s.at, self.policy.immediate_end));
                Action::Immediate { escalated: true }
            }
            None | Some(ShutdownPath::Pending) => {
                self.open_or_confirm(s, ShutdownPath::Immediate, authority);
                let ep = self.current.as_mut().unwrap();
                prove(ep, s);
                ep.marked = true;
                ep.expected_end = Some(plus(s.at, self.policy.immediate_end));
                Action::Immediate { escalated: false }
            }
            Some(ShutdownPath::Cancelled | ShutdownPath::Abandoned | ShutdownPath::Expired) => {
                Action::Join
            }
        }
    }

    /// A shutdown with time for the graceful path.
    fn time_left(
        &mut self,
        s: &ShutdownSignal,
        path: Option<ShutdownPath>,
        authority: Authority,
    ) -> Action {
        let protected = s.source == Source::Logind || (self.lock_held && !s.bypasses_logind);
        let end = self.graceful_end(s);
        match path {
            Some(ShutdownPath::Graceful) => {
                let ep = self.current.as_mut().unwrap();
                confirm(ep, s, authority);
                ep.protected |= protected;
                if s.deadline.is_some() {
                    ep.deadline = s.deadline;
                    ep.expected_end = Some(end);
                }
                Action::Join
            }
            Some(ShutdownPath::Immediate) => {
                confirm(self.current.as_mut().unwrap(), s, authority);
                Action::Join
            }
            Some(ShutdownPath::Scheduled | ShutdownPath::Pending) | None => {
                self.open_or_confirm(s, ShutdownPath::Graceful, authority);
                let ep = self.current.as_mut().unwrap();
                ep.protected = protected;
                ep.deadline = s.deadline;
                ep.marked = true;
                ep.expected_end = Some(end);
                Action::Graceful {
                    deadline: s.deadline,
                    protected,
                }
            }
            Some(ShutdownPath::Cancelled | ShutdownPath::Abandoned | ShutdownPath::Expired) => {
                Action::Join
            }
        }
    }

    fn graceful_end(&self, s: &ShutdownSignal) -> SystemTime {
        plus(
            s.deadline
                .unwrap_or(plus(s.at, self.policy.graceful_length)),
            self.policy.graceful_margin,
        )
    }

    /// A request that waits for confirmation.
    fn pend(&mut self, s: &ShutdownSignal, path: Option<ShutdownPath>) -> Action {
        match path {
            None => {
                self.open(s, ShutdownPath::Pending, Authority::Request);
                let expires = plus(s.at, self.policy.pending_expiry);
                self.current.as_mut().unwrap().expected_end = Some(expires);
                Action::Pending { expires }
            }
            // Another request while one waits: it waits with it.
            Some(ShutdownPath::Pending) => {
                let ep = self.current.as_mut().unwrap();
                Action::Pending {
                    expires: ep.expected_end.unwrap_or(s.at),
                }
            }
            Some(_) => Action::Join,
        }
    }

    fn cancel(&mut self, s: &ShutdownSignal, path: Option<ShutdownPath>) -> Action {
        let by = authority(s);
        let Some(ep) = self.current.as_mut() else {
            return audit("no shutdown under way to cancel");
        };
        match path {
            Some(ShutdownPath::Immediate) => audit("a forced shutdown cannot be cancelled"),
            // Nothing was done: a privileged caller's own word withdraws it.
            Some(ShutdownPath::Pending) if by >= Authority::Privileged => {
                ep.path = ShutdownPath::Cancelled;
                Action::Cancel
            }
            // A privileged caller's `shutdown -c` counts once logind clears
            // its scheduled shutdown, unless no bus can say so.
            Some(ShutdownPath::Scheduled | ShutdownPath::Graceful)
                if by == Authority::Privileged && self.host_reachable =>
            {
                audit("a cancel request: waiting for logind to clear its scheduled shutdown or send PrepareForShutdown(false)")
            }
            Some(ShutdownPath::Scheduled | ShutdownPath::Graceful) if by >= ep.authority => {
                ep.path = ShutdownPath::Cancelled;
                Action::Cancel
            }
            _ => Action::AuditOnly {
                why: format!(
                    "a cancel from a weaker source ({}) than the one that opened the shutdown ({})",
                    authority_name(by),
                    authority_name(ep.authority)
                ),
            },
        }
    }

    /// A reboot(2) returned, or a watched tool ended: it did not happen.
    /// What its own process proved is withdrawn; what only it (and its
    /// caller's own request) started is retracted; a shutdown the host
    /// confirmed goes on (its expected end still applies), and so does
    /// another caller's proof.
    fn failed(&mut self, s: &ShutdownSignal, why: &str, path: Option<ShutdownPath>) -> Action {
        let Some(ep) = self.current.as_mut() else {
            return audit(why);
        };
        let pid = s.actor.as_ref().map(|a| a.pid);
        if let Some(d) = ep
            .death
            .as_ref()
            .filter(|d| d.pid.is_some() && d.pid == pid)
        {
            let why = format!("{why}: {} proves nothing", d.by);
            return self.withdraw(why);
        }
        if s.source == Source::ToolEnd {
            return audit(&format!("{why}; it proved nothing in this episode"));
        }
        // A claim that could not cause a shutdown cannot undo one either.
        if can_reboot(s) != Some(true) {
            return Action::AuditOnly {
                why: format!(
                    "{why}; its caller {} cannot reboot: it retracts nothing",
                    who(s)
                ),
            };
        }
        match path {
            Some(ShutdownPath::Pending) => audit(why),
            _ if ep.host_confirmed => Action::AuditOnly {
                why: format!("{why}; the shutdown logind or systemd confirmed goes on"),
            },
            _ if ep.death.is_some() => Action::AuditOnly {
                why: format!("{why}; another caller's proof of death stands"),
            },
            _ => {
                ep.path = ShutdownPath::Abandoned;
                Action::Abandon {
                    why: format!("{why} by {}: nothing else confirmed the shutdown", who(s)),
                }
            }
        }
    }

    /// The current episode's proof of death was wrong: taken off; the
    /// episode goes on where the host confirmed it, else it fails.
    fn withdraw(&mut self, why: String) -> Action {
        let Some(ep) = self.current.as_mut() else {
            return Action::AuditOnly { why };
        };
        ep.death = None;
        if ep.host_confirmed {
            Action::Withdraw { why }
        } else {
            ep.path = ShutdownPath::Abandoned;
            Action::Fail { why }
        }
    }

    /// Opens an episode, or moves the pending or scheduled one on to `path`.
    fn open_or_confirm(&mut self, s: &ShutdownSignal, path: ShutdownPath, authority: Authority) {
        match self.current.as_mut() {
            Some(ep) if matches!(ep.path, ShutdownPath::Pending | ShutdownPath::Scheduled) => {
                ep.path = path;
                confirm(ep, s, authority);
                ep.forced |= s.forced;
            }
            _ => self.open(s, path, authority),
        }
    }

    fn open(&mut self, s: &ShutdownSignal, path: ShutdownPath, authority: Authority) {
        self.episodes += 1;
        let deadline = match &s.effect {
            Effect::Scheduled { at, .. } => *at,
            _ => s.deadline,
        };
        self.asking = false;
        self.current = Some(Episode {
            id: self.episodes,
            kind: s.kind,
            path,
            timeline: Vec::new(),
            timeline_omitted: 0,
            deadline,
            protected: false,
            forced: s.forced,
            authority,
            host_confirmed: confirms_as_host(s),
            marked: false,
            expected_end: None,
            death: None,
        });
    }
}

/// What `tick` asks of the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Tick {
    Nothing,
    /// A decision to audit and act on (a pending request expired).
    Decided(Decision),
    /// Ask the host whether a shutdown is under way about this episode,
    /// then `host_answer`.
    AskHost(u32),
}

fn closed(p: ShutdownPath) -> bool {
    matches!(
        p,
        ShutdownPath::Cancelled | ShutdownPath::Abandoned | ShutdownPath::Expired
    )
}

fn audit(why: &str) -> Action {
    Action::AuditOnly { why: why.into() }
}

fn confirm(ep: &mut Episode, s: &ShutdownSignal, authority: Authority) {
    ep.authority = ep.authority.max(authority);
    ep.host_confirmed |= confirms_as_host(s);
}

/// logind, systemd, or PID 1's final stage: not only the caller's own word.
fn confirms_as_host(s: &ShutdownSignal) -> bool {
    matches!(
        s.source,
        Source::Logind
            | Source::Systemd
            | Source::KernelHook
            | Source::ShutdownHook
            | Source::FinalUnit
            | Source::FinalSweep
    ) || is_pid1_shutdown(s)
        || (s.source == Source::RebootSyscall && s.actor.as_ref().is_some_and(|a| a.ns_pid == 1))
}

/// The kernel is already shutting down, or a caller that can do it skips
/// the service stop jobs: no time. (The hooks say what the caller asked,
/// `forced`; this is the one place that says what it leaves.)
pub fn leaves_no_time(s: &ShutdownSignal) -> bool {
    s.forced
        || matches!(
            s.source,
            Source::RebootSyscall
                | Source::KernelHook
                | Source::ShutdownHook
                | Source::FinalUnit
                | Source::FinalSweep
        )
        || is_pid1_shutdown(s)
}

/// Why a signal cannot end in a shutdown: a signal PID 1 never got, or a
/// forced request from a caller the kernel refuses (EPERM).
fn cannot_happen(s: &ShutdownSignal) -> Option<String> {
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

/// PID 1 exec'ing systemd-shutdown: the end of an orderly shutdown, services
/// already stopped.
pub fn is_pid1_shutdown(s: &ShutdownSignal) -> bool {
    let Detail::Exec { path, .. } = &s.detail else {
        return false;
    };
    s.actor.as_ref().is_some_and(|a| a.ns_pid == 1) && path.ends_with("/systemd-shutdown")
}

/// Whether the caller can reboot the node: CAP_SYS_BOOT in the initial user
/// namespace as the kernel read it, else (no credentials read) euid/uid 0.
/// An exec's privilege counts only where the kernel read that the exec did
/// not lend it (`Actor::borrowed`): a setuid program run under a tool's
/// name proves nothing.
fn can_reboot(s: &ShutdownSignal) -> Option<bool> {
    let a = s.actor.as_ref()?;
    if s.source == Source::Exec && a.borrowed != Some(false) {
        return Some(false);
    }
    Some(match a.cap_sys_boot {
        Some(cap) => cap,
        None => a.euid.unwrap_or(a.uid) == 0,
    })
}

fn authority(s: &ShutdownSignal) -> Authority {
    match s.source {
        Source::Logind | Source::Systemd => Authority::Host,
        Source::KernelHook
        | Source::RebootSyscall
        | Source::ShutdownHook
        | Source::FinalUnit
        | Source::FinalSweep => Authority::Kernel,
        // The kernel checked the sender's right to signal PID 1.
        Source::SignalPid1 => Authority::Privileged,
        Source::Exec if is_pid1_shutdown(s) => Authority::Kernel,
        Source::Exec if can_reboot(s) == Some(true) => Authority::Privileged,
        Source::Exec | Source::ToolEnd => Authority::Request,
    }
}

fn authority_name(a: Authority) -> &'static str {
    match a {
        Authority::Request => "an unprivileged request",
        Authority::Privileged => "a privileged caller",
        Authority::Host => "logind or systemd",
        Authority::Kernel => "the kernel",
    }
}

fn who(s: &ShutdownSignal) -> String {
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

fn summary(s: &ShutdownSignal) -> String {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::signal::{Actor, BusSender, Detail};

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn root() -> Actor {
        Actor {
            pid: 100,
            ns_pid: 100,
            comm: "x".into(),
            euid: Some(0),
            cap_sys_boot: Some(true),
            borrowed: Some(false),
            ..Default::default()
        }
    }

    fn sig(source: Source, kind: Kind, forced: bool, effect: Effect) -> ShutdownSignal {
        let s = ShutdownSignal::of(source, kind)
            .forced(forced)
            .effect(effect)
            .at(t(0));
        match source {
            Source::Logind | Source::Systemd => s,
            _ => s.by(root()),
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
    /// `poweroff -f` by root: the tool calls reboot(2) itself.
    fn direct_tool(kind: Kind) -> ShutdownSignal {
        let mut s = exec(kind, true);
        s.calls_reboot = true;
        s
    }
    fn pid1_shutdown() -> ShutdownSignal {
        let mut s = exec(Poweroff, false);
        s.detail = Detail::Exec {
            path: "/usr/lib/systemd/systemd-shutdown".into(),
            binary: None,
            argv: vec!["systemd-shutdown".into(), "poweroff".into()],
            raw: String::new(),
            truncated: false,
        };
        s.actor.as_mut().unwrap().ns_pid = 1;
        s
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
    fn failed() -> Effect {
        Effect::Failed {
            why: "reboot(2) returned -1 EPERM".into(),
        }
    }

    impl ShutdownSignal {
        fn with_effect(mut self, e: Effect) -> Self {
            self.effect = e;
            self
        }
        /// A caller without CAP_SYS_BOOT (uid 1000).
        fn unprivileged(mut self) -> Self {
            let a = self.actor.as_mut().unwrap();
            (a.uid, a.euid, a.cap_sys_boot) = (1000, Some(1000), Some(false));
            self
        }
        /// A D-Bus signal from a peer that does not own the service's name.
        fn forged(mut self) -> Self {
            self.sender = Some(BusSender {
                unique: ":1.99".into(),
                owns_name: false,
            });
            self
        }
        fn in_container(mut self) -> Self {
            self.scope = Scope::Container;
            self
        }
    }

    fn short(a: &Action) -> &'static str {
        match a {
            Action::AuditOnly { .. } => "audit",
            Action::Pending { .. } => "pending",
            Action::Warn { .. } => "warn",
            Action::Graceful {
                protected: true, ..
            } => "graceful(protected)",
            Action::Graceful {
                protected: false, ..
            } => "graceful",
            Action::Immediate { escalated: false } => "immediate",
            Action::Immediate { escalated: true } => "escalate",
            Action::LastWord => "last-word",
            Action::Cancel => "cancel",
            Action::Abandon { .. } => "abandon",
            Action::Expire { .. } => "expire",
            Action::Fail { .. } => "fail",
            Action::Withdraw { .. } => "withdraw",
            Action::Join => "join",
        }
    }

    /// Sequences of signals and the action each must yield, plus the episode
    /// ids they belong to (0: none). `host` is whether logind/systemd can be
    /// reached.
    #[test]
    #[allow(clippy::too_many_lines)] // a table
    fn decision_table() {
        // (name, host reachable, signals, the action each yields, the episode each joins)
        type Case = (
            &'static str,
            bool,
            Vec<ShutdownSignal>,
            Vec<&'static str>,
            Vec<u32>,
        );
        let cases: Vec<Case> = vec![
            (
                "systemctl poweroff through logind, to the end",
                true,
                vec![
                    exec(Poweroff, false),
                    logind(Effect::Now),
                    job(Poweroff),
                    pid1_shutdown(),
                    reboot2(Poweroff, false),
                ],
                vec!["pending", "graceful(protected)", "join", "join", "escalate"],
                vec![1, 1, 1, 1, 1],
            ),
            (
                "logind first",
                true,
                vec![logind(Effect::Now), job(Poweroff)],
                vec!["graceful(protected)", "join"],
                vec![1, 1],
            ),
            (
                "reboot -ff by root",
                true,
                vec![exec(Reboot, true), reboot2(Reboot, true)],
                vec!["immediate", "last-word"],
                vec![1, 1],
            ),
            (
                "bare reboot(2)",
                true,
                vec![reboot2(Reboot, true)],
                vec!["immediate"],
                vec![1],
            ),
            (
                "forced during graceful escalates at once",
                true,
                vec![
                    logind(Effect::Now),
                    exec(Poweroff, true),
                    reboot2(Poweroff, true),
                ],
                vec!["graceful(protected)", "escalate", "last-word"],
                vec![1, 1, 1],
            ),
            (
                "systemctl start poweroff.target: a job confirms, unprotected",
                true,
                vec![exec(Poweroff, false), job(Poweroff)],
                vec!["pending", "graceful"],
                vec![1, 1],
            ),
            (
                "SIGRTMIN+4 to PID 1",
                true,
                vec![sig(SignalPid1, Poweroff, false, Effect::Now), job(Poweroff)],
                vec!["graceful", "join"],
                vec![1, 1],
            ),
            (
                "SIGRTMIN+14 to PID 1",
                true,
                vec![sig(SignalPid1, Poweroff, true, Effect::Now)],
                vec!["immediate"],
                vec![1],
            ),
            (
                "a signal PID 1 ignored does nothing",
                true,
                vec![{
                    let mut s = sig(SignalPid1, Poweroff, true, Effect::Now);
                    s.detail = Detail::Signal {
                        signo: 48,
                        name: "SIGRTMIN+14".into(),
                        result: "ignored".into(),
                    };
                    s
                }],
                vec!["audit"],
                vec![0],
            ),
            (
                "cancel then a second shutdown: a new episode",
                true,
                vec![
                    logind(Effect::Now),
                    logind(Effect::Cancel),
                    logind(Effect::Now),
                ],
                vec!["graceful(protected)", "cancel", "graceful(protected)"],
                vec![1, 1, 2],
            ),
            (
                "scheduled by root: pending until logind schedules it; shutdown -c waits for logind to clear it",
                true,
                vec![
                    sig(Exec, Poweroff, false, scheduled(300)),
                    sig(Logind, Poweroff, false, scheduled(300)),
                    exec(Poweroff, false).with_effect(Effect::Cancel),
                    sig(Logind, Poweroff, false, Effect::Cancel),
                ],
                vec!["pending", "warn", "audit", "cancel"],
                vec![1, 1, 1, 1],
            ),
            (
                "scheduled, then due: the warning turns graceful",
                true,
                vec![
                    sig(Logind, Poweroff, false, scheduled(60)),
                    logind(Effect::Now),
                    job(Poweroff),
                ],
                vec!["warn", "graceful(protected)", "join"],
                vec![1, 1, 1],
            ),
            (
                "container scope is audit only",
                true,
                vec![
                    reboot2(Poweroff, true).in_container(),
                    exec(Reboot, true).in_container(),
                ],
                vec!["audit", "audit"],
                vec![0, 0],
            ),
            (
                "nothing to cancel; bad magic; queries",
                true,
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
                true,
                vec![exec(Poweroff, true), logind(Effect::Cancel)],
                vec!["immediate", "audit"],
                vec![1, 1],
            ),
            (
                "an undecodable command waits for its effect",
                true,
                vec![exec(Unknown, false), logind(Effect::Now)],
                vec!["pending", "graceful(protected)"],
                vec![1, 1],
            ),
            (
                "a container reboot during a node graceful episode changes nothing",
                true,
                vec![logind(Effect::Now), reboot2(Reboot, true).in_container()],
                vec!["graceful(protected)", "audit"],
                vec![1, 1],
            ),
            (
                "systemctl soft-reboot waits for systemd's job (refused before systemd 254)",
                true,
                vec![exec(SoftReboot, false), job(SoftReboot)],
                vec!["pending", "graceful"],
                vec![1, 1],
            ),
            (
                "kernel hook alone",
                true,
                vec![sig(KernelHook, Poweroff, true, Effect::Now)],
                vec!["immediate"],
                vec![1],
            ),
            // Who can cause it.
            (
                "an unprivileged systemctl poweroff that logind refuses: pending, nothing done",
                true,
                vec![exec(Poweroff, false).unprivileged()],
                vec!["pending"],
                vec![1],
            ),
            (
                "an unprivileged reboot -ff: audit only; its reboot(2) is refused (decoded effect none), and returns",
                true,
                vec![
                    exec(Reboot, true).unprivileged(),
                    reboot2(Reboot, true).unprivileged().with_effect(none()),
                    reboot2(Reboot, true).unprivileged().with_effect(failed()),
                ],
                vec!["audit", "audit", "audit"],
                vec![0, 0, 0],
            ),
            (
                "a root reboot -ff whose reboot(2) returns: its proof failed",
                true,
                vec![
                    exec(Reboot, true),
                    reboot2(Reboot, true),
                    reboot2(Reboot, true).with_effect(failed()),
                    exec(Reboot, true),
                ],
                vec!["immediate", "last-word", "fail", "immediate"],
                vec![1, 1, 1, 2],
            ),
            (
                "root's systemctl poweroff --force, then an unprivileged reboot(2) that fails: nothing undone",
                true,
                vec![
                    exec(Poweroff, true),
                    reboot2(Poweroff, true).unprivileged().with_effect(none()),
                    reboot2(Poweroff, true).unprivileged().with_effect(failed()),
                    sig(KernelHook, Poweroff, true, Effect::Now),
                ],
                vec!["immediate", "audit", "audit", "last-word"],
                vec![1, 1, 1, 1],
            ),
            (
                "systemd-shutdown's hook is the last word of a shutdown through PID 1",
                true,
                vec![
                    exec(Poweroff, true),
                    pid1_shutdown(),
                    sig(ShutdownHook, Poweroff, true, Effect::Now),
                    sig(ShutdownHook, Poweroff, true, Effect::Now),
                ],
                vec!["immediate", "join", "last-word", "join"],
                vec![1, 1, 1, 1],
            ),
            (
                "a direct tool's own reboot(2) is its last word once more",
                true,
                vec![direct_tool(Poweroff), reboot2(Poweroff, true), reboot2(Poweroff, true)],
                vec!["immediate", "last-word", "join"],
                vec![1, 1, 1],
            ),
            (
                "a failed reboot(2) during a shutdown logind confirmed: it goes on, without that proof",
                true,
                vec![
                    logind(Effect::Now),
                    reboot2(Reboot, true),
                    reboot2(Reboot, true).with_effect(failed()),
                ],
                vec!["graceful(protected)", "escalate", "withdraw"],
                vec![1, 1, 1],
            ),
            (
                "no bus: a privileged request acts alone, an unprivileged one waits",
                false,
                vec![exec(Poweroff, false).unprivileged(), exec(Poweroff, false)],
                vec!["pending", "graceful"],
                vec![1, 1],
            ),
            (
                "no bus: a privileged shutdown -c cancels what a privileged request opened",
                false,
                vec![
                    sig(Exec, Poweroff, false, scheduled(300)),
                    exec(Poweroff, false).with_effect(Effect::Cancel),
                ],
                vec!["warn", "cancel"],
                vec![1, 1],
            ),
            (
                "PID 1 running systemd-shutdown confirms a pending request with no time left",
                true,
                vec![exec(Poweroff, false), pid1_shutdown()],
                vec!["pending", "immediate"],
                vec![1, 1],
            ),
            // Forged senders.
            (
                "a forged PrepareForShutdown(true) is audit only",
                true,
                vec![logind(Effect::Now).forged(), job(Poweroff).forged()],
                vec!["audit", "audit"],
                vec![0, 0],
            ),
            (
                "a forged PrepareForShutdown(false) cancels nothing",
                true,
                vec![logind(Effect::Now), logind(Effect::Cancel).forged()],
                vec!["graceful(protected)", "audit"],
                vec![1, 1],
            ),
            // Cancel authority.
            (
                "an unprivileged shutdown -c cancels nothing",
                true,
                vec![
                    sig(Logind, Poweroff, false, scheduled(300)),
                    exec(Poweroff, false)
                        .with_effect(Effect::Cancel)
                        .unprivileged(),
                ],
                vec!["warn", "audit"],
                vec![1, 1],
            ),
            (
                "a privileged shutdown -c withdraws a pending request at once",
                true,
                vec![
                    sig(Exec, Poweroff, false, scheduled(300)),
                    exec(Poweroff, false).with_effect(Effect::Cancel),
                ],
                vec!["pending", "cancel"],
                vec![1, 1],
            ),
            (
                "no bus: a privileged shutdown -c cannot cancel what logind opened",
                false,
                vec![
                    logind(Effect::Now),
                    exec(Poweroff, false).with_effect(Effect::Cancel),
                ],
                vec!["graceful(protected)", "audit"],
                vec![1, 1],
            ),
            (
                "systemd's job removed cancels logind's shutdown (both are the host)",
                true,
                vec![logind(Effect::Now), job(Poweroff).with_effect(Effect::Cancel)],
                vec!["graceful(protected)", "cancel"],
                vec![1, 1],
            ),
        ];
        for (name, host, signals, want, ids) in cases {
            let mut d = Decider::new();
            d.set_host_reachable(host);
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

    /// The proof of death the last of `signals` leaves, decided in order.
    fn proof(signals: Vec<ShutdownSignal>) -> Option<Proof> {
        let mut d = Decider::new();
        signals
            .iter()
            .map(|s| d.decide(s))
            .last()
            .and_then(|d| d.episode?.death.map(|x| x.proof))
    }

    fn pid1_reboot() -> ShutdownSignal {
        let mut s = reboot2(Poweroff, false);
        s.actor.as_mut().unwrap().ns_pid = 1;
        s
    }

    /// Which paths prove that the kernel goes down now: only the kernel's
    /// own power-off, and a direct tool whose caller can reboot. A path
    /// through PID 1 (`--force`, SIGRTMIN+14, systemd-shutdown) stops or
    /// kills processes first, waiting for each: it proves nothing until the
    /// final reboot(2).
    #[test]
    fn only_the_kernel_and_direct_tools_prove_death() {
        let cases: Vec<(&str, Vec<ShutdownSignal>, Option<Proof>)> = vec![
            (
                "reboot(2) by root",
                vec![reboot2(Poweroff, true)],
                Some(Proof::Kernel),
            ),
            (
                "kernel hook",
                vec![sig(KernelHook, Poweroff, true, Effect::Now)],
                Some(Proof::Kernel),
            ),
            (
                "poweroff -f by root",
                vec![direct_tool(Poweroff)],
                Some(Proof::DirectTool),
            ),
            (
                "poweroff -f, then its reboot(2)",
                vec![direct_tool(Poweroff), reboot2(Poweroff, true)],
                Some(Proof::Kernel),
            ),
            (
                "systemctl poweroff --force",
                vec![exec(Poweroff, true)],
                None,
            ),
            (
                "SIGRTMIN+14 to PID 1",
                vec![sig(SignalPid1, Poweroff, true, Effect::Now)],
                None,
            ),
            (
                "--force, PID 1 runs systemd-shutdown",
                vec![exec(Poweroff, true), pid1_shutdown()],
                None,
            ),
            (
                "--force, then systemd-shutdown's reboot(2)",
                vec![exec(Poweroff, true), pid1_shutdown(), pid1_reboot()],
                Some(Proof::Kernel),
            ),
            (
                "graceful, then systemd-shutdown's reboot(2)",
                vec![logind(Effect::Now), pid1_shutdown(), pid1_reboot()],
                Some(Proof::Kernel),
            ),
            (
                "graceful only",
                vec![logind(Effect::Now), job(Poweroff)],
                None,
            ),
            (
                "a direct tool run by a caller that cannot reboot",
                vec![direct_tool(Poweroff).unprivileged()],
                None,
            ),
            (
                "a container's reboot(2)",
                vec![reboot2(Poweroff, true).in_container()],
                None,
            ),
        ];
        for (name, signals, want) in cases {
            assert_eq!(proof(signals), want, "{name}");
        }
    }

    /// Privilege an exec lent (a setuid program under a tool's name) is no
    /// caller's own: a forced request from it decides nothing, proves
    /// nothing, marks nothing; root's own is unchanged.
    #[test]
    fn borrowed_privilege_proves_nothing() {
        let mut lent = direct_tool(Poweroff);
        let a = lent.actor.as_mut().unwrap();
        (a.uid, a.euid, a.borrowed) = (65534, Some(0), Some(true));
        let d = Decider::new().decide(&lent);
        assert!(
            matches!(&d.action, Action::AuditOnly { why } if why.contains("privilege lent by the exec")),
            "{:?}",
            d.action
        );
        assert!(d.episode.is_none());
        // Not read (no BTF): not a capable caller's either.
        let mut unread = direct_tool(Poweroff);
        unread.actor.as_mut().unwrap().borrowed = None;
        assert_eq!(short(&Decider::new().decide(&unread).action), "audit");
        // Not a request the host can confirm, either: it only waits.
        let mut asked = exec(Poweroff, false);
        asked.actor.as_mut().unwrap().borrowed = Some(true);
        let mut d = Decider::new();
        d.set_host_reachable(false);
        assert_eq!(short(&d.decide(&asked).action), "pending");
        // Root's own is unchanged.
        let d = Decider::new().decide(&direct_tool(Poweroff));
        assert_eq!(short(&d.action), "immediate");
        let death = d.episode.unwrap().death.unwrap();
        assert_eq!((death.proof, death.pid), (Proof::DirectTool, Some(100)));
    }

    /// A direct tool's proof stands only while its tool may still reach the
    /// kernel: its end (exit, exec), its reboot(2) returning, or the bound
    /// passing withdraws it; the kernel's reboot(2) from it confirms it.
    #[test]
    fn a_direct_tools_proof_is_confirmed_or_withdrawn() {
        let tool_end = |pid: u32| {
            let mut s = sig(ToolEnd, Unknown, false, Effect::Now);
            s.effect = crate::detect::hooks::tool_end::ended(None);
            s.actor.as_mut().unwrap().pid = pid;
            s
        };
        let within = DecisionPolicy::default().direct_tool_within;
        // Its own end: the record closes as failed.
        let mut d = Decider::new();
        assert_eq!(short(&d.decide(&direct_tool(Poweroff)).action), "immediate");
        let end = d.decide(&tool_end(100));
        assert!(
            matches!(&end.action, Action::Fail { why } if why.contains("proves nothing")),
            "{:?}",
            end.action
        );
        assert!(end.episode.unwrap().death.is_none());
        assert!(d.episode().is_none(), "closed");
        // Another process's end: nothing.
        let mut d = Decider::new();
        d.decide(&direct_tool(Poweroff));
        assert_eq!(short(&d.decide(&tool_end(101)).action), "audit");
        assert!(d.episode().unwrap().death.is_some());
        // Another root caller's failed reboot(2) does not retract it.
        let mut other = reboot2(Poweroff, true).with_effect(failed());
        other.actor.as_mut().unwrap().pid = 101;
        assert_eq!(short(&d.decide(&other).action), "audit");
        assert!(d.episode().unwrap().death.is_some());
        // The bound passes without its reboot(2): withdrawn by time.
        assert_eq!(
            d.tick(t(0) + within - Duration::from_millis(1)),
            Tick::Nothing
        );
        match d.tick(t(0) + within) {
            Tick::Decided(dd) => assert_eq!(short(&dd.action), "fail"),
            other => panic!("{other:?}"),
        }
        assert!(d.episode().is_none());
        // Its reboot(2) reached the kernel: the kernel's proof, no bound.
        let mut d = Decider::new();
        d.decide(&direct_tool(Poweroff));
        assert_eq!(
            short(&d.decide(&reboot2(Poweroff, true)).action),
            "last-word"
        );
        assert!(matches!(d.tick(t(0) + within), Tick::Nothing));
        assert_eq!(
            d.episode().unwrap().death.as_ref().unwrap().proof,
            Proof::Kernel
        );
        // ... and returned (an LSM refused it): withdrawn, closed.
        let back = d.decide(&reboot2(Poweroff, true).with_effect(failed()));
        assert_eq!(short(&back.action), "fail");
    }

    /// lastgasp's final unit, run by systemd after every unit stopped: the
    /// graceful path turns immediate with the final stage's proof
    /// (what the courier's kit carries); with no shutdown open it is a
    /// shutdown of its own, proven the same way.
    #[test]
    fn the_final_units_word_is_the_final_stage() {
        let mut d = Decider::new();
        d.decide(&logind(Effect::Now));
        let stop = d.decide(&sig(FinalUnit, Poweroff, true, Effect::Now));
        assert_eq!(short(&stop.action), "escalate");
        let death = stop.episode.unwrap().death.unwrap();
        assert_eq!((death.proof, death.pid), (Proof::FinalStage, None));
        assert!(death.by.contains("lastgasp's final unit"), "{}", death.by);
        let mut d = Decider::new();
        let alone = d.decide(&sig(FinalUnit, Reboot, true, Effect::Now));
        assert!(
            matches!(alone.action, Action::Immediate { .. }),
            "{:?}",
            alone.action
        );
        assert_eq!(
            alone.episode.unwrap().death.unwrap().proof,
            Proof::FinalStage
        );
    }

    /// `--force` where no hook is armed: the end of systemd-shutdown's
    /// sweep is the final stage (`final_sweep`); its reboot(2), if seen,
    /// the kernel's. Read while PID 1 is not systemd-shutdown, it is no
    /// proof.
    #[test]
    fn the_sweeps_end_is_the_final_stage() {
        let sweep = || sig(FinalSweep, Poweroff, true, Effect::Now);
        let force = || vec![exec(Poweroff, true), pid1_shutdown(), sweep()];
        assert_eq!(proof(force()), Some(Proof::FinalStage));
        let mut then = force();
        then.push(pid1_reboot());
        assert_eq!(proof(then), Some(Proof::Kernel));
        let mut unread = sweep();
        unread.effect = Effect::None {
            why: "PID 1 is systemd".into(),
        };
        assert_eq!(proof(vec![exec(Poweroff, true), unread]), None);
    }

    /// A shutdown logind confirmed goes on when a proof in it fails: the
    /// record goes out again without the proof.
    #[test]
    fn a_failed_proof_in_a_confirmed_shutdown_is_withdrawn_not_closed() {
        let mut d = Decider::new();
        assert_eq!(
            short(&d.decide(&logind(Effect::Now)).action),
            "graceful(protected)"
        );
        assert_eq!(short(&d.decide(&direct_tool(Poweroff)).action), "escalate");
        assert!(d.episode().unwrap().death.is_some());
        let w = d.decide(&reboot2(Poweroff, true).with_effect(failed()));
        assert_eq!(short(&w.action), "withdraw");
        let ep = d.episode().unwrap();
        assert!(ep.death.is_none(), "the proof is gone");
        assert_eq!(ep.path, ShutdownPath::Immediate, "the shutdown goes on");
    }

    #[test]
    fn forged_bus_signals_count_only_when_the_policy_trusts_them() {
        let mut d = Decider::with_policy(DecisionPolicy {
            trust_unowned_bus_signals: true,
            ..DecisionPolicy::default()
        });
        assert_eq!(
            short(&d.decide(&logind(Effect::Now).forged()).action),
            "graceful(protected)"
        );
        let why = match Decider::new().decide(&logind(Effect::Now).forged()).action {
            Action::AuditOnly { why } => why,
            a => panic!("{a:?}"),
        };
        assert!(
            why.contains(":1.99") && why.contains("org.freedesktop.login1"),
            "{why}"
        );
    }

    #[test]
    fn a_pending_request_expires_unconfirmed() {
        let mut d = Decider::new();
        let dec = d.decide(&exec(Poweroff, false).unprivileged());
        let Action::Pending { expires } = dec.action else {
            panic!("{dec:?}")
        };
        assert_eq!(expires, t(60));
        assert_eq!(d.tick(t(59)), Tick::Nothing);
        let Tick::Decided(dec) = d.tick(t(60)) else {
            panic!("no expiry")
        };
        assert_eq!(short(&dec.action), "expire");
        assert_eq!(
            dec.episode.as_ref().map(|e| (e.path, e.marked)),
            Some((ShutdownPath::Expired, false))
        );
        assert!(d.episode().is_none());
        // The next real shutdown is handled in full.
        assert_eq!(
            short(&d.decide(&logind(Effect::Now)).action),
            "graceful(protected)"
        );
    }

    #[test]
    fn an_episode_past_its_end_asks_the_host_and_is_abandoned_when_none_comes() {
        // Graceful: deadline t(30) + margin 30 s.
        let mut d = Decider::new();
        d.decide(&logind(Effect::Now));
        assert_eq!(d.tick(t(59)), Tick::Nothing);
        assert_eq!(d.tick(t(60)), Tick::AskHost(1));
        assert_eq!(d.tick(t(61)), Tick::Nothing, "one question at a time");
        // Still under way: asked again a recheck later.
        assert_eq!(
            d.host_answer(1, HostAnswer::UnderWay("poweroff.target".into()), t(61)),
            None
        );
        assert_eq!(d.tick(t(90)), Tick::Nothing);
        assert_eq!(d.tick(t(91)), Tick::AskHost(1));
        assert_eq!(
            d.host_answer(7, HostAnswer::NotUnderWay, t(91)),
            None,
            "an answer about another episode changes nothing"
        );
        let dec = d.host_answer(1, HostAnswer::NotUnderWay, t(91)).unwrap();
        assert_eq!(short(&dec.action), "abandon");
        let ep = dec.episode.unwrap();
        assert_eq!((ep.path, ep.marked), (ShutdownPath::Abandoned, true));
        assert!(d.episode().is_none());
        assert_eq!(
            short(&d.decide(&logind(Effect::Now)).action),
            "graceful(protected)",
            "the next shutdown is a new episode, handled in full"
        );

        // Immediate, with nobody to ask: an unconfirmed one is abandoned...
        let mut d = Decider::new();
        d.decide(&exec(Reboot, true));
        assert_eq!(d.tick(t(29)), Tick::Nothing);
        assert_eq!(d.tick(t(30)), Tick::AskHost(1));
        let dec = d
            .host_answer(1, HostAnswer::Unknown("no bus".into()), t(30))
            .unwrap();
        assert_eq!(short(&dec.action), "abandon");
        // ...one PID 1 confirmed is given more time.
        let mut d = Decider::new();
        d.decide(&exec(Poweroff, false));
        d.decide(&pid1_shutdown());
        assert_eq!(d.tick(t(30)), Tick::AskHost(1));
        assert_eq!(
            d.host_answer(1, HostAnswer::Unknown("no bus".into()), t(30)),
            None
        );
        // A new deadline while the host was asked: the old question's answer
        // does not end the episode.
        let mut d = Decider::new();
        d.decide(&logind(Effect::Now));
        assert_eq!(d.tick(t(60)), Tick::AskHost(1));
        let mut later = logind(Effect::Now);
        later.deadline = Some(t(100));
        d.decide(&later);
        assert_eq!(d.host_answer(1, HostAnswer::NotUnderWay, t(61)), None);
        assert!(d.episode().is_some());
    }

    /// Unprivileged `systemctl poweroff` requests, again and again, join one
    /// pending episode: its timeline, and so each audit line and the record,
    /// stays bounded.
    #[test]
    fn a_flood_of_joining_requests_cannot_grow_the_episode() {
        let mut d = Decider::new();
        let first = d.decide(&exec(Poweroff, false)).episode.unwrap();
        let size = |ep: &Episode| serde_json::to_string(ep).unwrap().len();
        let mut last = first.clone();
        for _ in 0..5000 {
            if let Some(ep) = d.decide(&exec(Poweroff, false)).episode {
                last = ep;
            }
        }
        assert_eq!(last.id, first.id, "one episode");
        assert_eq!(last.timeline.len(), MAX_TIMELINE);
        assert_eq!(last.timeline[0], first.timeline[0], "the opener is kept");
        assert_eq!(last.timeline_omitted as usize, 5001 - MAX_TIMELINE);
        assert!(size(&last) < 16 * 1024, "{} bytes", size(&last));
    }

    /// A deadline at the end of time (a bus signal's or a tool's) and
    /// policies of centuries: decided, not a panic.
    #[test]
    fn deadlines_at_the_end_of_time_do_not_panic() {
        let end = crate::timespan::latest();
        let huge = Duration::from_secs(u64::MAX / 4);
        let policy = DecisionPolicy {
            graceful_margin: huge,
            immediate_end: huge,
            pending_expiry: huge,
            graceful_length: huge,
            ..DecisionPolicy::default()
        };
        for s in [
            {
                let mut s = logind(Effect::Now);
                s.deadline = Some(end);
                s
            },
            logind(Effect::Scheduled {
                at: Some(end),
                spec: "+forever".into(),
            }),
            exec(Poweroff, false),
            reboot2(Poweroff, true),
        ] {
            let mut d = Decider::with_policy(policy.clone());
            let dec = d.decide(&s);
            // Written down as the audit log does: every time is writable.
            serde_json::to_string(&dec).unwrap();
            assert!(dec.episode.and_then(|e| e.expected_end).is_some(), "{s:?}");
        }
        let latest = crate::timespan::latest();
        assert_eq!(plus(end, Duration::from_secs(1)), latest);
        assert_eq!(plus(SystemTime::UNIX_EPOCH, Duration::MAX), latest);
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(plus(t, Duration::from_secs(5)), t + Duration::from_secs(5));
    }

    #[test]
    fn the_episode_keeps_a_timeline_kind_and_deadline() {
        let mut d = Decider::new();
        d.decide(&exec(Poweroff, false));
        let dec = d.decide(&logind(Effect::Now));
        let ep = dec.episode.unwrap();
        assert_eq!(
            (ep.kind, ep.path, ep.deadline, ep.protected, ep.authority),
            (
                Poweroff,
                ShutdownPath::Graceful,
                Some(t(30)),
                true,
                Authority::Host
            )
        );
        assert_eq!(
            ep.timeline.iter().map(|e| e.source).collect::<Vec<_>>(),
            vec![Exec, Logind]
        );
        assert!(ep.timeline[0].summary.contains("by x (100)"));
    }

    #[test]
    fn a_held_lock_protects_a_graceful_path_started_by_a_signal_to_pid1() {
        let mut d = Decider::new();
        d.set_lock_held(true);
        let mut s = sig(SignalPid1, Reboot, false, Effect::Now);
        s.bypasses_logind = false;
        assert_eq!(short(&d.decide(&s).action), "graceful(protected)");
        let mut d = Decider::new();
        d.set_lock_held(true);
        let mut j = job(Reboot);
        j.bypasses_logind = true;
        assert_eq!(
            short(&d.decide(&j).action),
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
}
