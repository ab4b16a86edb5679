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

/// The table's own tweaks of a fixture's signal.
trait Tweak {
    fn with_effect(self, e: Effect) -> Self;
    fn unprivileged(self) -> Self;
    fn forged(self) -> Self;
    fn in_container(self) -> Self;
}

impl Tweak for ShutdownSignal {
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
