//! After a boot: how did the previous one end? Read from the audit log, so it
//! works whatever the cluster saw at the time.
//! - graceful: an episode whose graceful path completed;
//! - forced: an episode on the immediate path;
//! - interrupted: a graceful path that never finished;
//! - unannounced: no episode at all (power loss, hypervisor reset, watchdog,
//!   panic): pstore may hold the kernel's last words.
use std::{fs, path::Path};

use serde::{Deserialize, Serialize};

use crate::{
    act::audit::{boots, AuditRecord, Entry, Outcome},
    decide::{Episode, ShutdownPath},
    record::{Closing, ShutdownRecord},
};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum BootEnd {
    Graceful,
    Forced,
    Interrupted,
    Unannounced,
}

impl BootEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            BootEnd::Graceful => "graceful",
            BootEnd::Forced => "forced",
            BootEnd::Interrupted => "interrupted",
            BootEnd::Unannounced => "unannounced",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct BootReport {
    pub boot_id: String,
    pub end: BootEnd,
    /// The episode that ended the boot, as last recorded.
    pub episode: Option<Episode>,
    pub pods_terminated: Option<usize>,
    pub pods_remaining: Option<usize>,
    /// The last gasp never reached the cluster: deliver it now.
    pub undelivered: bool,
}

/// How `boot_id` ended, from its records. Episodes that were cancelled do
/// not count; the last one standing does.
pub fn classify(records: &[AuditRecord], boot_id: &str) -> BootReport {
    let mine: Vec<&AuditRecord> = records.iter().filter(|r| r.boot_id == boot_id).collect();
    let outcomes = |id: u32| {
        mine.iter().filter_map(move |r| match &r.entry {
            Entry::Outcome { episode, outcome } if *episode == id => Some(outcome),
            _ => None,
        })
    };
    let LastEpisode {
        last,
        adopted,
        acknowledged,
    } = last_episode(records, &mine, boot_id);
    let delivered_late = records.iter().any(|r| {
        matches!(&r.entry, Entry::Outcome { outcome: Outcome::DeliveredLate { boot_id: b }, episode }
            if b == boot_id && last.as_ref().is_some_and(|e| e.id == *episode))
    });
    let mut report = BootReport {
        boot_id: boot_id.to_string(),
        end: BootEnd::Unannounced,
        episode: None,
        pods_terminated: None,
        pods_remaining: None,
        undelivered: false,
    };
    // An episode abandoned, expired or failed (no shutdown came) did not end
    // the boot.
    let ended = |id: u32| {
        !adopted
            && outcomes(id).any(|o| {
                matches!(
                    o,
                    Outcome::Abandoned { .. } | Outcome::Expired { .. } | Outcome::Failed { .. }
                )
            })
    };
    let Some(ep) = last
        .filter(|e| matches!(e.path, ShutdownPath::Graceful | ShutdownPath::Immediate))
        .filter(|e| !ended(e.id))
    else {
        return report;
    };
    let done = outcomes(ep.id).filter(|_| !adopted).find_map(|o| match o {
        Outcome::GracefulDone {
            terminated,
            remaining,
        } => Some((*terminated, *remaining)),
        _ => None,
    });
    if let Some((t, r)) = done {
        report.pods_terminated = Some(t);
        report.pods_remaining = Some(r);
    }
    report.end = match ep.path {
        ShutdownPath::Immediate => BootEnd::Forced,
        _ if done.is_some() => BootEnd::Graceful,
        _ => BootEnd::Interrupted,
    };
    if ep.path == ShutdownPath::Immediate {
        let delivered = adopted
            || acknowledged
            || outcomes(ep.id).any(|o| matches!(o, Outcome::LastGaspDelivered { .. }));
        report.undelivered = !delivered && !delivered_late;
    }
    report.episode = Some(ep);
    report
}

/// The episode that ended a boot, as its records and the Node tell it.
struct LastEpisode {
    last: Option<Episode>,
    /// Found on the Node only (its record did not reach the disk).
    adopted: bool,
    /// Found on the Node and the log's last: it was delivered.
    acknowledged: bool,
}

/// The boot's last recorded episode. What the Node held of this boot, found
/// after a later boot: an episode the log does not know is the boot's end;
/// one the log knows as its last was delivered.
fn last_episode(records: &[AuditRecord], mine: &[&AuditRecord], boot_id: &str) -> LastEpisode {
    let mut last: Option<Episode> = None;
    for r in mine {
        if let Entry::Signal {
            decision: Some(d), ..
        } = &r.entry
        {
            if let Some(ep) = &d.episode {
                last = Some(ep.clone());
            }
        }
    }
    let same = |a: &Episode, b: &Episode| {
        a.id == b.id && a.timeline.first().map(|t| t.at) == b.timeline.first().map(|t| t.at)
    };
    let known = |f: &Episode| {
        mine.iter().any(|r| {
            matches!(&r.entry, Entry::Signal { decision: Some(d), .. }
                if d.episode.as_ref().is_some_and(|e| same(e, f)))
        })
    };
    let (mut adopted, mut acknowledged) = (false, false);
    if let Some(f) = found_on_node(records, boot_id) {
        if !known(&f) {
            last = Some(f);
            adopted = true;
        } else if last.as_ref().is_some_and(|l| same(l, &f)) {
            acknowledged = true;
        }
    }
    LastEpisode {
        last,
        adopted,
        acknowledged,
    }
}

/// The newest episode of `boot_id` found on the Node after a later boot.
fn found_on_node(records: &[AuditRecord], boot_id: &str) -> Option<Episode> {
    records.iter().rev().find_map(|r| match &r.entry {
        Entry::Outcome {
            outcome: Outcome::FoundOnNode { boot_id: b, record },
            ..
        } if b == boot_id => serde_json::from_value::<ShutdownRecord>(record.clone())
            .ok()
            .and_then(|r| episode_of(&r)),
        _ => None,
    })
}

/// The episode a Node's record announces, if it can end a boot: one that
/// was not closed without the shutdown (cancelled, abandoned, expired, or
/// failed: the shutdown it announced never came).
pub fn episode_of(record: &ShutdownRecord) -> Option<Episode> {
    match record.closed.as_ref().map(|c| c.how) {
        None | Some(Closing::Back) => record.episode.clone(),
        Some(_) => None,
    }
}

/// The boot before `current`, among those the log knows.
pub fn previous_boot<'a>(records: &'a [AuditRecord], current: &str) -> Option<&'a str> {
    boots(records).into_iter().rfind(|b| *b != current)
}

/// Kernel panic/oops records kept across the reboot in pstore: each file's
/// name and first lines.
pub fn pstore(dir: &Path, lines: usize) -> Vec<(String, String)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, String)> = entries
        .flatten()
        .filter_map(|e| {
            let text = fs::read(e.path()).ok()?;
            let text = String::from_utf8_lossy(&text);
            Some((
                e.file_name().to_string_lossy().into_owned(),
                text.lines().take(lines).collect::<Vec<_>>().join("\n"),
            ))
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::{
        decide::{Action, Decision},
        signal::{Kind, ShutdownSignal, Source},
    };

    fn ep(id: u32, path: ShutdownPath) -> Episode {
        Episode {
            id,
            kind: Kind::Poweroff,
            path,
            timeline: vec![],
            timeline_omitted: 0,
            deadline: None,
            protected: false,
            forced: false,
            authority: crate::decide::Authority::Host,
            host_confirmed: true,
            marked: true,
            expected_end: None,
            death: None,
        }
    }

    fn sig_rec(boot: &str, seq: u64, action: Action, episode: Option<Episode>) -> AuditRecord {
        let signal = ShutdownSignal::of(Source::Logind, Kind::Poweroff).without_sender();
        AuditRecord {
            boot_id: boot.into(),
            seq,
            written_at: SystemTime::UNIX_EPOCH,
            entry: Entry::Signal {
                signal,
                decision: Some(Decision { action, episode }),
            },
        }
    }

    fn out(boot: &str, seq: u64, episode: u32, outcome: Outcome) -> AuditRecord {
        AuditRecord {
            boot_id: boot.into(),
            seq,
            written_at: SystemTime::UNIX_EPOCH,
            entry: Entry::Outcome { episode, outcome },
        }
    }

    fn start(boot: &str) -> AuditRecord {
        AuditRecord {
            boot_id: boot.into(),
            seq: 0,
            written_at: SystemTime::UNIX_EPOCH,
            entry: Entry::AgentStart {
                version: "t".into(),
            },
        }
    }

    #[test]
    #[allow(clippy::too_many_lines)] // a table of boots
    fn each_way_a_boot_can_end() {
        let g = Action::Graceful {
            deadline: None,
            protected: true,
        };
        let records = vec![
            start("a"),
            sig_rec("a", 1, g.clone(), Some(ep(1, ShutdownPath::Graceful))),
            out(
                "a",
                2,
                1,
                Outcome::GracefulDone {
                    terminated: 4,
                    remaining: 1,
                },
            ),
            start("b"),
            sig_rec(
                "b",
                1,
                Action::Immediate { escalated: false },
                Some(ep(1, ShutdownPath::Immediate)),
            ),
            out(
                "b",
                2,
                1,
                Outcome::LastGaspFailed {
                    error: "down".into(),
                },
            ),
            start("c"),
            sig_rec("c", 1, g.clone(), Some(ep(1, ShutdownPath::Graceful))),
            start("d"),
            sig_rec("d", 1, g, Some(ep(1, ShutdownPath::Graceful))),
            sig_rec("d", 2, Action::Cancel, Some(ep(1, ShutdownPath::Cancelled))),
            start("f"),
            sig_rec(
                "f",
                1,
                Action::Immediate { escalated: false },
                Some(ep(1, ShutdownPath::Immediate)),
            ),
            out(
                "f",
                2,
                1,
                Outcome::Abandoned {
                    why: "no shutdown came".into(),
                },
            ),
            start("e"),
        ];
        let a = classify(&records, "a");
        assert_eq!(
            (a.end, a.pods_terminated, a.pods_remaining, a.undelivered),
            (BootEnd::Graceful, Some(4), Some(1), false)
        );
        let b = classify(&records, "b");
        assert_eq!(
            (b.end, b.undelivered),
            (BootEnd::Forced, true),
            "a failed last gasp is delivered after the boot"
        );
        assert_eq!(classify(&records, "c").end, BootEnd::Interrupted);
        assert_eq!(
            classify(&records, "d").end,
            BootEnd::Unannounced,
            "a cancelled shutdown did not end the boot"
        );
        let f = classify(&records, "f");
        assert_eq!(
            (f.end, f.undelivered),
            (BootEnd::Unannounced, false),
            "an abandoned episode did not end the boot, and is not delivered late"
        );
        assert_eq!(classify(&records, "e").end, BootEnd::Unannounced);
        assert_eq!(previous_boot(&records, "e"), Some("f"));
        assert_eq!(previous_boot(&records, "a"), Some("e"));

        let mut later = records.clone();
        later.push(out(
            "e",
            1,
            1,
            Outcome::DeliveredLate {
                boot_id: "b".into(),
            },
        ));
        assert!(
            !classify(&later, "b").undelivered,
            "delivered once, not again"
        );
    }

    /// What the Node held of a boot, found after a later boot: an episode
    /// the log lacks ends the boot (delivered); the log's own last episode
    /// is delivered; an older or abandoned one changes nothing.
    #[test]
    fn what_the_node_held_completes_the_log() {
        let imm = Action::Immediate { escalated: false };
        let mut e1 = ep(1, ShutdownPath::Immediate);
        e1.timeline.push(crate::decide::TimelineEntry {
            at: SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(5),
            source: Source::Logind,
            kind: Kind::Poweroff,
            summary: "s".into(),
        });
        let found = |boot: &str, e: &Episode, extra: serde_json::Value| {
            let mut record = serde_json::json!({ "boot_id": boot, "episode": e });
            if let (Some(r), Some(x)) = (record.as_object_mut(), extra.as_object()) {
                r.extend(x.clone());
            }
            out(
                "later",
                9,
                e.id,
                Outcome::FoundOnNode {
                    boot_id: boot.into(),
                    record,
                },
            )
        };
        // The detection never reached the disk.
        let lost = vec![start("a"), found("a", &e1, serde_json::json!({}))];
        let a = classify(&lost, "a");
        assert_eq!((a.end, a.undelivered), (BootEnd::Forced, false));
        assert_eq!(a.episode, Some(e1.clone()));
        // Its outcome never reached the disk.
        let mut unsent = vec![start("b"), sig_rec("b", 1, imm.clone(), Some(e1.clone()))];
        assert!(classify(&unsent, "b").undelivered);
        unsent.push(found("b", &e1, serde_json::json!({})));
        assert_eq!(
            (
                classify(&unsent, "b").end,
                classify(&unsent, "b").undelivered
            ),
            (BootEnd::Forced, false)
        );
        // The Node holds an older episode of the boot (a graceful one the
        // log knows): the log's later, undelivered one still goes late.
        let mut g = ep(1, ShutdownPath::Graceful);
        g.timeline = e1.timeline.clone();
        let mut e2 = ep(2, ShutdownPath::Immediate);
        e2.timeline = e1.timeline.clone();
        let older = vec![
            start("c"),
            sig_rec("c", 1, imm.clone(), Some(g.clone())),
            sig_rec("c", 2, imm.clone(), Some(e2.clone())),
            found("c", &g, serde_json::json!({})),
        ];
        let c = classify(&older, "c");
        assert_eq!((c.episode.map(|e| e.id), c.undelivered), (Some(2), true));
        // Same id, another episode (the agent restarted within the boot):
        // not the log's, so it is the boot's end.
        let mut other = e1.clone();
        other.timeline[0].at += std::time::Duration::from_secs(60);
        let restarted = vec![
            start("d"),
            sig_rec("d", 1, imm.clone(), Some(e1.clone())),
            found("d", &other, serde_json::json!({})),
        ];
        let d = classify(&restarted, "d");
        assert_eq!((d.episode, d.undelivered), (Some(other), false));
        // An abandoned record announced a shutdown that never came.
        let abandoned = vec![
            start("e"),
            found("e", &e1, serde_json::json!({"abandoned": true})),
        ];
        assert_eq!(classify(&abandoned, "e").end, BootEnd::Unannounced);
        // Another boot's record is not this one's.
        assert_eq!(classify(&lost, "z").end, BootEnd::Unannounced);
    }

    #[test]
    fn pstore_quotes_first_lines() {
        let dir = std::env::temp_dir().join(format!("lastgasp-pstore-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("dmesg-ramoops-0"),
            "Oops#1 Part1\n<0>Kernel panic - not syncing: VFS\nmore\n",
        )
        .unwrap();
        let p = pstore(&dir, 2);
        assert_eq!(
            p,
            vec![(
                "dmesg-ramoops-0".into(),
                "Oops#1 Part1\n<0>Kernel panic - not syncing: VFS".into()
            )]
        );
        assert!(pstore(&dir.join("missing"), 2).is_empty());
        fs::remove_dir_all(&dir).ok();
    }
}
