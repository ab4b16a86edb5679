//! The durable shutdown audit: JSON lines, one per detection, each fsync'd
//! before anything else acts on it, because the machine may die a millisecond
//! later.
use std::{
    fs::{self, File, OpenOptions},
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    time::SystemTime,
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::{decide::Decision, signal::ShutdownSignal};

pub const FILE_NAME: &str = "audit.jsonl";

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Record {
    pub boot_id: String,
    /// Order within the boot.
    pub seq: u64,
    #[serde(with = "humantime_serde")]
    pub written_at: SystemTime,
    #[serde(flatten)]
    pub entry: Entry,
}

/// What a record holds: a detection and what was decided, or what an
/// action achieved.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "kebab-case")]
// A record per detection, written once: a box would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Entry {
    Signal {
        signal: ShutdownSignal,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decision: Option<Decision>,
    },
    Outcome {
        episode: u32,
        outcome: Outcome,
    },
    /// The agent started in this boot (so that a boot with no shutdown
    /// record still shows up, and its end is known to be unannounced).
    AgentStart {
        version: String,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum Outcome {
    /// The graceful path finished its buckets.
    GracefulDone { terminated: usize, remaining: usize },
    /// The last gasp reached the API server, `ms` after the kernel saw it.
    LastGaspDelivered { ms: f64 },
    /// The last gasp failed; the record is delivered after the next boot.
    LastGaspFailed { error: String },
    /// A cancellation was applied.
    Cancelled,
    /// The episode's expected end passed with the agent still alive and the
    /// host saying no shutdown is under way: every mark was undone.
    Abandoned { why: String },
    /// A request that was never confirmed (pending) ran out: nothing was
    /// done.
    Expired { why: String },
    /// Episode `episode` of boot `boot_id` reached the cluster only in this
    /// later boot.
    DeliveredLate { boot_id: String },
}

impl Record {
    pub fn signal(&self) -> Option<&ShutdownSignal> {
        match &self.entry {
            Entry::Signal { signal, .. } => Some(signal),
            Entry::Outcome { .. } | Entry::AgentStart { .. } => None,
        }
    }
}

pub struct AuditLog {
    file: File,
    path: PathBuf,
    boot_id: String,
    next_seq: u64,
}

impl AuditLog {
    pub fn open(dir: &Path, boot_id: &str) -> Result<Self> {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating audit directory {}", dir.display()))?;
        let path = dir.join(FILE_NAME);
        let next_seq = read(&path)?
            .records
            .iter()
            .filter(|r| r.boot_id == boot_id)
            .count() as u64;
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening audit log {}", path.display()))?;
        // Make the file's own directory entry durable too.
        File::open(dir).and_then(|d| d.sync_all()).ok();
        Ok(AuditLog {
            file,
            path,
            boot_id: boot_id.to_string(),
            next_seq,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends a detection and its decision, and waits until it is on disk.
    pub fn append(
        &mut self,
        signal: &ShutdownSignal,
        decision: Option<&Decision>,
    ) -> Result<Record> {
        self.write(Entry::Signal {
            signal: signal.clone(),
            decision: decision.cloned(),
        })
    }

    pub fn agent_start(&mut self) -> Result<Record> {
        self.write(Entry::AgentStart {
            version: env!("CARGO_PKG_VERSION").to_string(),
        })
    }

    pub fn outcome(&mut self, episode: u32, outcome: Outcome) -> Result<Record> {
        self.write(Entry::Outcome { episode, outcome })
    }

    fn write(&mut self, entry: Entry) -> Result<Record> {
        let record = Record {
            boot_id: self.boot_id.clone(),
            seq: self.next_seq,
            written_at: SystemTime::now(),
            entry,
        };
        let mut line = serde_json::to_vec(&record)?;
        line.push(b'\n');
        // One write(2) on an O_APPEND file: a record is never interleaved.
        self.file
            .write_all(&line)
            .context("writing the audit log")?;
        self.file.sync_data().context("fsync of the audit log")?;
        self.next_seq += 1;
        Ok(record)
    }
}

/// What the log holds, and how many lines could not be read (a line torn by
/// a power loss, say).
#[derive(Debug, Default)]
pub struct Contents {
    pub records: Vec<Record>,
    pub unreadable: Vec<(usize, String)>,
}

pub fn read(path: &Path) -> Result<Contents> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Contents::default()),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    let mut out = Contents::default();
    for (i, line) in BufReader::new(file).split(b'\n').enumerate() {
        let line = line?;
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Record>(&line) {
            Ok(r) => out.records.push(r),
            Err(e) => out.unreadable.push((i + 1, e.to_string())),
        }
    }
    Ok(out)
}

/// Which boots `history` shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BootFilter {
    Current,
    /// The last boot before the current one that has records.
    Previous,
    Id(String),
    All,
}

impl std::str::FromStr for BootFilter {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "current" => BootFilter::Current,
            "previous" => BootFilter::Previous,
            "all" => BootFilter::All,
            id => BootFilter::Id(id.to_string()),
        })
    }
}

/// Boot ids in the order they first appear in the log.
pub fn boots(records: &[Record]) -> Vec<&str> {
    let mut seen: Vec<&str> = Vec::new();
    for r in records {
        if !seen.contains(&r.boot_id.as_str()) {
            seen.push(&r.boot_id);
        }
    }
    seen
}

pub fn select<'a>(
    records: &'a [Record],
    filter: &BootFilter,
    current_boot: &str,
) -> Vec<&'a Record> {
    let want: Option<String> = match filter {
        BootFilter::All => None,
        BootFilter::Current => Some(current_boot.to_string()),
        BootFilter::Id(id) => Some(id.clone()),
        BootFilter::Previous => Some(
            boots(records)
                .into_iter()
                .rfind(|b| *b != current_boot)
                .unwrap_or("")
                .to_string(),
        ),
    };
    records
        .iter()
        .filter(|r| want.as_deref().is_none_or(|w| r.boot_id == w))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signal::{Detail, Effect, Kind, Scope, Source};

    fn signal(kind: Kind) -> ShutdownSignal {
        ShutdownSignal {
            source: Source::RebootSyscall,
            kind,
            forced: true,
            bypasses_logind: true,
            scope: Scope::Node,
            effect: Effect::Now,
            actor: None,
            sender: None,
            at: SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(1_700_000_000_123_456_789),
            boot_ns: 42,
            deadline: None,
            detail: Detail::Reboot {
                magic1: 0xfee1dead,
                magic2: 672274793,
                cmd: 0x4321fedc,
                valid_magic: true,
            },
        }
    }

    #[test]
    fn round_trip_across_boots_and_torn_lines() {
        let dir = std::env::temp_dir().join(format!("lastgasp-audit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut a = AuditLog::open(&dir, "boot-a").unwrap();
        a.append(&signal(Kind::Reboot), None).unwrap();
        a.append(&signal(Kind::Poweroff), None).unwrap();
        drop(a);
        // A power loss mid-write leaves a torn line.
        OpenOptions::new()
            .append(true)
            .open(dir.join(FILE_NAME))
            .unwrap()
            .write_all(b"{\"boot_id\":\"bo")
            .unwrap();
        OpenOptions::new()
            .append(true)
            .open(dir.join(FILE_NAME))
            .unwrap()
            .write_all(b"\n")
            .unwrap();
        let mut b = AuditLog::open(&dir, "boot-b").unwrap();
        let rec = b.append(&signal(Kind::Halt), None).unwrap();
        assert_eq!(rec.seq, 0);
        let mut a2 = AuditLog::open(&dir, "boot-a").unwrap();
        assert_eq!(
            a2.outcome(1, Outcome::Cancelled).unwrap().seq,
            2,
            "seq continues within a boot"
        );
        a2.append(&signal(Kind::Kexec), None).unwrap();

        let c = read(&dir.join(FILE_NAME)).unwrap();
        assert_eq!(c.records.len(), 5);
        assert_eq!(c.unreadable.len(), 1);
        assert_eq!(
            c.records[0].signal(),
            Some(&signal(Kind::Reboot)),
            "a record reads back exactly"
        );
        assert_eq!(
            c.records[3].entry,
            Entry::Outcome {
                episode: 1,
                outcome: Outcome::Cancelled
            }
        );
        let kinds = |f: BootFilter, cur: &str| -> Vec<Kind> {
            select(&c.records, &f, cur)
                .iter()
                .filter_map(|r| r.signal())
                .map(|s| s.kind)
                .collect()
        };
        assert_eq!(kinds(BootFilter::Current, "boot-b"), vec![Kind::Halt]);
        assert_eq!(
            kinds(BootFilter::Previous, "boot-b"),
            vec![Kind::Reboot, Kind::Poweroff, Kind::Kexec]
        );
        assert_eq!(kinds(BootFilter::Previous, "boot-c"), vec![Kind::Halt]);
        assert_eq!(kinds(BootFilter::Id("boot-a".into()), "x").len(), 3);
        assert_eq!(kinds(BootFilter::All, "x").len(), 4);
        assert_eq!(select(&c.records, &BootFilter::All, "x").len(), 5);
        fs::remove_dir_all(&dir).unwrap();
    }
}
