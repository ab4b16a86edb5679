//! The agent's whole flow against the double: a signal decided, audited
//! and acted on (the graceful run, the last gasp, unwinding), the join of a
//! late cluster half, and the next boot's report.
use std::sync::Arc;

use lastgasp::{
    act::audit::{self, AuditLog, Entry, Outcome},
    act::{Cluster, LAST_GASP_BOUND},
    agent::Agent,
    decide::{DecisionPolicy, HostAnswer, HostQuery},
};

use super::*;

async fn cluster(s: &Setup) -> Arc<Cluster> {
    let lg = last_gasp_clients(&s.double, NODE).await;
    Arc::new(Cluster {
        node: s.nc.clone(),
        lastgasp: lg,
        graceful: Arc::new(opts(
            s,
            vec![Bucket {
                priority: 0,
                seconds: 2,
            }],
            Removal::Delete,
        )),
    })
}

fn records(dir: &std::path::Path) -> Vec<audit::AuditRecord> {
    audit::read(&dir.join(audit::FILE_NAME)).unwrap().records
}

/// The API server is down when the node dies: the record waits on disk
/// and reaches the cluster after the next boot, which clears the marks
/// once the node is Ready.
#[tokio::test]
async fn a_last_gasp_lost_to_a_dead_api_server_is_delivered_after_the_next_boot() {
    let s = setup("nextboot", vec![]).await;
    let c = cluster(&s).await;
    s.double.inject(Fault::status(503).method("PATCH").always());
    let mut agent = agent_at(&s.dir, "boot-1", Some(c.clone()));
    let d = agent.handle(forced_exec()).await.unwrap();
    assert!(matches!(d.action, Action::Immediate { escalated: false }));
    let recs = records(&s.dir);
    assert!(
        matches!(recs[0].entry, Entry::Signal { .. }),
        "the signal is on disk first"
    );
    assert!(
        recs.iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::LastGaspFailed { .. },
                ..
            }
        )),
        "{recs:#?}"
    );
    let n: Node = s.double.get("", NODE).unwrap();
    assert!(condition(&n).is_none(), "nothing reached the cluster");

    // The next boot, with the API server back. The node is still shown
    // with a shutdown taint from the old boot, and NotReady at first.
    s.double.clear_faults();
    s.nc.set_taint(true).await.unwrap();
    s.double
        .modify::<Node, _>("", NODE, |n| {
            n.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "False".into();
        })
        .unwrap();
    drop(agent);
    let mut next = agent_at(&s.dir, "boot-2", Some(c.clone()));
    let after = next
        .after_boot("boot-2")
        .await
        .unwrap()
        .expect("a previous boot");
    after.delivery.expect("cluster mode").await.unwrap();
    let report = after.report;
    assert_eq!(report.boot_id, "boot-1");
    assert_eq!(report.end, lastgasp::act::report::BootEnd::Forced);
    assert!(report.undelivered);
    let events: Vec<Event> = s.double.list("default");
    let ev = events
        .iter()
        .find(|e| e.action.as_deref() == Some("PreviousBoot"))
        .expect("a previous-boot event");
    let note = ev.note.clone().unwrap_or_default();
    assert!(
        note.contains("ended forced") && note.contains("reboot -ff"),
        "{note}"
    );
    let rec = record::of_node(&s.double.get::<Node>("", NODE).unwrap())
        .unwrap()
        .unwrap();
    assert!(rec.delivered_late);
    assert_eq!(
        rec.closed.map(|c| c.how),
        Some(Closing::Back),
        "a late record is closed: the node is back"
    );
    assert!(records(&s.dir).iter().any(|r| matches!(&r.entry, Entry::Outcome { outcome: Outcome::DeliveredLate { boot_id }, .. } if boot_id == "boot-1")));

    // Ready again: our taint goes, the record is marked back.
    s.double
        .modify::<Node, _>("", NODE, |n| {
            n.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "True".into();
        })
        .unwrap();
    let mut cleared = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n: Node = s.double.get("", NODE).unwrap();
        let rec = record::of_node(&n).unwrap().unwrap();
        if !taint_keys(&n).contains(&TAINT_KEY.to_string())
            && rec.closed.is_some_and(|c| c.how == Closing::Back)
        {
            cleared = true;
            break;
        }
    }
    assert!(
        cleared,
        "the agent's taint and record were cleared once Ready"
    );

    // A third boot does not deliver it again.
    drop(next);
    let mut third = agent_at(&s.dir, "boot-3", Some(c));
    let r = third.after_boot("boot-3").await.unwrap().unwrap().report;
    assert_eq!(
        (r.boot_id.as_str(), r.end),
        ("boot-2", lastgasp::act::report::BootEnd::Unannounced)
    );
}

/// The agent's first boot on this node (no earlier boot in its audit) and
/// it restarts with its own open record of this boot on the Node, proof
/// and marks included: the boot went on, so the record is closed as
/// failed and its marks come off.
#[tokio::test]
async fn an_open_record_of_this_boot_is_closed_on_the_first_boot_too() {
    let s = setup("firstboot", vec![]).await;
    let c = cluster(&s).await;
    let rec = record_of("boot-1", &lastgasp_tests::support::kernel_poweroff());
    s.nc.set_taint_and_record(true, Some(&rec)).await.unwrap();
    let mut agent = agent_at(&s.dir, "boot-1", Some(c));
    assert!(
        agent.after_boot("boot-1").await.unwrap().is_none(),
        "no previous boot"
    );
    let mut closed = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n: Node = s.double.get("", NODE).unwrap();
        let r = record::of_node(&n).unwrap().unwrap();
        if r.closed.is_some() && !taint_keys(&n).contains(&TAINT_KEY.to_string()) {
            closed = r.closed;
            assert!(
                !n.metadata
                    .annotations
                    .unwrap_or_default()
                    .contains_key(record::PROOF_ANNOTATION),
                "the proof goes with the close"
            );
            break;
        }
    }
    let closed = closed.expect("the open record of this boot was not closed");
    assert_eq!(closed.how, Closing::Failed, "{closed:?}");
}

/// Privilege an exec lent (a setuid program under a tool's name, as uid
/// 65534) moves nothing in the cluster: no write at all, only the audit.
#[tokio::test]
async fn a_borrowed_privilege_writes_nothing() {
    let s = setup("borrowed", vec![]).await;
    let mut agent = agent_at(&s.dir, "boot-1", Some(cluster(&s).await));
    let from = s.double.requests().len();
    let mut lent = lastgasp_tests::support::direct_poweroff();
    let a = lent.actor.as_mut().unwrap();
    (a.uid, a.borrowed) = (65534, Some(true));
    let d = agent.handle(lent).await.unwrap();
    assert!(
        matches!(d.action, Action::AuditOnly { .. }),
        "{:?}",
        d.action
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(writes_since(&s, from), Vec::<String>::new());
    assert!(
        records(&s.dir).iter().any(|r| r.signal().is_some()),
        "audited"
    );
}

/// A direct tool's proof that fails on the cluster: with nothing else
/// confirming the shutdown, the record is closed as failed, its proof
/// annotation and the agent's taint gone; in a shutdown logind confirmed,
/// the shutdown goes on and the record is written again without the proof.
#[tokio::test]
async fn a_withdrawn_proof_leaves_the_nodes_record() {
    use lastgasp::{detect::hooks::tool_end, record::PROOF_ANNOTATION};
    use lastgasp_tests::support::direct_poweroff;
    let now = || (std::time::SystemTime::now(), 0);
    let proof_on = |s: &Setup| -> Option<String> {
        let n: Node = s.double.get("", NODE).unwrap();
        n.metadata
            .annotations
            .unwrap_or_default()
            .get(PROOF_ANNOTATION)
            .cloned()
    };
    async fn settled(s: &Setup, done: impl Fn(&record::ShutdownRecord, &Node) -> bool) -> bool {
        for _ in 0..50 {
            let n: Node = s.double.get("", NODE).unwrap();
            if record::of_node(&n)
                .and_then(Result::ok)
                .is_some_and(|r| done(&r, &n))
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
    // Nothing else confirms it: failed.
    let s = setup("withdraw-fail", vec![]).await;
    let mut agent = agent_at(&s.dir, "boot-1", Some(cluster(&s).await));
    let d = agent.handle(direct_poweroff()).await.unwrap();
    assert!(
        matches!(d.action, Action::Immediate { .. }),
        "{:?}",
        d.action
    );
    assert_eq!(proof_on(&s).as_deref(), Some("direct-tool/boot-1"));
    let d = agent.handle(tool_end::gone(4242, now())).await.unwrap();
    assert!(matches!(d.action, Action::Fail { .. }), "{:?}", d.action);
    let failed = |r: &record::ShutdownRecord, n: &Node| {
        r.closed.as_ref().is_some_and(|c| c.how == Closing::Failed)
            && !taint_keys(n).contains(&TAINT_KEY.to_string())
    };
    assert!(settled(&s, failed).await, "closed as failed, the taint off");
    assert_eq!(proof_on(&s), None, "the proof annotation goes with it");

    // logind confirmed the shutdown: it goes on, without the proof.
    let s = setup("withdraw-confirmed", vec![]).await;
    let mut agent = agent_at(&s.dir, "boot-1", Some(cluster(&s).await));
    agent.handle(logind_signal()).await.unwrap();
    let d = agent.handle(direct_poweroff()).await.unwrap();
    assert!(
        matches!(d.action, Action::Immediate { escalated: true }),
        "{:?}",
        d.action
    );
    assert_eq!(proof_on(&s).as_deref(), Some("direct-tool/boot-1"));
    let d = agent.handle(tool_end::gone(4242, now())).await.unwrap();
    assert!(
        matches!(d.action, Action::Withdraw { .. }),
        "{:?}",
        d.action
    );
    let withdrawn =
        |r: &record::ShutdownRecord, _: &Node| r.closed.is_none() && r.death().is_none();
    assert!(settled(&s, withdrawn).await, "open, without the proof");
    assert_eq!(proof_on(&s), None);
}

/// With the API server hanging at start, telling the cluster how the
/// previous boot ended runs beside the loop: `after_boot` returns while
/// that delivery still waits, and the next shutdown is audited and its
/// last gasp sent at once.
#[tokio::test]
async fn the_previous_boot_report_does_not_hold_up_the_next_shutdown() {
    let s = setup("bootdown", vec![]).await;
    let c = cluster(&s).await;
    AuditLog::open(&s.dir, "boot-1")
        .unwrap()
        .agent_start()
        .unwrap();
    let hang = s
        .double
        .inject(Fault::latency(Duration::from_secs(600)).method("POST"));
    let mut agent = agent_at(&s.dir, "boot-2", Some(c));
    let after = agent.after_boot("boot-2").await.unwrap().expect("boot-1");
    assert_eq!(
        after.report.end,
        lastgasp::act::report::BootEnd::Unannounced
    );
    let delivery = after.delivery.expect("cluster mode delivers");
    let d = agent.handle(forced_exec()).await.unwrap();
    assert!(matches!(d.action, Action::Immediate { escalated: false }));
    assert!(
        !delivery.is_finished(),
        "the PreviousBoot Event is still waiting on the hung POST"
    );
    let recs = records(&s.dir);
    assert!(
        recs.iter().any(|r| r.boot_id == "boot-2"
            && matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::LastGaspDelivered { .. },
                    ..
                }
            )),
        "boot-2's shutdown was audited and its last gasp delivered: {recs:#?}"
    );
    delivery.abort();
    s.double.remove_fault(hang);
}

/// The previous boot's undelivered record, delivered late, never
/// replaces a record of this boot: a shutdown of this boot already on
/// the Node (its last gasp got there first) is what the controller must
/// see.
#[tokio::test]
async fn a_late_record_never_replaces_this_boots_record() {
    let s = setup("latenewer", vec![]).await;
    let c = cluster(&s).await;
    let fault = s.double.inject(Fault::status(503).method("PATCH").always());
    let mut agent = agent_at(&s.dir, "boot-1", Some(c.clone()));
    agent.handle(forced_exec()).await.unwrap();
    s.double.remove_fault(fault);
    let this_boot = record_of("boot-2", &logind_signal()).to_json();
    put_record(&s, &this_boot);
    drop(agent);
    let mut next = agent_at(&s.dir, "boot-2", Some(c));
    let after = next.after_boot("boot-2").await.unwrap().unwrap();
    assert!(after.report.undelivered);
    after.delivery.unwrap().await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        n.metadata.annotations.unwrap()[RECORD_ANNOTATION],
        this_boot
    );
    assert!(
        !records(&s.dir).iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::DeliveredLate { .. },
                ..
            }
        )),
        "not delivered, and not audited as delivered"
    );
}

/// The last gasp does not wait for the disk: with the audit fdatasync
/// held (a loaded disk), both patches reach the API server, and `handle`
/// returns only once the record is synced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_gasp_leaves_while_its_record_syncs() {
    let s = setup("beside", vec![]).await;
    let c = cluster(&s).await;
    let mut audit = AuditLog::open(&s.dir, "boot-1").unwrap();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let held = std::sync::Mutex::new(held);
    audit.before_beside_sync(move || {
        let _ = held.lock().unwrap().recv();
    });
    let mut agent = Agent::new(audit, Some(c), None, Metrics::default());
    let handled = tokio::spawn(async move { agent.handle(forced_exec()).await });
    let mut on_node = None;
    for _ in 0..100 {
        let n: Node = s.double.get("", NODE).unwrap();
        let rec = n
            .metadata
            .annotations
            .clone()
            .unwrap_or_default()
            .get(RECORD_ANNOTATION)
            .cloned();
        if rec.is_some() && condition(&n).is_some() {
            on_node = rec;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rec: serde_json::Value =
        serde_json::from_str(&on_node.expect("both patches reached the API server")).unwrap();
    assert_eq!(rec["boot_id"], "boot-1");
    assert!(
        !handled.is_finished(),
        "the patches left while the audit fdatasync was still held"
    );
    release.send(()).unwrap();
    let d = handled.await.unwrap().unwrap();
    assert!(matches!(d.action, Action::Immediate { escalated: false }));
    let recs = records(&s.dir);
    assert!(matches!(recs[0].entry, Entry::Signal { .. }), "{recs:#?}");
    assert!(
        recs.iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::LastGaspDelivered { .. },
                ..
            }
        )),
        "{recs:#?}"
    );
}

/// A boot whose last gasp the cluster acknowledged while the disk lost
/// its audit record (the node died inside the fdatasync): the next boot
/// finds it on the Node and reports the boot as forced, audits where it
/// came from, and sends nothing late.
#[tokio::test]
async fn a_last_gasp_the_disk_lost_is_found_on_the_node() {
    let s = setup("lostdisk", vec![]).await;
    let c = cluster(&s).await;
    // The record reached the Node; this log is what survived on disk:
    // the agent's start, not the detection.
    let gone = s.dir.with_extension("gone");
    let _ = std::fs::remove_dir_all(&gone);
    let mut first = agent_at(&gone, "boot-1", Some(c.clone()));
    first.handle(forced_exec()).await.unwrap();
    AuditLog::open(&s.dir, "boot-1")
        .unwrap()
        .agent_start()
        .unwrap();
    let metrics = Metrics::default();
    let mut next = Agent::new(
        AuditLog::open(&s.dir, "boot-2").unwrap(),
        Some(c),
        None,
        metrics.clone(),
    );
    let after = next.after_boot("boot-2").await.unwrap().unwrap();
    assert_eq!(
        after.report.end,
        lastgasp::act::report::BootEnd::Unannounced
    );
    let settled = after.delivery.unwrap().await.unwrap();
    assert_eq!(
        (settled.end, settled.undelivered),
        (lastgasp::act::report::BootEnd::Forced, false)
    );
    assert_eq!(settled.episode.as_ref().map(|e| e.id), Some(1));
    let events: Vec<Event> = s.double.list("default");
    let note = events
        .iter()
        .find(|e| e.action.as_deref() == Some("PreviousBoot"))
        .and_then(|e| e.note.clone())
        .expect("a previous-boot event");
    assert!(
        note.contains("ended forced") && note.contains("found on the Node"),
        "{note}"
    );
    let recs = records(&s.dir);
    assert!(
        recs.iter().any(|r| r.boot_id == "boot-2"
            && matches!(&r.entry, Entry::Outcome { episode: 1, outcome: Outcome::FoundOnNode { boot_id, .. } } if boot_id == "boot-1")),
        "{recs:#?}"
    );
    assert_eq!(
        lastgasp::act::report::classify(&recs, "boot-1").end,
        lastgasp::act::report::BootEnd::Forced,
        "the log now tells the boot's end by itself"
    );
    let n: Node = s.double.get("", NODE).unwrap();
    let rec: serde_json::Value =
        serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
    assert_ne!(rec["delivered_late"], true, "nothing was sent late: {rec}");
    assert!(
        metrics.encode().contains(r#"end="forced""#),
        "{}",
        metrics.encode()
    );
    let _ = std::fs::remove_dir_all(&gone);
}

/// The detection reached the disk, its delivered outcome did not: the
/// Node's record of the same episode shows it was delivered, so nothing
/// goes out late.
#[tokio::test]
async fn a_delivery_the_disk_lost_is_found_on_the_node() {
    let s = setup("lostoutcome", vec![]).await;
    let c = cluster(&s).await;
    let mut first = agent_at(&s.dir, "boot-1", Some(c.clone()));
    first.handle(forced_exec()).await.unwrap();
    let path = s.dir.join(audit::FILE_NAME);
    let kept: Vec<String> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| !l.contains("last-gasp-delivered"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(kept.len(), records(&s.dir).len() - 1, "one outcome cut");
    std::fs::write(&path, kept.concat()).unwrap();
    drop(first);
    let mut next = agent_at(&s.dir, "boot-2", Some(c));
    let after = next.after_boot("boot-2").await.unwrap().unwrap();
    assert!(after.report.undelivered, "the log alone says undelivered");
    let settled = after.delivery.unwrap().await.unwrap();
    assert_eq!(
        (settled.end, settled.undelivered),
        (lastgasp::act::report::BootEnd::Forced, false)
    );
    let n: Node = s.double.get("", NODE).unwrap();
    let rec: serde_json::Value =
        serde_json::from_str(&n.metadata.annotations.unwrap()[RECORD_ANNOTATION]).unwrap();
    assert_ne!(rec["delivered_late"], true, "nothing was sent late: {rec}");
    let recs = records(&s.dir);
    assert!(
        recs.iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::FoundOnNode { .. },
                ..
            }
        )) && !recs.iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::DeliveredLate { .. },
                ..
            }
        )),
        "{recs:#?}"
    );
}

/// PATCH/POST/DELETE requests the double answered since `from`.
fn writes_since(s: &Setup, from: usize) -> Vec<String> {
    s.double.requests()[from..]
        .iter()
        .filter(|r| r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

fn host(answer: HostAnswer) -> (HostQuery, Arc<dyn Fn() -> bool + Send + Sync>) {
    (
        Arc::new(move || {
            let a = answer.clone();
            Box::pin(async move { a })
        }),
        Arc::new(|| true),
    )
}

fn quick_policy() -> DecisionPolicy {
    DecisionPolicy {
        pending_expiry: Duration::from_millis(300),
        immediate_end: Duration::from_millis(300),
        ..DecisionPolicy::default()
    }
}

/// A `systemctl poweroff` alone is a request: nothing reaches the
/// cluster until logind, systemd or PID 1 confirms it, and unconfirmed it
/// expires, audit-only.
#[tokio::test]
async fn a_request_nobody_confirms_moves_nothing_and_expires() {
    let s = setup("pending", vec![pod("web", Some(0), None, json!({}))]).await;
    let c = cluster(&s).await;
    let (q, r) = host(HostAnswer::NotUnderWay);
    let mut agent = agent_at(&s.dir, "b", Some(c))
        .with_policy(quick_policy())
        .with_host(q, r);
    let from = s.double.requests().len();
    let mut req = forced_exec();
    req.forced = false;
    req.actor.as_mut().unwrap().uid = 1000;
    let d = agent.handle(req).await.unwrap();
    assert!(matches!(d.action, Action::Pending { .. }), "{d:?}");
    agent.tick(SystemTime::now() + Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(writes_since(&s, from), Vec::<String>::new());
    let n: Node = s.double.get("", NODE).unwrap();
    assert!(condition(&n).is_none() && !taint_keys(&n).contains(&TAINT_KEY.to_string()));
    assert!(
        records(&s.dir).iter().any(|r| matches!(
            &r.entry,
            Entry::Outcome {
                outcome: Outcome::Expired { .. },
                ..
            }
        )),
        "{:#?}",
        records(&s.dir)
    );
}

/// An immediate episode whose shutdown never comes (the agent is alive
/// past its expected end, and the host has none under way) is abandoned:
/// every mark is undone, and the next shutdown is handled in full.
#[tokio::test]
async fn an_episode_that_never_ends_the_node_is_unwound() {
    let s = setup("abandon", vec![]).await;
    let c = cluster(&s).await;
    let (q, r) = host(HostAnswer::NotUnderWay);
    let mut agent = agent_at(&s.dir, "b", Some(c))
        .with_policy(quick_policy())
        .with_host(q, r);
    agent.handle(forced_exec()).await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        condition(&n),
        Some(("True".into(), "ForcedShutdown".into()))
    );
    assert!(taint_keys(&n).contains(&TAINT_KEY.to_string()));
    let rec: serde_json::Value =
        serde_json::from_str(&n.metadata.annotations.clone().unwrap()[RECORD_ANNOTATION]).unwrap();
    assert_eq!(rec["boot_id"], "b", "the record names its boot: {rec}");

    agent.tick(SystemTime::now() + Duration::from_secs(1)).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), agent.next_answer())
        .await
        .expect("the host was asked");
    agent.host_answer(answer).await;
    let abandoned = |s: &Setup| {
        records(&s.dir).iter().any(|r| {
            matches!(
                &r.entry,
                Entry::Outcome {
                    outcome: Outcome::Abandoned { .. },
                    ..
                }
            )
        })
    };
    let mut undone = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n: Node = s.double.get("", NODE).unwrap();
        let closed = record::of_node(&n)
            .and_then(Result::ok)
            .and_then(|r| r.closed)
            .map(|c| c.how);
        if condition(&n) == Some(("False".into(), "ShutdownAbandoned".into()))
            && !taint_keys(&n).contains(&TAINT_KEY.to_string())
            && closed == Some(Closing::Abandoned)
            && abandoned(&s)
        {
            undone = true;
            break;
        }
    }
    assert!(
        undone,
        "condition False, taint off, record closed, outcome audited: {:?}",
        s.double.get::<Node>("", NODE)
    );
    assert!(
        taint_keys(&s.double.get::<Node>("", NODE).unwrap())
            .contains(&"example.com/other".to_string()),
        "another's taint stays"
    );
    assert!(records(&s.dir).iter().any(|r| matches!(
        &r.entry,
        Entry::Outcome {
            outcome: Outcome::Abandoned { .. },
            ..
        }
    )));
    let d = agent.handle(forced_exec()).await.unwrap();
    assert_eq!(
        (short_action(&d.action), d.episode.map(|e| e.id)),
        ("immediate", Some(2)),
        "a new episode, handled in full"
    );
}

/// `clear_when_ready` leaves a record of this boot as it is (the start
/// closes it, after asking the host); a new boot closes it as back. A
/// record annotation that is unreadable is no record (and no panic), and
/// closing leaves it as it was.
#[tokio::test]
async fn only_a_new_boot_marks_the_record_back() {
    let s = setup("sameboot", vec![]).await;
    let set = |v: &str| put_record(&s, v);
    let rec = record_of("boot-7", &logind_signal());
    set(&rec.to_json());
    s.nc.set_taint(true).await.unwrap();
    s.nc.clear_when_ready("boot-7").await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert!(
        taint_keys(&n).contains(&TAINT_KEY.to_string()),
        "same boot: marks stay"
    );
    let now = |n: &Node| record::of_node(n).unwrap().unwrap();
    assert_eq!(now(&n).closed, None);

    s.nc.clear_when_ready("boot-8").await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert!(!taint_keys(&n).contains(&TAINT_KEY.to_string()));
    let closed = now(&n).closed.expect("closed");
    assert_eq!(closed.how, Closing::Back);
    assert!(closed.why.contains("boot-8"), "{}", closed.why);

    for odd in [
        "[]",
        "42",
        "\"x\"",
        "not json",
        r#"{"boot_id":"boot-7","episode":{"id":1}}"#,
    ] {
        set(odd);
        s.nc.set_taint(true).await.unwrap();
        s.nc.clear_when_ready("boot-9").await.unwrap();
        s.nc.close_record(&rec.key(), Closing::Abandoned, "test")
            .await;
        let n: Node = s.double.get("", NODE).unwrap();
        assert!(!taint_keys(&n).contains(&TAINT_KEY.to_string()), "{odd}");
        assert_eq!(
            n.metadata.annotations.unwrap()[RECORD_ANNOTATION],
            odd,
            "left as it was"
        );
    }
}

fn short_action(a: &Action) -> &'static str {
    match a {
        Action::Immediate { .. } => "immediate",
        _ => "other",
    }
}

/// An API server that does not answer cannot hold the loop: the last
/// gasp gives up at its bound, is recorded as failed (for the next
/// boot), and the next record is handled at once.
#[tokio::test]
async fn a_silent_api_server_bounds_the_last_gasp() {
    let s = setup("slow", vec![]).await;
    let c = cluster(&s).await;
    s.double.inject(
        Fault::latency(Duration::from_secs(20))
            .method("PATCH")
            .always(),
    );
    let mut agent = agent_at(&s.dir, "b", Some(c));
    let t = std::time::Instant::now();
    agent.handle(forced_exec()).await.unwrap();
    let took = t.elapsed();
    assert!(
        took < LAST_GASP_BOUND + Duration::from_secs(1),
        "the last gasp took {took:?}"
    );
    let failed = records(&s.dir).into_iter().find_map(|r| match r.entry {
        Entry::Outcome {
            outcome: Outcome::LastGaspFailed { error },
            ..
        } => Some(error),
        _ => None,
    });
    assert!(
        failed
            .as_deref()
            .is_some_and(|e| e.contains("no answer within")),
        "{failed:?}"
    );
    let mut next = forced_exec();
    next.scope = Scope::Container;
    let t = std::time::Instant::now();
    agent.handle(next).await.unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn forced_detection_reaches_the_cluster_and_the_audit_says_so() {
    let s = setup("forced", vec![]).await;
    let c = cluster(&s).await;
    let mut agent = agent_at(&s.dir, "b", Some(c));
    agent.handle(forced_exec()).await.unwrap();
    let n: Node = s.double.get("", NODE).unwrap();
    assert_eq!(
        condition(&n),
        Some(("True".into(), "ForcedShutdown".into()))
    );
    let delivered = records(&s.dir).into_iter().find_map(|r| match r.entry {
        Entry::Outcome {
            outcome: Outcome::LastGaspDelivered { ms },
            ..
        } => Some(ms),
        _ => None,
    });
    assert!(delivered.is_some_and(|ms| ms >= 0.0));
}

/// Under the systemd cgroup driver systemd stops the agent's scope before
/// systemd-shutdown: the courier's kit is left as soon as an episode opens
/// (the final-stage record for each verb), carried to the API server only
/// by the courier, and removed when the episode ends without a shutdown.
#[tokio::test]
async fn the_courier_kit_is_left_when_a_shutdown_begins_and_goes_when_it_is_called_off() {
    use lastgasp::{act::courier, record::PROOF_ANNOTATION, signal::Effect};
    let s = setup("kit", vec![]).await;
    let c = cluster(&s).await;
    let run_dir = s.dir.join("run");
    // The agent's credentials as its client infers them (a kubeconfig here,
    // the pod's service account on a node).
    std::fs::create_dir_all(&s.dir).unwrap();
    let kubeconfig = s.dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{{name: c, cluster: {{server: '{}'}}}}]\n\
             users: [{{name: u, user: {{token: agent-token}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n",
            s.double.url()
        ),
    )
    .unwrap();
    std::env::set_var("KUBECONFIG", &kubeconfig);
    let mut agent = agent_at(&s.dir, "b", Some(c)).with_courier(run_dir.clone(), None);
    assert_eq!(courier::kit(&run_dir).unwrap(), None);
    agent.handle(logind_signal()).await.unwrap();
    let kit = courier::kit(&run_dir)
        .unwrap()
        .expect("a kit once logind announced");
    assert_eq!(
        (kit.node.as_str(), kit.token.as_str()),
        (NODE, "agent-token")
    );
    let proof =
        |verb: &str| kit.evidence[verb]["metadata"]["annotations"][PROOF_ANNOTATION].clone();
    assert_eq!(
        proof("poweroff"),
        json!("final-stage/b"),
        "{:#?}",
        kit.evidence
    );
    // The Node does not carry the proof until the courier sends it.
    let n: Node = s.double.get("", NODE).unwrap();
    assert!(!n
        .metadata
        .annotations
        .unwrap_or_default()
        .contains_key(PROOF_ANNOTATION));
    // Called off: the kit goes (a later shutdown must not carry this record).
    let mut cancel = logind_signal();
    cancel.effect = Effect::Cancel;
    agent.handle(cancel).await.unwrap();
    assert_eq!(courier::kit(&run_dir).unwrap(), None);
    // The next shutdown leaves a new kit; the courier's patch is the proof.
    agent.handle(logind_signal()).await.unwrap();
    let kit = courier::kit(&run_dir)
        .unwrap()
        .expect("a kit for the next shutdown");
    courier::send(&kit, "poweroff").await.unwrap();
    std::env::remove_var("KUBECONFIG");
    let n: Node = s.double.get("", NODE).unwrap();
    let annotations = n.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get(PROOF_ANNOTATION).map(String::as_str),
        Some("final-stage/b")
    );
    let rec: ShutdownRecord = serde_json::from_str(&annotations[RECORD_ANNOTATION]).unwrap();
    assert!(rec.proof_mark().is_some(), "{rec:?}");
}

/// At its stop the agent leaves the host clean only when its DaemonSet is
/// deleted (an uninstall), no shutdown is under way, and no other agent has
/// started on the node since.
#[tokio::test]
async fn the_agent_leaves_the_host_clean_only_when_its_daemonset_is_deleted() {
    use lastgasp::host_files::{leave_if_uninstalled, HostPaths, Left};
    let s = setup("uninstall", vec![]).await;
    let root = s.dir.join("host");
    let paths = HostPaths {
        hook_dir: Some(root.join("system-shutdown")),
        run_dir: root.join("run"),
        unit_dir: None,
        logind_root: root.clone(),
        audit_dir: root.join("audit"),
        audit: false,
    };
    let hook = paths.candidates()[0].clone();
    let pid = paths.run_dir.join("agent.pid");
    std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
    std::fs::create_dir_all(&paths.run_dir).unwrap();
    std::fs::write(&hook, "#!/bin/sh\n").unwrap();
    std::fs::write(&pid, std::process::id().to_string()).unwrap();
    let client = s.double.client_without_retry().await;
    let ds = ("lastgasp", "lastgasp-agent");
    s.double
        .create_value(json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": ds.1, "namespace": ds.0},
            "spec": {"selector": {"matchLabels": {"a": "b"}},
                     "template": {"metadata": {"labels": {"a": "b"}},
                                  "spec": {"containers": [{"name": "c", "image": "i"}]}}}
        }))
        .unwrap();
    // A rolling update or a node's shutdown: the DaemonSet is there.
    let said = leave_if_uninstalled(client.clone(), ds, &paths, false, None).await;
    assert_eq!(said.unwrap(), None);
    assert!(hook.exists());
    s.double
        .remove::<k8s_openapi::api::apps::v1::DaemonSet>(ds.0, ds.1)
        .unwrap();
    // Deleted, but a shutdown is under way: the hook is its last word.
    let said = leave_if_uninstalled(client.clone(), ds, &paths, true, None).await;
    assert_eq!(said.unwrap(), None);
    assert!(hook.exists());
    // Deleted, but another agent has started here (a reinstall).
    std::fs::write(&pid, "4194304").unwrap();
    let said = leave_if_uninstalled(client.clone(), ds, &paths, false, None).await;
    let Some(Left::OtherAgent(said)) = said.unwrap() else {
        panic!("not the other agent's")
    };
    assert!(said.contains("another agent (pid 4194304)"), "{said}");
    assert!(hook.exists());
    // Deleted, this agent's files: all go.
    std::fs::write(&pid, std::process::id().to_string()).unwrap();
    let said = leave_if_uninstalled(client, ds, &paths, false, None).await;
    let Some(Left::Cleaned(said)) = said.unwrap() else {
        panic!("not cleaned")
    };
    assert!(
        said.contains(&format!("removed {}", hook.display())),
        "{said}"
    );
    assert_eq!(paths.present(), Vec::<std::path::PathBuf>::new());
}
