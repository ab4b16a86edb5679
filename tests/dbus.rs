//! The logind and systemd detectors against a real dbus-daemon, with
//! `lastgasp-fake-systemd` as logind and systemd (see tests/src/bus.rs).
//! Orderings are asserted from the fake's timestamped log, not from timings.
use std::{
    io::{BufRead, BufReader},
    os::unix::fs::PermissionsExt,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use lastgasp::{
    bus::delay_lock::DelayLockHandle,
    detect::{
        logind::{DelayError, LogindConfig, LogindDetector, StartError},
        systemd::{SystemdConfig, SystemdDetector},
    },
    signal::{Detail, Effect, Kind, Scope, ShutdownSignal, Source},
};
use lastgasp_tests::{
    bus::{have_dbus_daemon, TestBus, LOGIND_IFACE, LOGIND_PATH},
    support::{agent_bin, can_load_ebpf},
};
use tokio::sync::mpsc;

const DELAY_30: (&str, &str) = (
    "etc/systemd/logind.conf",
    "[Login]\nInhibitDelayMaxSec=30\n",
);

/// Signals from a detector, each with when the test got it.
struct Rx(mpsc::Receiver<ShutdownSignal>);

impl Rx {
    async fn next(&mut self, what: &str) -> (ShutdownSignal, SystemTime) {
        match tokio::time::timeout(Duration::from_secs(10), self.0.recv()).await {
            Ok(Some(s)) => (s, SystemTime::now()),
            Ok(None) => panic!("the detector stopped before {what}"),
            Err(_) => panic!("no signal for {what} within 10 s"),
        }
    }
}

fn cfg(bus: &TestBus) -> LogindConfig {
    LogindConfig {
        bus: Some(bus.address.clone()),
        logind_root: bus.root.clone(),
        ..LogindConfig::default()
    }
}

async fn start_logind(cfg: LogindConfig) -> (DelayLockHandle, Rx) {
    let (det, handle) = LogindDetector::start(cfg)
        .await
        .expect("starting the logind detector");
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(det.run(tx));
    (handle, Rx(rx))
}

async fn start_systemd(bus: &TestBus) -> Rx {
    let det = SystemdDetector::start(SystemdConfig {
        bus: Some(bus.address.clone()),
        ..SystemdConfig::default()
    })
    .await
    .expect("starting the systemd detector");
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(det.run(tx));
    bus.wait_event("Subscribe", |e| e.is("subscribed"), 1).await;
    Rx(rx)
}

/// Microsecond precision, as the fake logs.
fn us(t: SystemTime) -> SystemTime {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap();
    SystemTime::UNIX_EPOCH + Duration::from_micros(d.as_micros() as u64)
}

fn lastgasp_locks(l: &[(String, String, String)]) -> usize {
    l.iter()
        .filter(|(what, who, mode)| what == "shutdown" && who == "lastgasp" && mode == "delay")
        .count()
}

fn member(s: &ShutdownSignal) -> &str {
    match &s.detail {
        Detail::Dbus { member, .. } => member,
        d => panic!("not a D-Bus detail: {d:?}"),
    }
}

fn unit(s: &ShutdownSignal) -> Option<&str> {
    match &s.detail {
        Detail::Dbus { unit, .. } => unit.as_deref(),
        _ => None,
    }
}

#[tokio::test]
async fn lock_is_held_through_graceful_work_and_released_after_it() {
    if !have_dbus_daemon("graceful_lock") {
        return;
    }
    let bus = TestBus::start("graceful", &[DELAY_30], &[]);
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);
    assert!(handle.lock_held());

    bus.logind("PowerOff", &(false,)).await.unwrap();
    let (s, got) = rx.next("PrepareForShutdown(true)").await;
    assert_eq!(s.source, Source::Logind);
    assert_eq!(s.effect, Effect::Now);
    assert_eq!(
        s.kind,
        Kind::Poweroff,
        "from PreparingForShutdownWithMetadata"
    );
    assert!(!s.forced && !s.bypasses_logind);
    assert_eq!(s.scope, Scope::Node);
    assert_eq!(s.deadline, Some(s.at + Duration::from_secs(30)));
    assert_eq!(member(&s), "PrepareForShutdown");
    assert_eq!(
        s.actor.as_ref().map(|a| a.comm.as_str()),
        Some("lastgasp-fake-s")
    );

    // The graceful work: logind must wait for it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        bus.event(|e| e.is("lock-closed")).is_none(),
        "lock closed during the work"
    );
    assert!(bus.event(|e| e.is("shutdown-proceeds")).is_none());
    let released = us(SystemTime::now());
    handle.release();

    let closed = bus
        .wait_event("lock-closed", |e| e.is("lock-closed id=1"), 1)
        .await;
    let proceeds = bus
        .wait_event("shutdown-proceeds", |e| e.is("shutdown-proceeds"), 1)
        .await;
    let executed = bus
        .wait_event(
            "poweroff",
            |e| e.is("shutdown-executed unit=poweroff.target"),
            1,
        )
        .await;
    let prepared = bus.event(|e| e.is("prepare start=true")).unwrap();
    let order = [
        prepared.at,
        us(got),
        released,
        closed.at,
        proceeds.at,
        executed.at,
    ];
    assert!(
        order.windows(2).all(|w| w[0] <= w[1]),
        "expected PrepareForShutdown <= signal <= release <= lock closed <= shutdown proceeds <= executed: {order:?}"
    );
    assert_eq!(
        proceeds.field("reason"),
        Some("locks-released"),
        "not logind's timeout"
    );
    assert!(!handle.lock_held());
}

#[tokio::test]
async fn lock_is_released_by_itself_before_the_deadline() {
    if !have_dbus_daemon("release_before_deadline") {
        return;
    }
    let bus = TestBus::start(
        "deadline",
        &[("etc/systemd/logind.conf", "[Login]\nInhibitDelayMaxSec=2\n")],
        &[],
    );
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    bus.logind("Reboot", &(false,)).await.unwrap();
    let (s, _) = rx.next("PrepareForShutdown(true)").await;
    assert_eq!(
        (s.kind, s.deadline),
        (Kind::Reboot, Some(s.at + Duration::from_secs(2)))
    );
    // Nobody calls release(): the detector lets go before logind's timeout.
    let closed = bus
        .wait_event("lock-closed", |e| e.is("lock-closed"), 1)
        .await;
    let proceeds = bus
        .wait_event("shutdown-proceeds", |e| e.is("shutdown-proceeds"), 1)
        .await;
    let prepared = bus.event(|e| e.is("prepare start=true")).unwrap();
    assert_eq!(
        proceeds.field("reason"),
        Some("locks-released"),
        "released before the timeout"
    );
    assert!(prepared.at <= closed.at && closed.at <= proceeds.at);
    assert!(
        closed.at.duration_since(prepared.at).unwrap() >= Duration::from_secs(1),
        "held for most of the delay (release margin: a quarter of 2 s)"
    );
    assert!(!handle.lock_held());
}

#[tokio::test]
async fn cancellation_takes_a_new_lock_then_drops_the_old() {
    if !have_dbus_daemon("cancel_relock") {
        return;
    }
    let bus = TestBus::start("cancel", &[DELAY_30], &[]);
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    bus.logind("PowerOff", &(false,)).await.unwrap();
    let (s, _) = rx.next("PrepareForShutdown(true)").await;
    assert_eq!(s.effect, Effect::Now);

    // Another peer cannot call off logind's own shutdown.
    bus.dbus_send(&[
        "/org/freedesktop/login1",
        "org.freedesktop.login1.Manager.PrepareForShutdown",
        "boolean:false",
    ]);
    // It is reported, with its sender, as not logind's.
    let (forged, _) = rx.next("the forged PrepareForShutdown(false)").await;
    assert_eq!(forged.effect, Effect::Cancel);
    assert_eq!(forged.sender.as_ref().map(|s| s.owns_name), Some(false));
    bus.cancel_shutdown().await;
    let (s, _) = rx.next("PrepareForShutdown(false)").await;
    assert_eq!((s.source, &s.effect), (Source::Logind, &Effect::Cancel));
    assert_eq!(s.sender.as_ref().map(|s| s.owns_name), Some(true));
    assert_eq!(
        s.actor.as_ref().map(|a| a.comm.as_str()),
        Some("lastgasp-fake-s"),
        "the cancel reported is logind's, not dbus-send's"
    );
    let new = bus
        .wait_event("a new lock", |e| e.is("inhibit id=2"), 1)
        .await;
    let old = bus
        .wait_event("the old lock closed", |e| e.is("lock-closed id=1"), 1)
        .await;
    assert!(
        new.at <= old.at,
        "the new lock first, then the old one dropped"
    );
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);
    assert!(
        bus.event(|e| e.is("inhibit id=3")).is_none(),
        "one re-lock, for the one cancel"
    );
    assert!(handle.lock_held());
    assert!(bus.event(|e| e.is("shutdown-proceeds")).is_none());
}

#[tokio::test]
async fn a_second_shutdown_after_a_cancellation_is_held_by_the_new_lock() {
    if !have_dbus_daemon("second_shutdown") {
        return;
    }
    let bus = TestBus::start("second", &[DELAY_30], &[]);
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    bus.logind("PowerOff", &(false,)).await.unwrap();
    rx.next("the first shutdown").await;
    // Graceful work done for the first one, which is then called off.
    handle.release();
    bus.wait_event("first lock closed", |e| e.is("lock-closed id=1"), 1)
        .await;
    bus.cancel_shutdown().await;
    assert_eq!(rx.next("the cancellation").await.0.effect, Effect::Cancel);
    bus.wait_event("a new lock", |e| e.is("inhibit id=2"), 1)
        .await;

    // `systemctl kexec`: RebootWithFlags(SD_LOGIND_REBOOT_VIA_KEXEC).
    bus.logind("RebootWithFlags", &(2u64,)).await.unwrap();
    let (s, _) = rx.next("the second shutdown").await;
    assert_eq!((s.kind, &s.effect), (Kind::Kexec, &Effect::Now));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        bus.events()
            .iter()
            .filter(|e| e.is("shutdown-proceeds"))
            .count()
            == 1,
        "the second shutdown waits for the new lock"
    );
    let released = us(SystemTime::now());
    handle.release();
    let closed = bus
        .wait_event("second lock closed", |e| e.is("lock-closed id=2"), 1)
        .await;
    let proceeds = bus
        .wait_event(
            "second proceeds",
            |e| e.is("shutdown-proceeds unit=kexec.target"),
            1,
        )
        .await;
    assert!(released <= closed.at && closed.at <= proceeds.at);
    assert_eq!(proceeds.field("reason"), Some("locks-released"));
}

#[tokio::test]
async fn malformed_prepare_for_shutdown_is_logged_and_ignored() {
    if !have_dbus_daemon("malformed") {
        return;
    }
    let bus = TestBus::start("malformed", &[DELAY_30], &[]);
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    let c = bus.client().await;
    let emit = |body: &'static str| {
        let c = c.clone();
        async move {
            match body {
                "none" => {
                    c.emit_signal(
                        None::<&str>,
                        LOGIND_PATH,
                        LOGIND_IFACE,
                        "PrepareForShutdown",
                        &(),
                    )
                    .await
                }
                "string" => {
                    c.emit_signal(
                        None::<&str>,
                        LOGIND_PATH,
                        LOGIND_IFACE,
                        "PrepareForShutdown",
                        &"true",
                    )
                    .await
                }
                "two" => {
                    c.emit_signal(
                        None::<&str>,
                        LOGIND_PATH,
                        LOGIND_IFACE,
                        "PrepareForShutdown",
                        &(true, 1u32),
                    )
                    .await
                }
                _ => {
                    c.emit_signal(
                        None::<&str>,
                        LOGIND_PATH,
                        LOGIND_IFACE,
                        "PrepareForShutdown",
                        &true,
                    )
                    .await
                }
            }
            .unwrap();
        }
    };
    emit("none").await;
    emit("string").await;
    emit("two").await;
    emit("true").await;
    // Signals keep the bus's order: the first one out is the well-formed one.
    let (s, _) = rx.next("the well-formed signal").await;
    assert_eq!(s.effect, Effect::Now);
    assert_eq!(
        s.kind,
        Kind::Unknown,
        "a peer other than logind says nothing of the kind"
    );
    assert!(handle.lock_held(), "still holding the lock, still running");
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);
    // logind's own announcement after another peer's is a shutdown of its own.
    bus.logind("PowerOff", &(false,)).await.unwrap();
    let (s, _) = rx.next("logind's PrepareForShutdown(true)").await;
    assert_eq!((s.kind, &s.effect), (Kind::Poweroff, &Effect::Now));
}

#[tokio::test]
async fn bus_restart_reconnects_and_takes_the_lock_again() {
    if !have_dbus_daemon("bus_restart") {
        return;
    }
    let mut bus = TestBus::start("restart", &[DELAY_30], &[]);
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    let owner = |bus: &TestBus| {
        let addr = bus.address.clone();
        async move {
            let c = zbus::connection::Builder::address(addr.as_str())
                .build()
                .await
                .unwrap();
            lastgasp::bus::name_owner(&c, "org.freedesktop.login1")
                .await
                .unwrap()
                .unwrap()
        }
    };
    let first_owner = owner(&bus).await;
    bus.restart_bus().await;
    // logind's inhibitors outlive the bus; the agent still takes a new lock
    // on the new bus, then drops the old one.
    let new = bus
        .wait_event("a lock on the new bus", |e| e.is("inhibit id=2"), 1)
        .await;
    let old = bus
        .wait_event("the old lock closed", |e| e.is("lock-closed id=1"), 1)
        .await;
    assert!(new.at <= old.at);
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);

    // A shutdown on the new bus, with the bus restarted again in the middle
    // of the graceful work: the lock is kept through it.
    bus.logind("PowerOff", &(false,)).await.unwrap();
    let (s, _) = rx.next("PrepareForShutdown(true) on the new bus").await;
    assert_eq!(s.effect, Effect::Now);
    // logind came back on a new bus: its signal counts from its owner as
    // of now (a new daemon numbers from :1.0 again, so the name may repeat).
    let new_owner = owner(&bus).await;
    println!("logind's owner: {first_owner} before the restart, {new_owner} after");
    assert_eq!(
        s.sender.as_ref().map(|b| (b.unique.as_str(), b.owns_name)),
        Some((new_owner.as_str(), true))
    );
    bus.restart_bus().await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // past the agent's reconnect
    assert!(
        bus.event(|e| e.is("inhibit id=3")).is_none(),
        "no new lock in a shutdown"
    );
    assert!(bus.event(|e| e.is("lock-closed id=2")).is_none());
    let released = us(SystemTime::now());
    handle.release();
    let closed = bus
        .wait_event("lock closed", |e| e.is("lock-closed id=2"), 1)
        .await;
    let proceeds = bus
        .wait_event("shutdown proceeds", |e| e.is("shutdown-proceeds"), 1)
        .await;
    assert!(released <= closed.at && closed.at <= proceeds.at);
    assert_eq!(proceeds.field("reason"), Some("locks-released"));
}

#[tokio::test]
async fn inhibit_delay_override_writes_the_dropin_and_reloads_logind() {
    if !have_dbus_daemon("delay_override") {
        return;
    }
    let bus = TestBus::start(
        "override",
        &[("etc/systemd/logind.conf", "[Login]\nInhibitDelayMaxSec=5\n")],
        &[],
    );
    let mut c = cfg(&bus);
    c.want_delay = Some(Duration::from_secs(30));
    let (det, _handle) = LogindDetector::start(c.clone()).await.expect("start");
    assert_eq!(det.inhibit_delay_max(), Duration::from_secs(30));
    let path = bus.root.join("etc/systemd/logind.conf.d/99-lastgasp.conf");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "# Written by lastgasp: the time its graceful node shutdown needs.\n[Login]\nInhibitDelayMaxSec=30\n"
    );
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o644
    );
    let kill = bus.event(|e| e.is("kill-unit")).expect("logind reloaded");
    assert_eq!(
        kill.text,
        "kill-unit unit=systemd-logind.service whom=all signal=1"
    );
    let reloaded = bus.event(|e| e.is("reloaded")).unwrap();
    assert_eq!(reloaded.field("delay_max_usec"), Some("30000000"));
    let lock = bus.event(|e| e.is("inhibit")).unwrap();
    assert!(kill.at <= reloaded.at && reloaded.at <= lock.at);
    drop(det);

    // Enough already: nothing written, no reload.
    std::fs::remove_file(&path).unwrap();
    c.want_delay = Some(Duration::from_secs(20));
    LogindDetector::start(c).await.expect("start again");
    assert!(!path.exists());
    assert_eq!(bus.events().iter().filter(|e| e.is("kill-unit")).count(), 1);
}

#[tokio::test]
async fn a_later_dropin_wins_and_the_error_names_both_values_and_the_file() {
    if !have_dbus_daemon("later_dropin") {
        return;
    }
    let bus = TestBus::start(
        "later",
        &[(
            "usr/lib/systemd/logind.conf.d/zz-vendor.conf",
            "[Login]\nInhibitDelayMaxSec=10\n",
        )],
        &[],
    );
    let mut c = cfg(&bus);
    c.want_delay = Some(Duration::from_secs(30));
    let Err(err) = LogindDetector::start(c).await else {
        panic!("a later drop-in caps the delay: start must fail")
    };
    let StartError::Delay(DelayError::TooLow {
        have, want, winner, ..
    }) = &err
    else {
        panic!("wrong error: {err}");
    };
    assert_eq!(
        (*have, *want),
        (Duration::from_secs(10), Duration::from_secs(30))
    );
    let zz = bus
        .root
        .join("usr/lib/systemd/logind.conf.d/zz-vendor.conf");
    assert_eq!(winner.as_ref().map(|w| &w.file), Some(&zz));
    let msg = err.to_string();
    for part in [
        "10s",
        "30s",
        &zz.display().to_string(),
        "99-lastgasp.conf",
        "InhibitDelayMaxSec=10",
    ] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    println!("{msg}");
    // It tried: the drop-in is there and logind was reloaded.
    assert!(bus
        .root
        .join("etc/systemd/logind.conf.d/99-lastgasp.conf")
        .exists());
    assert!(bus.event(|e| e.is("kill-unit")).is_some());
}

async fn scheduled_then_cancelled(fake_args: &[&str], poll: Duration) {
    let bus = TestBus::start("scheduled", &[DELAY_30], fake_args);
    let mut c = cfg(&bus);
    c.scheduled_poll = poll;
    let (_handle, mut rx) = start_logind(c).await;
    let due = SystemTime::now() + Duration::from_secs(300);
    let usec = due
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    bus.logind("ScheduleShutdown", &("reboot", usec))
        .await
        .unwrap();
    let (s, _) = rx.next("ScheduledShutdown").await;
    assert_eq!(s.kind, Kind::Reboot);
    assert_eq!(
        s.effect,
        Effect::Scheduled {
            at: Some(SystemTime::UNIX_EPOCH + Duration::from_micros(usec)),
            spec: "reboot".into()
        }
    );
    assert_eq!(member(&s), "ScheduledShutdown");
    let m = bus.logind("CancelScheduledShutdown", &()).await.unwrap();
    assert!(m.body().deserialize::<bool>().unwrap());
    let (s, _) = rx.next("the cancellation").await;
    assert_eq!((s.kind, &s.effect), (Kind::Reboot, &Effect::Cancel));
}

#[tokio::test]
async fn scheduled_shutdown_then_cancelled() {
    if !have_dbus_daemon("scheduled") {
        return;
    }
    // systemd ≥ 255 announces it; the poll is set too slow to matter.
    scheduled_then_cancelled(&[], Duration::from_secs(3600)).await;
}

#[tokio::test]
async fn scheduled_shutdown_is_polled_when_logind_does_not_announce_it() {
    if !have_dbus_daemon("scheduled_polled") {
        return;
    }
    scheduled_then_cancelled(&["--no-scheduled-signal"], Duration::from_millis(100)).await;
}

#[tokio::test]
async fn a_shutdown_target_job_without_logind_is_marked_bypassing() {
    if !have_dbus_daemon("bypass") {
        return;
    }
    let bus = TestBus::start("bypass", &[DELAY_30], &[]);
    let mut rx = start_systemd(&bus).await;
    // `systemctl start poweroff.target`: straight to systemd.
    bus.systemd("StartUnit", &("poweroff.target", "replace-irreversibly"))
        .await
        .unwrap();
    let (s, _) = rx.next("JobNew poweroff.target").await;
    assert_eq!(
        (s.source, s.kind, &s.effect),
        (Source::Systemd, Kind::Poweroff, &Effect::Now)
    );
    assert!(s.bypasses_logind, "no PrepareForShutdown came first");
    assert!(!s.forced);
    assert_eq!((member(&s), unit(&s)), ("JobNew", Some("poweroff.target")));
    // Its companions (systemd-poweroff.service, shutdown.target) add
    // nothing: the next signal is the next shutdown's.
    bus.wait_event(
        "poweroff done",
        |e| e.is("shutdown-executed unit=poweroff.target"),
        1,
    )
    .await;
    bus.systemd("StartUnit", &("reboot.target", "replace-irreversibly"))
        .await
        .unwrap();
    let (s, _) = rx.next("JobNew reboot.target").await;
    assert_eq!((s.kind, unit(&s)), (Kind::Reboot, Some("reboot.target")));
    assert!(s.bypasses_logind);
}

#[tokio::test]
async fn a_shutdown_job_logind_announced_is_not_bypassing() {
    if !have_dbus_daemon("via_logind") {
        return;
    }
    let bus = TestBus::start("vialogind", &[DELAY_30], &[]);
    let mut rx = start_systemd(&bus).await;
    // `systemctl poweroff`: logind, PrepareForShutdown(true), then the job.
    bus.logind("PowerOffWithFlags", &(0u64,)).await.unwrap();
    let (s, _) = rx.next("JobNew poweroff.target").await;
    assert_eq!((s.source, s.kind), (Source::Systemd, Kind::Poweroff));
    assert!(!s.bypasses_logind, "PrepareForShutdown(true) came first");
    let prepared = bus.event(|e| e.is("prepare start=true")).unwrap();
    let job = bus.event(|e| e.is("job-new")).unwrap();
    assert!(prepared.at <= job.at);
}

#[tokio::test]
async fn an_agent_started_mid_shutdown_sees_it() {
    if !have_dbus_daemon("mid_shutdown") {
        return;
    }
    let bus = TestBus::start("midway", &[DELAY_30], &[]);
    // Someone else's lock holds the shutdown while the agent starts.
    let m = bus
        .logind("Inhibit", &("shutdown", "other", "test", "delay"))
        .await
        .unwrap();
    let other: zbus::OwnedFd = m.body().deserialize().unwrap();
    drop(m);
    bus.logind("Halt", &(false,)).await.unwrap();
    let (handle, mut rx) = start_logind(cfg(&bus)).await;
    let (s, _) = rx.next("PreparingForShutdown at start").await;
    assert_eq!((s.kind, &s.effect), (Kind::Halt, &Effect::Now));
    assert_eq!(member(&s), "PreparingForShutdown");
    assert!(s.deadline.is_some());
    assert!(handle.lock_held());
    drop(other);
    handle.release();
    let proceeds = bus
        .wait_event("shutdown proceeds", |e| e.is("shutdown-proceeds"), 1)
        .await;
    assert_eq!(proceeds.field("reason"), Some("locks-released"));
}

/// Lines read from a child's pipe, kept for later looks.
type Lines = Arc<Mutex<Vec<String>>>;

/// The real agent, standalone, on the test bus: returns once it is armed
/// and holds its logind lock (stdout and stderr lines collected).
async fn start_agent(
    bus: &TestBus,
    audit: &std::path::Path,
    extra: &[&str],
) -> (std::process::Child, Lines, Lines) {
    let mut agent = Command::new(agent_bin())
        .args(["run", "--standalone"])
        .args(extra)
        .arg("--audit-dir")
        .arg(audit)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting lastgasp (build it with cargo xtask build)");
    let out = collect(agent.stdout.take().unwrap());
    let err = collect(agent.stderr.take().unwrap());
    wait_line(&err, "the armed line", |l| l.contains("armed_ms")).await;
    bus.wait_event(
        "the agent's lock",
        |e| e.is("inhibit") && e.field("who") == Some("lastgasp"),
        1,
    )
    .await;
    (agent, out, err)
}

fn collect(pipe: impl std::io::Read + Send + 'static) -> Lines {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    lines
}

async fn wait_line(
    lines: &Arc<Mutex<Vec<String>>>,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    for _ in 0..500 {
        if let Some(l) = lines.lock().unwrap().iter().find(|l| pred(l)) {
            return l.clone();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "no {what} within 10 s; got:\n{}",
        lines.lock().unwrap().join("\n")
    );
}

#[tokio::test]
async fn kubelet_e2e_emulation_dbus_send_prepare_for_shutdown() {
    if !have_dbus_daemon("kubelet_e2e") || !can_load_ebpf("kubelet_e2e") {
        return;
    }
    let bus = TestBus::start("kubelet", &[DELAY_30], &[]);
    let audit = bus.dir.join("audit");
    // Only behind the option made for such rigs: by default a peer that is
    // not logind cannot start anything (the next test).
    let (mut agent, out, err) = start_agent(&bus, &audit, &["--trust-unowned-bus-signals"]).await;

    // What the kubelet's e2e tests do.
    bus.dbus_send(&[
        "/org/freedesktop/login1",
        "org.freedesktop.login1.Manager.PrepareForShutdown",
        "boolean:true",
    ]);
    let line = wait_line(&out, "a logind JSON line", |l| {
        l.contains("\"source\":\"logind\"")
    })
    .await;
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["effect"], "now");
    assert_eq!(v["bypasses_logind"], false);
    assert!(v["deadline"].is_string(), "{line}");
    wait_line(&err, "the not-logind warning", |l| {
        l.contains("does not own org.freedesktop.login1")
    })
    .await;
    // Standalone, the graceful work is the audit record: the lock goes; and
    // as logind sent nothing, a new one is taken (a forged signal must not
    // leave the node unprotected).
    bus.wait_event("lock released", |e| e.is("lock-closed"), 1)
        .await;
    bus.wait_event(
        "the lock taken again",
        |e| e.is("inhibit") && e.field("who") == Some("lastgasp"),
        2,
    )
    .await;
    // (The fake notices a close a moment late: the agent's log orders these.)
    let released = wait_line(&err, "the release", |l| l.contains("delay lock released")).await;
    let again = wait_line(&err, "the re-lock", |l| {
        l.contains("delay lock taken again")
    })
    .await;
    let pos = |line: &str| err.lock().unwrap().iter().position(|l| l == line);
    assert!(pos(&released) < pos(&again));
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);

    bus.dbus_send(&[
        "/org/freedesktop/login1",
        "org.freedesktop.login1.Manager.PrepareForShutdown",
        "boolean:false",
    ]);
    let line = wait_line(&out, "the cancel line", |l| {
        l.contains("\"effect\":\"cancel\"")
    })
    .await;
    assert!(line.contains("\"source\":\"logind\""));
    // Cancelled: a new lock first, then the old one dropped.
    let new = bus
        .wait_event(
            "a new lock after the cancel",
            |e| e.is("inhibit") && e.field("who") == Some("lastgasp"),
            3,
        )
        .await;
    let old = bus
        .wait_event("the old lock dropped", |e| e.is("lock-closed"), 2)
        .await;
    assert!(new.at <= old.at);
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(agent.wait().unwrap().success());
    let audited = std::fs::read_to_string(audit.join("audit.jsonl")).unwrap();
    assert_eq!(
        audited
            .lines()
            .filter(|l| l.contains("\"source\":\"logind\""))
            .count(),
        2
    );
    println!("agent stdout:\n{}", out.lock().unwrap().join("\n"));
    println!("agent stderr:\n{}", err.lock().unwrap().join("\n"));
}

fn check(bus: &TestBus) -> (i32, String) {
    let out = Command::new(agent_bin())
        .args([
            "check",
            "--only",
            "dbus",
            "--inhibit-delay",
            "30s",
            "--logind-root",
        ])
        .arg(&bus.root)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .output()
        .expect("running lastgasp check (build it with cargo xtask build)");
    let report = String::from_utf8(out.stdout).unwrap();
    println!("{report}");
    (out.status.code().unwrap(), report)
}

/// By default the same `dbus-send` is a forged claim: reported with its
/// sender, decided audit-only, and the agent's delay lock stays held.
#[tokio::test]
async fn a_forged_prepare_for_shutdown_is_audited_and_changes_nothing() {
    if !have_dbus_daemon("forged_prepare") || !can_load_ebpf("forged_prepare") {
        return;
    }
    let bus = TestBus::start("forged", &[DELAY_30], &[]);
    let audit = bus.dir.join("audit");
    let (mut agent, out, _err) = start_agent(&bus, &audit, &[]).await;
    for start in ["boolean:true", "boolean:false"] {
        bus.dbus_send(&[
            "/org/freedesktop/login1",
            "org.freedesktop.login1.Manager.PrepareForShutdown",
            start,
        ]);
    }
    let lines: Vec<serde_json::Value> = {
        let mut got = Vec::new();
        for effect in ["now", "cancel"] {
            let line = wait_line(&out, "a forged logind line", |l| {
                l.contains("\"source\":\"logind\"")
                    && l.contains(&format!("\"effect\":\"{effect}\""))
            })
            .await;
            got.push(serde_json::from_str(&line).unwrap());
        }
        got
    };
    for v in &lines {
        assert_eq!(v["sender"]["owns_name"], false, "{v}");
        assert!(
            v["sender"]["unique"]
                .as_str()
                .is_some_and(|u| u.starts_with(':')),
            "{v}"
        );
        assert_eq!(v["decision"]["action"], "audit-only", "{v}");
        assert!(
            v["decision"]["why"]
                .as_str()
                .is_some_and(|w| w.contains("does not own org.freedesktop.login1")),
            "{v}"
        );
    }
    // Nothing moved: the lock was neither released nor replaced.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        bus.event(|e| e.is("lock-closed")).is_none(),
        "{:?}",
        bus.events()
            .iter()
            .map(|e| e.text.clone())
            .collect::<Vec<_>>()
    );
    assert_eq!(lastgasp_locks(&bus.inhibitors().await), 1);
    let _ = agent.kill();
    let _ = agent.wait();
}

#[tokio::test]
async fn check_reports_a_winning_later_dropin_and_fails() {
    if !have_dbus_daemon("check_fail") {
        return;
    }
    let bus = TestBus::start(
        "checkfail",
        &[
            ("etc/systemd/logind.conf", "[Login]\nInhibitDelayMaxSec=5\n"),
            (
                "etc/systemd/logind.conf.d/zz-cap.conf",
                "[Login]\nInhibitDelayMaxSec=10\n",
            ),
        ],
        &[],
    );
    let (code, report) = check(&bus);
    assert_eq!(code, 1);
    let zz = bus.root.join("etc/systemd/logind.conf.d/zz-cap.conf");
    let line = report
        .lines()
        .find(|l| l.contains("inhibit delay"))
        .unwrap();
    assert!(line.contains("FAIL"), "{report}");
    for part in ["10s", "30s", &zz.display().to_string(), "99-lastgasp.conf"] {
        assert!(line.contains(part), "{part:?} missing: {line}");
    }
    assert!(
        report.contains(&format!("{}: 10 (wins)", zz.display())),
        "{report}"
    );
    assert!(
        report
            .lines()
            .any(|l| l.contains("ok") && l.contains("delay lock")),
        "{report}"
    );
    assert!(
        report.contains("result: FAIL: 1 required item missing or refused"),
        "{report}"
    );
    assert!(
        !bus.root
            .join("etc/systemd/logind.conf.d/99-lastgasp.conf")
            .exists(),
        "check writes nothing"
    );
}

#[tokio::test]
async fn check_passes_when_logind_allows_the_delay() {
    if !have_dbus_daemon("check_ok") {
        return;
    }
    let bus = TestBus::start(
        "checkok",
        &[(
            "etc/systemd/logind.conf",
            "[Login]\nInhibitDelayMaxSec=1min\n",
        )],
        &[],
    );
    let (code, report) = check(&bus);
    assert_eq!(code, 0, "{report}");
    for what in [
        "system bus",
        "logind",
        "inhibit delay",
        "delay lock",
        "systemd",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.trim_start().starts_with("ok") && l.contains(what)),
            "{what} not ok:\n{report}"
        );
    }
    assert!(report.contains("logind allows 60s, lastgasp needs 30s"));
    assert!(
        !report.contains("held locks"),
        "its own lock is not listed:\n{report}"
    );
    assert!(report.ends_with("result: ok\n"));
    // The lock check closed its lock again.
    bus.wait_event("the check's lock closed", |e| e.is("lock-closed"), 1)
        .await;
}

/// logind's limit follows the node, not the agent's start: another drop-in
/// (the kubelet's, say) raises InhibitDelayMaxSec after the agent started;
/// at PrepareForShutdown the agent's deadline is the new limit.
#[tokio::test]
async fn a_delay_limit_raised_after_start_is_the_one_used() {
    if !have_dbus_daemon("raised_limit") {
        return;
    }
    let bus = TestBus::start(
        "raised",
        &[("etc/systemd/logind.conf", "[Login]\nInhibitDelayMaxSec=5\n")],
        &[],
    );
    let (_handle, mut rx) = start_logind(cfg(&bus)).await;
    // The kubelet's drop-in, and logind reloaded (as the kubelet does it).
    let dropin = bus.root.join("etc/systemd/logind.conf.d/99-kubelet.conf");
    std::fs::create_dir_all(dropin.parent().unwrap()).unwrap();
    std::fs::write(&dropin, "[Login]\nInhibitDelayMaxSec=20\n").unwrap();
    bus.systemd("KillUnit", &("systemd-logind.service", "all", libc::SIGHUP))
        .await
        .unwrap();
    bus.wait_event("the reload", |e| e.is("reloaded"), 1).await;
    bus.logind("PowerOff", &(false,)).await.unwrap();
    let (s, _) = rx.next("PrepareForShutdown(true)").await;
    let held = s.deadline.unwrap().duration_since(s.at).unwrap();
    assert!(
        held > Duration::from_secs(19) && held <= Duration::from_secs(20),
        "the deadline is 20 s after the signal, not 5: {held:?}"
    );
}

/// The kubelet's own graceful node shutdown, on beside lastgasp, holds a
/// delay lock of its own: `lastgasp check` fails and names the fix.
#[tokio::test]
async fn check_fails_while_the_kubelet_holds_a_delay_lock() {
    if !have_dbus_daemon("check_kubelet") {
        return;
    }
    let bus = TestBus::start(
        "checkkubelet",
        &[(
            "etc/systemd/logind.conf",
            "[Login]\nInhibitDelayMaxSec=1min\n",
        )],
        &[],
    );
    // The kubelet's call, as pkg/kubelet/nodeshutdown/systemd makes it.
    let reply = bus
        .logind(
            "Inhibit",
            &(
                "shutdown",
                "kubelet",
                "Kubelet needs time for critical node pods to terminate",
                "delay",
            ),
        )
        .await
        .unwrap();
    let _kubelet_lock: zbus::OwnedFd = reply.body().deserialize().unwrap();
    let (code, report) = check(&bus);
    assert_eq!(code, 1, "{report}");
    let line = report
        .lines()
        .find(|l| l.contains("kubelet lock"))
        .unwrap_or_else(|| panic!("no kubelet lock line:\n{report}"));
    assert!(line.trim_start().starts_with("FAIL"), "{line}");
    assert!(
        line.contains("shutdownGracePeriod") && line.contains("to 0"),
        "{line}"
    );
}

/// 10,000 forged PrepareForShutdown(true) broadcasts from another peer, and
/// 1,000 sent straight to the detector's connection, then logind's own: it
/// is decided as logind's (not judged a forgery for want of an answer), and
/// the forgeries are reported at a bounded rate, never waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_forged_signals_neither_delays_nor_disguises_loginds_own() {
    if !have_dbus_daemon("forged_flood") {
        return;
    }
    let bus = TestBus::start("forgedflood", &[DELAY_30], &[]);
    let (_handle, mut rx) = start_logind(cfg(&bus)).await;
    let forger = bus.client().await;
    // The detector's connections, to send to straight (unicast forgeries).
    let dbus = zbus::fdo::DBusProxy::new(&forger).await.unwrap();
    let names: Vec<String> = dbus
        .list_names()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.to_string())
        .filter(|n| n.starts_with(':'))
        .collect();
    let started = std::time::Instant::now();
    for _ in 0..10_000 {
        forger
            .emit_signal(
                None::<&str>,
                LOGIND_PATH,
                LOGIND_IFACE,
                "PrepareForShutdown",
                &(true,),
            )
            .await
            .unwrap();
    }
    for i in 0..1_000 {
        let to = names[i % names.len()].as_str();
        let _ = forger
            .emit_signal(
                Some(to),
                LOGIND_PATH,
                LOGIND_IFACE,
                "PrepareForShutdown",
                &(true,),
            )
            .await;
    }
    println!("11,000 forgeries sent in {:?}", started.elapsed());
    let t0 = std::time::Instant::now();
    bus.logind("PowerOff", &(false,)).await.unwrap();
    let mut forged = 0;
    let real = loop {
        let (s, _) = rx
            .next("logind's PrepareForShutdown(true) after the flood")
            .await;
        match s.sender.as_ref().map(|b| b.owns_name) {
            Some(true) => break s,
            _ => forged += 1,
        }
    };
    let took = t0.elapsed();
    println!("logind's own decided {took:?} after PowerOff; {forged} forgeries reported before it");
    assert_eq!((real.source, &real.effect), (Source::Logind, &Effect::Now));
    assert_eq!(real.kind, Kind::Poweroff, "logind's kind, read from logind");
    // Reported at a bounded rate (a burst of 20, then 5/s), not one by one.
    assert!(forged <= 200, "{forged} forgeries reported one by one");
}
