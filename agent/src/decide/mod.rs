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
mod claims;
mod episode;

use std::time::{Duration, SystemTime};

use claims::{
    authority, authority_name, can_reboot, cannot_happen, confirms_as_host, prove, summary, who,
};
pub use claims::{proof_of, Death, Proof};
use episode::Live;
pub use episode::{
    plus, Action, Authority, BeforeCluster, Decision, DecisionPolicy, Episode, ShutdownPath, Tick,
    TimelineEntry, MAX_TIMELINE,
};

use crate::signal::{Effect, Kind, Scope, ShutdownSignal, Source};
pub use crate::signal::{HostAnswer, HostQuery};

#[derive(Default, Clone)]
pub struct Decider {
    policy: DecisionPolicy,
    current: Option<Live>,
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

    /// The episode under way, as decisions carry it.
    pub fn episode(&self) -> Option<Episode> {
        self.current.as_ref().map(Live::record)
    }

    /// Whether an episode is under way (without mapping it).
    pub fn in_episode(&self) -> bool {
        self.current.is_some()
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
        let Some(ep) = self.current.as_mut() else {
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
            let action = withdraw(ep, why);
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
                ep.path = ShutdownPath::Expired;
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
        let episode = self.current.as_ref().map(Live::record);
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
        // The episode is taken out while the signal is decided, so that each
        // rule matches it beside the policy, and put back.
        let mut slot = self.current.take();
        let action = match &s.effect {
            Effect::None { why } => Action::AuditOnly { why: why.clone() },
            Effect::Failed { why } => self.failed(slot.as_mut(), s, why),
            Effect::Cancel => self.cancel(slot.as_mut(), s),
            Effect::Scheduled { at, .. } => self.scheduled(&mut slot, s, *at),
            Effect::Now => self.decide_now(&mut slot, s),
        };
        self.current = slot;
        action
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

    /// A shutdown scheduled for later (`shutdown +5`, logind's schedule).
    fn scheduled(
        &mut self,
        slot: &mut Option<Live>,
        s: &ShutdownSignal,
        at: Option<SystemTime>,
    ) -> Action {
        let authority = authority(s);
        if s.source == Source::Exec && !self.acts_alone(s) {
            return self.pend(slot, s);
        }
        let margin = self.policy.graceful_margin;
        match slot {
            Some(ep) if ep.path == ShutdownPath::Scheduled => {
                confirm(ep, s, authority);
                ep.deadline = at;
                ep.expected_end = at.map(|t| t + margin);
                Action::Warn { due: at }
            }
            Some(ep) if ep.path != ShutdownPath::Pending && !closed(ep.path) => Action::Join,
            _ => {
                let ep = self.open_or_confirm(slot, s, ShutdownPath::Scheduled, authority);
                ep.deadline = at;
                ep.marked = true;
                let due = at.unwrap_or(plus(s.at, Duration::from_secs(3600)));
                ep.expected_end = Some(plus(due, margin));
                Action::Warn { due: at }
            }
        }
    }

    fn decide_now(&mut self, slot: &mut Option<Live>, s: &ShutdownSignal) -> Action {
        if let Some(why) = cannot_happen(s) {
            return Action::AuditOnly { why };
        }
        let authority = authority(s);
        // PID 1 running systemd-shutdown ends an orderly shutdown: it confirms
        // a graceful one, and means no time is left where none was seen.
        if s.is_pid1_shutdown() {
            let orderly =
                |e: &&mut Live| matches!(e.path, ShutdownPath::Graceful | ShutdownPath::Scheduled);
            if let Some(ep) = slot.as_mut().filter(orderly) {
                confirm(ep, s, authority);
                return Action::Join;
            }
        }
        if s.leaves_no_time() {
            return self.no_time_left(slot, s, authority);
        }
        // A request is not a shutdown: it waits for the host (logind or
        // polkit may refuse it, a block inhibitor may hold it), unless
        // nothing can confirm it and its caller can reboot. One whose kind
        // the exec cannot settle (unreadable arguments, or `systemctl
        // soft-reboot`, which systemd < 254 refuses) always waits.
        let unsettled = matches!(s.kind, Kind::Unknown | Kind::SoftReboot);
        if s.source == Source::Exec && (unsettled || !self.acts_alone(s)) {
            return self.pend(slot, s);
        }
        self.time_left(slot, s, authority)
    }

    /// A shutdown that leaves no time: the last word, or an escalation.
    fn no_time_left(
        &mut self,
        slot: &mut Option<Live>,
        s: &ShutdownSignal,
        authority: Authority,
    ) -> Action {
        let end = plus(s.at, self.policy.immediate_end);
        match slot {
            Some(ep) if ep.path == ShutdownPath::Immediate => {
                confirm(ep, s, authority);
                if prove(ep, s) {
                    Action::LastWord
                } else {
                    Action::Join
                }
            }
            Some(ep) if matches!(ep.path, ShutdownPath::Graceful | ShutdownPath::Scheduled) => {
                confirm(ep, s, authority);
                prove(ep, s);
                ep.path = ShutdownPath::Immediate;
                ep.forced |= s.forced;
                ep.expected_end = Some(end);
                Action::Immediate { escalated: true }
            }
            // None, or a pending request.
            _ => {
                let ep = self.open_or_confirm(slot, s, ShutdownPath::Immediate, authority);
                prove(ep, s);
                ep.marked = true;
                ep.expected_end = Some(end);
                Action::Immediate { escalated: false }
            }
        }
    }

    /// A shutdown with time for the graceful path.
    fn time_left(
        &mut self,
        slot: &mut Option<Live>,
        s: &ShutdownSignal,
        authority: Authority,
    ) -> Action {
        let protected = s.source == Source::Logind || (self.lock_held && !s.bypasses_logind);
        let end = self.graceful_end(s);
        match slot {
            Some(ep) if ep.path == ShutdownPath::Graceful => {
                confirm(ep, s, authority);
                ep.protected |= protected;
                if s.deadline.is_some() {
                    ep.deadline = s.deadline;
                    ep.expected_end = Some(end);
                }
                Action::Join
            }
            Some(ep) if ep.path == ShutdownPath::Immediate => {
                confirm(ep, s, authority);
                Action::Join
            }
            // None, a pending request, or a scheduled shutdown now due.
            _ => {
                let ep = self.open_or_confirm(slot, s, ShutdownPath::Graceful, authority);
                ep.protected = protected;
                ep.deadline = s.deadline;
                ep.marked = true;
                ep.expected_end = Some(end);
                Action::Graceful {
                    deadline: s.deadline,
                    protected,
                }
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
    fn pend(&mut self, slot: &mut Option<Live>, s: &ShutdownSignal) -> Action {
        match slot {
            // Another request while one waits: it waits with it.
            Some(ep) if ep.path == ShutdownPath::Pending => Action::Pending {
                expires: ep.expected_end.unwrap_or(s.at),
            },
            Some(ep) if !closed(ep.path) => Action::Join,
            _ => {
                let expires = plus(s.at, self.policy.pending_expiry);
                let ep = self.open(slot, s, ShutdownPath::Pending, Authority::Request);
                ep.expected_end = Some(expires);
                Action::Pending { expires }
            }
        }
    }

    fn cancel(&self, current: Option<&mut Live>, s: &ShutdownSignal) -> Action {
        let by = authority(s);
        let Some(ep) = current else {
            return audit("no shutdown under way to cancel");
        };
        match ep.path {
            ShutdownPath::Immediate => audit("a forced shutdown cannot be cancelled"),
            // Nothing was done: a privileged caller's own word withdraws it.
            ShutdownPath::Pending if by >= Authority::Privileged => {
                ep.path = ShutdownPath::Cancelled;
                Action::Cancel
            }
            // A privileged caller's `shutdown -c` counts once logind clears
            // its scheduled shutdown, unless no bus can say so.
            ShutdownPath::Scheduled | ShutdownPath::Graceful
                if by == Authority::Privileged && self.host_reachable =>
            {
                audit("a cancel request: waiting for logind to clear its scheduled shutdown or send PrepareForShutdown(false)")
            }
            ShutdownPath::Scheduled | ShutdownPath::Graceful if by >= ep.authority => {
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
    fn failed(&self, current: Option<&mut Live>, s: &ShutdownSignal, why: &str) -> Action {
        let Some(ep) = current else {
            return audit(why);
        };
        let pid = s.actor.as_ref().map(|a| a.pid);
        if let Some(d) = ep
            .death
            .as_ref()
            .filter(|d| d.pid.is_some() && d.pid == pid)
        {
            let why = format!("{why}: {} proves nothing", d.by);
            return withdraw(ep, why);
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
        match ep.path {
            ShutdownPath::Pending => audit(why),
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

    /// Opens an episode, or moves the pending or scheduled one on to `path`.
    fn open_or_confirm<'a>(
        &mut self,
        slot: &'a mut Option<Live>,
        s: &ShutdownSignal,
        path: ShutdownPath,
        authority: Authority,
    ) -> &'a mut Live {
        match slot.take() {
            Some(mut ep) if matches!(ep.path, ShutdownPath::Pending | ShutdownPath::Scheduled) => {
                ep.path = path;
                confirm(&mut ep, s, authority);
                ep.forced |= s.forced;
                slot.insert(ep)
            }
            _ => self.open(slot, s, path, authority),
        }
    }

    fn open<'a>(
        &mut self,
        slot: &'a mut Option<Live>,
        s: &ShutdownSignal,
        path: ShutdownPath,
        authority: Authority,
    ) -> &'a mut Live {
        self.episodes += 1;
        let deadline = match &s.effect {
            Effect::Scheduled { at, .. } => *at,
            _ => s.deadline,
        };
        self.asking = false;
        slot.insert(Live {
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
        })
    }
}

/// The episode's proof of death was wrong: taken off; the episode goes on
/// where the host confirmed it, else it fails.
fn withdraw(ep: &mut Live, why: String) -> Action {
    ep.death = None;
    if ep.host_confirmed {
        Action::Withdraw { why }
    } else {
        ep.path = ShutdownPath::Abandoned;
        Action::Fail { why }
    }
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

fn confirm(ep: &mut Live, s: &ShutdownSignal, authority: Authority) {
    ep.authority = ep.authority.max(authority);
    ep.host_confirmed |= confirms_as_host(s);
}

#[cfg(test)]
mod tests;
