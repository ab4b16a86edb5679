//! The golden files (`common/golden/`): what this agent writes, for every
//! reader's tests. A writer that changes a field's name or shape fails
//! here; `LASTGASP_BLESS=1` rewrites the current version's files (an older
//! version's stay as they are: they must still parse).
use std::{path::PathBuf, time::SystemTime};

use lastgasp_common::wire::{
    audit::{AuditRecord, Entry, Outcome, StdoutLine},
    record::{ShutdownRecord, UnannouncedEnd, VERSION},
};

use crate::{
    decide::Decider,
    signal::{Actor, Detail, Kind, ShutdownSignal, Source},
};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../common/golden")
}

fn at(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_800_001_000_000 + ms)
}

/// `poweroff -ff` by root: the exec, then its reboot(2).
fn poweroff_ff() -> [ShutdownSignal; 2] {
    let root = Actor {
        pid: 4242,
        ns_pid: 4242,
        comm: "poweroff".into(),
        exe: Some("/usr/sbin/poweroff".into()),
        euid: Some(0),
        cap_sys_boot: Some(true),
        borrowed: Some(false),
        cgroup_id: 7,
        ..Actor::default()
    };
    let exec = ShutdownSignal::of(Source::Exec, Kind::Poweroff)
        .forced(true)
        .calling_reboot()
        .detail(Detail::Exec {
            path: "/usr/sbin/poweroff".into(),
            binary: None,
            argv: vec!["poweroff".into(), "-ff".into()],
            raw: "poweroff -ff".into(),
            truncated: false,
        })
        .at(at(0))
        .boot_ns(1_000)
        .by(root.clone());
    let call = ShutdownSignal::of(Source::RebootSyscall, Kind::Poweroff)
        .at(at(3))
        .boot_ns(4_000_000)
        .by(root);
    [exec, call]
}

/// Every current-version file and what this build writes for it.
fn written() -> Vec<(String, String)> {
    let boot = "0f5e7c1a-3b2d-4e8f-9a6b-1c2d3e4f5a6b";
    let signals = poweroff_ff();
    let mut d = Decider::new();
    let decisions: Vec<_> = signals.iter().map(|s| d.decide(s)).collect();
    let ep = decisions[1].episode.clone().expect("an episode");
    let record = ShutdownRecord::new(boot, &signals[1], &ep);
    let line = |seq: u64, entry: Entry| AuditRecord {
        boot_id: boot.into(),
        seq,
        written_at: at(seq),
        entry,
    };
    let mut audit = vec![line(
        1,
        Entry::AgentStart {
            version: "0.2.0".into(),
        },
    )];
    for (i, (s, dec)) in signals.iter().zip(&decisions).enumerate() {
        let entry = Entry::Signal {
            signal: s.clone(),
            decision: Some(dec.clone()),
        };
        audit.push(line(i as u64 + 2, entry));
    }
    audit.push(line(
        4,
        Entry::Outcome {
            episode: ep.id,
            outcome: Outcome::LastGaspDelivered { ms: 41.5 },
        },
    ));
    let audit: Vec<String> = audit.iter().map(json).collect();
    let stdout = StdoutLine {
        signal: std::borrow::Cow::Borrowed(&signals[1]),
        decision: std::borrow::Cow::Borrowed(&decisions[1].action),
    };
    let unannounced = UnannouncedEnd {
        boot_id: boot.into(),
        last_seen: Some(at(0)),
        reported_at: at(90_000),
    };
    vec![
        (format!("record-v{VERSION}.json"), record.to_json() + "\n"),
        (format!("audit-v{VERSION}.jsonl"), audit.join("\n") + "\n"),
        (format!("stdout-v{VERSION}.json"), json(&stdout) + "\n"),
        (
            format!("unannounced-v{VERSION}.json"),
            json(&unannounced) + "\n",
        ),
    ]
}

fn json(v: &impl serde::Serialize) -> String {
    serde_json::to_string(v).expect("plain data")
}

#[test]
fn the_writers_write_the_golden_files() {
    let bless = std::env::var_os("LASTGASP_BLESS").is_some();
    let mut differ = Vec::new();
    for (name, text) in written() {
        let path = dir().join(&name);
        if bless {
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let golden = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (LASTGASP_BLESS=1 writes it)", path.display()));
        // Compared as JSON values, line by line: key order is not the contract.
        let values = |t: &str| -> Vec<serde_json::Value> {
            t.lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        if values(&golden) != values(&text) {
            differ.push(format!("{name}:\n  golden: {golden}\n  now:    {text}"));
        }
    }
    assert!(
        differ.is_empty(),
        "the writers no longer write the golden files (a changed format needs a new VERSION and files of its own):\n{}",
        differ.join("\n")
    );
}

/// The agent's readers: the audit log's (the next boot's report and
/// `lastgasp history` read through it), every version's lines.
#[test]
fn the_audit_reader_reads_every_golden_audit_file() {
    let mut seen = 0;
    for e in std::fs::read_dir(dir()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("audit-") {
            continue;
        }
        let bytes = std::fs::read(e.path()).unwrap();
        let c = crate::act::audit::parse(&bytes);
        assert!(c.unreadable.is_empty(), "{name}: {:?}", c.unreadable);
        assert_eq!(
            c.records.len(),
            bytes
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
                .count()
        );
        assert!(
            c.records.iter().any(|r| r.signal().is_some()),
            "{name}: no detection"
        );
        seen += 1;
    }
    assert!(seen > 0, "no golden audit file");
}
