//! The durable shutdown audit: JSON lines, one per detection, each fsync'd
//! before anything else acts on it, because the machine may die a millisecond
//! later. The one exception is the last gasp: its patches leave while the
//! record syncs ([`AuditLog::sync_beside`]); what the cluster acknowledged
//! but the disk lost is found on the Node after the next boot
//! ([`Outcome::FoundOnNode`]).
use std::{
    fs::{self, File, OpenOptions},
    io::{BufRead, BufReader, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use anyhow::{Context, Result};

use crate::{decide::Decision, signal::ShutdownSignal};

pub use lastgasp_common::wire::audit::{
    AuditRecord, Entry, Outcome, CONTAINER_FILE_NAME, DEFAULT_DIR, FILE_NAME,
};

/// How much audit the node keeps, per log (the node's, the containers'):
/// `files` files of at most `max_file_bytes` each (the current one and
/// `files - 1` rotated ones, `audit.jsonl.1` the newest of those).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_file_bytes: u64,
    pub files: u32,
}

impl Default for Limits {
    /// 8 MiB × 4: about 40,000 records (~850 bytes each), read whole at start
    /// in well under a second, and never more than 32 MiB of the node's disk
    /// per log (64 MiB with the containers' beside it).
    fn default() -> Self {
        Limits {
            max_file_bytes: 8 << 20,
            files: 4,
        }
    }
}

/// How far back from the end of a file `open` looks for this boot's last
/// sequence number (a record is ~1 KiB).
const TAIL_BYTES: u64 = 256 << 10;

pub struct AuditLog {
    /// The node's records: every episode, its outcomes, the agent's starts.
    node: Sink,
    /// Containers' records (`Scope::Container`).
    containers: Sink,
    boot_id: String,
    /// Numbers this boot's records across both logs.
    next_seq: u64,
    /// Runs before the fdatasync of [`AuditLog::sync_beside`] (tests hold a
    /// sync there, as a loaded disk would).
    before_beside_sync: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Held while the log is open: one writer per directory.
    _lock: File,
}

/// One log file and its rotated ones.
struct Sink {
    file: File,
    path: PathBuf,
    limits: Limits,
    /// The current file's length as written.
    len: u64,
    /// Records written since the last fdatasync.
    unsynced: bool,
}

/// A decision as an audit line carries it: the episode with its first
/// timeline entry (which names it) and its newest (this line's change); the
/// entries between are in the episode's earlier lines. Each line stays a
/// few hundred bytes however many requests join the episode.
fn changes_only(d: &Decision) -> Decision {
    let mut d = d.clone();
    if let Some(ep) = d.episode.as_mut() {
        let n = ep.timeline.len();
        if n > 2 {
            ep.timeline.drain(1..n - 1);
            ep.timeline_omitted = ep.timeline_omitted.saturating_add((n - 2) as u32);
        }
    }
    d
}

/// The lock file beside the log.
const LOCK_NAME: &str = "audit.lock";

/// Opened for appending (created 0600).
fn open_private(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

impl AuditLog {
    pub fn open(dir: &Path, boot_id: &str) -> Result<Self> {
        Self::open_with(dir, boot_id, Limits::default())
    }

    pub fn open_with(dir: &Path, boot_id: &str, limits: Limits) -> Result<Self> {
        // Who shut the node down, and the actors' argv: root's alone.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating audit directory {}", dir.display()))?;
        let lock_path = dir.join(LOCK_NAME);
        let lock =
            open_private(&lock_path).with_context(|| format!("opening {}", lock_path.display()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => anyhow::bail!(
                "the audit log {} is held by another process (another agent?): two writers would interleave their records",
                dir.display()
            ),
            Err(fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", lock_path.display()))
            }
        }
        let node = Sink::open(&dir.join(FILE_NAME), limits)?;
        let containers = Sink::open(&dir.join(CONTAINER_FILE_NAME), limits)?;
        let next_seq = [&node.path, &containers.path]
            .into_iter()
            .flat_map(|p| {
                files(p)
                    .into_iter()
                    .rev()
                    .find_map(|p| last_seq(&p, boot_id))
            })
            .max()
            .map_or(0, |s| s + 1);
        // Make the files' own directory entries durable too.
        File::open(dir).and_then(|d| d.sync_all()).ok();
        Ok(AuditLog {
            _lock: lock,
            node,
            containers,
            boot_id: boot_id.to_string(),
            next_seq,
            before_beside_sync: None,
        })
    }

    /// The node's log (the containers' is [`CONTAINER_FILE_NAME`] beside it).
    pub fn path(&self) -> &Path {
        &self.node.path
    }

    /// The boot this log writes for.
    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    /// Appends a detection and its decision, and waits until it is on disk:
    /// for records that act (the machine may die a millisecond later).
    pub fn append(
        &mut self,
        signal: &ShutdownSignal,
        decision: Option<&Decision>,
    ) -> Result<AuditRecord> {
        self.append_as(signal, decision, Durability::Now)
    }

    /// Appends a detection and its decision; `Batched` leaves the fdatasync
    /// to the next [`AuditLog::flush`] or durable write (audit-only records:
    /// a pod flooding execs of `reboot` must not cost an fsync each).
    pub fn append_as(
        &mut self,
        signal: &ShutdownSignal,
        decision: Option<&Decision>,
        durability: Durability,
    ) -> Result<AuditRecord> {
        self.write(
            Entry::Signal {
                signal: signal.clone(),
                decision: decision.map(changes_only),
            },
            durability,
        )
    }

    pub fn agent_start(&mut self) -> Result<AuditRecord> {
        self.write(
            Entry::AgentStart {
                version: env!("CARGO_PKG_VERSION").to_string(),
            },
            Durability::Now,
        )
    }

    pub fn outcome(&mut self, episode: u32, outcome: Outcome) -> Result<AuditRecord> {
        self.write(Entry::Outcome { episode, outcome }, Durability::Now)
    }

    /// A job that makes every record written so far durable, to run off the
    /// agent's loop (`spawn_blocking`) while the last gasp leaves: the
    /// fdatasync takes tens to hundreds of milliseconds on a loaded disk,
    /// and a direct reboot(2) leaves about as long.
    pub fn sync_beside(&self) -> Result<impl FnOnce() -> Result<()> + Send + 'static> {
        let file = self
            .node
            .file
            .try_clone()
            .context("duplicating the audit log's fd")?;
        let before = self.before_beside_sync.clone();
        Ok(move || {
            if let Some(f) = before {
                f();
            }
            file.sync_data().context("fsync of the audit log")
        })
    }

    /// For tests: `f` runs before every [`AuditLog::sync_beside`] fdatasync.
    #[doc(hidden)]
    pub fn before_beside_sync(&mut self, f: impl Fn() + Send + Sync + 'static) {
        self.before_beside_sync = Some(Arc::new(f));
    }

    /// Makes every record written so far durable (one fdatasync per log).
    pub fn flush(&mut self) -> Result<()> {
        self.node.flush()?;
        self.containers.flush()
    }

    fn write(&mut self, entry: Entry, durability: Durability) -> Result<AuditRecord> {
        // A sequence number is used once, whether its write succeeds or not.
        let seq = self.next_seq;
        self.next_seq += 1;
        let record = AuditRecord {
            boot_id: self.boot_id.clone(),
            seq,
            written_at: SystemTime::now(),
            entry,
        };
        let mut line = serde_json::to_vec(&record)?;
        line.push(b'\n');
        let container = record
            .signal()
            .is_some_and(|s| s.scope == crate::signal::Scope::Container);
        let sink = if container {
            &mut self.containers
        } else {
            &mut self.node
        };
        sink.append(&line)?;
        if durability == Durability::Now {
            sink.flush()?;
        }
        Ok(record)
    }
}

impl Sink {
    /// Opened for appending (0600), a torn last line ended.
    fn open(path: &Path, limits: Limits) -> Result<Self> {
        let mut file =
            open_private(path).with_context(|| format!("opening audit log {}", path.display()))?;
        // A log written by an older agent (0644) becomes private too.
        file.set_permissions(fs::Permissions::from_mode(0o600))
            .with_context(|| format!("chmod 0600 {}", path.display()))?;
        let mut len = file.metadata()?.len();
        // A power loss mid-write leaves a line without its newline: end it,
        // so that the next record starts a line of its own (the torn bytes
        // stay, reported as unreadable).
        if len > 0 && last_byte(&mut file, len)? != b'\n' {
            file.write_all(b"\n")
                .context("ending the torn last line of the audit log")?;
            file.sync_data()?;
            len += 1;
            tracing::warn!(file = %path.display(), "audit log: a torn last line was ended");
        }
        Ok(Sink {
            file,
            path: path.to_path_buf(),
            limits,
            len,
            unsynced: false,
        })
    }

    fn append(&mut self, line: &[u8]) -> Result<()> {
        if self.len > 0 && self.len + line.len() as u64 > self.limits.max_file_bytes {
            self.rotate().context("rotating the audit log")?;
        }
        // One write(2) on an O_APPEND file: a record is never interleaved.
        if let Err(e) = self.file.write_all(line) {
            // Part of it may be there (ENOSPC): cut back to the record
            // boundary, so the file never holds half a record.
            if let Err(t) = self.file.set_len(self.len) {
                tracing::error!("audit log: cutting a partial record back failed: {t}");
            }
            return Err(e).context("writing the audit log");
        }
        self.len += line.len() as u64;
        self.unsynced = true;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.unsynced {
            self.file.sync_data().context("fsync of the audit log")?;
            self.unsynced = false;
        }
        Ok(())
    }

    /// The current file becomes `.1`, `.1` becomes `.2`..., the oldest goes.
    fn rotate(&mut self) -> Result<()> {
        self.flush()?;
        let keep = self.limits.files.max(1);
        let rotated = |i: u32| PathBuf::from(format!("{}.{i}", self.path.display()));
        if keep == 1 {
            self.file.set_len(0)?;
        } else {
            let _ = fs::remove_file(rotated(keep - 1));
            for i in (1..keep - 1).rev() {
                if rotated(i).exists() {
                    fs::rename(rotated(i), rotated(i + 1))?;
                }
            }
            fs::rename(&self.path, rotated(1))?;
            self.file = open_private(&self.path)?;
        }
        if let Some(dir) = self.path.parent() {
            File::open(dir).and_then(|d| d.sync_all()).ok();
        }
        self.len = 0;
        Ok(())
    }
}

/// Whether a record must be on disk before the write returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    Now,
    Batched,
}

fn last_byte(file: &mut File, len: u64) -> std::io::Result<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let mut b = [0u8];
    file.seek(SeekFrom::Start(len - 1))?;
    file.read_exact(&mut b)?;
    Ok(b[0])
}

/// The last sequence number of `boot_id` in the tail of `path`.
fn last_seq(path: &Path, boot_id: &str) -> Option<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))
        .ok()?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).ok()?;
    tail.split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<AuditRecord>(l).ok())
        .filter(|r| r.boot_id == boot_id)
        .map(|r| r.seq)
        .max()
}

/// The log's files, oldest first: `audit.jsonl.N` ... `audit.jsonl.1`,
/// `audit.jsonl`.
pub fn files(path: &Path) -> Vec<PathBuf> {
    let mut rotated: Vec<(u32, PathBuf)> = Vec::new();
    if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
        let prefix = format!("{}.", name.to_string_lossy());
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if let Some(i) = n.strip_prefix(&prefix).and_then(|i| i.parse().ok()) {
                    rotated.push((i, e.path()));
                }
            }
        }
    }
    rotated.sort_by_key(|r| std::cmp::Reverse(r.0));
    let mut out: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    out.push(path.to_path_buf());
    out
}

/// What the log holds, and how many lines could not be read (a line torn by
/// a power loss, say).
#[derive(Debug, Default)]
pub struct Contents {
    pub records: Vec<AuditRecord>,
    pub unreadable: Vec<(usize, String)>,
}

/// Reads the log at `path` and its rotated files, oldest first (bounded by
/// the rotation's limits). Unreadable lines are counted per file, by line.
pub fn read(path: &Path) -> Result<Contents> {
    let mut out = Contents::default();
    for p in files(path) {
        let file = match File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("opening {}", p.display())),
        };
        parse_into(BufReader::new(file), &mut out)?;
    }
    Ok(out)
}

/// The records of one file's bytes (what `read` does per file).
pub fn parse(bytes: &[u8]) -> Contents {
    let mut out = Contents::default();
    // Reading from a slice cannot fail.
    let _ = parse_into(bytes, &mut out);
    out
}

fn parse_into(r: impl BufRead, out: &mut Contents) -> std::io::Result<()> {
    for (i, line) in r.split(b'\n').enumerate() {
        let line = line?;
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<AuditRecord>(&line) {
            Ok(r) => out.records.push(r),
            Err(e) => out.unreadable.push((i + 1, e.to_string())),
        }
    }
    Ok(())
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
pub fn boots(records: &[AuditRecord]) -> Vec<&str> {
    let mut seen: Vec<&str> = Vec::new();
    for r in records {
        if !seen.contains(&r.boot_id.as_str()) {
            seen.push(&r.boot_id);
        }
    }
    seen
}

pub fn select<'a>(
    records: &'a [AuditRecord],
    filter: &BootFilter,
    current_boot: &str,
) -> Vec<&'a AuditRecord> {
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

/// `lastgasp history`: the audit log's records of `boot`, the node's and
/// the containers' in the order they were written, as JSON lines.
pub fn history(dir: &Path, boot: &BootFilter) -> Result<()> {
    let mut records = Vec::new();
    for name in [FILE_NAME, CONTAINER_FILE_NAME] {
        let path = dir.join(name);
        let contents = read(&path)?;
        for (line, err) in &contents.unreadable {
            eprintln!("{}:{line}: unreadable record: {err}", path.display());
        }
        records.extend(contents.records);
    }
    // Stable: each log's own order stands where two times are equal.
    records.sort_by_key(|r| r.written_at);
    let current = crate::node::boot_id().context("reading the current boot id")?;
    for r in select(&records, boot, &current) {
        println!("{}", serde_json::to_string(r)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signal::{Kind, Source};

    fn signal(kind: Kind) -> ShutdownSignal {
        ShutdownSignal::of(Source::RebootSyscall, kind)
            .at(SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(1_700_000_000_123_456_789))
            .boot_ns(42)
    }

    /// An episode joined again and again: each audit line carries its first
    /// and newest timeline entries only.
    #[test]
    fn an_audit_line_carries_the_episodes_changes_not_its_history() {
        let dir = std::env::temp_dir().join(format!("lastgasp-audit-delta-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut a = AuditLog::open(&dir, "b").unwrap();
        let mut decider = crate::decide::Decider::new();
        let mut sizes = Vec::new();
        for _ in 0..20 {
            let s = signal(Kind::Poweroff);
            let d = decider.decide(&s);
            a.append(&s, Some(&d)).unwrap();
            sizes.push(fs::metadata(dir.join(FILE_NAME)).unwrap().len());
        }
        let c = read(&dir.join(FILE_NAME)).unwrap();
        let last = c.records.last().unwrap();
        let Entry::Signal {
            decision: Some(d), ..
        } = &last.entry
        else {
            panic!("{last:?}")
        };
        let ep = d.episode.as_ref().unwrap();
        assert_eq!(ep.timeline.len(), 2, "{ep:?}");
        assert_eq!(ep.timeline_omitted, 18);
        let first = match &c.records[0].entry {
            Entry::Signal {
                decision: Some(d), ..
            } => d.episode.clone().unwrap(),
            e => panic!("{e:?}"),
        };
        assert_eq!(
            ep.timeline[0], first.timeline[0],
            "the opener names the episode"
        );
        // Lines do not grow with the episode.
        let line = |i: usize| sizes[i] - if i == 0 { 0 } else { sizes[i - 1] };
        assert!(line(19) <= line(3) + 16, "{} vs {}", line(19), line(3));
        fs::remove_dir_all(&dir).ok();
    }

    /// Root's alone, and one writer: a second agent on the same directory
    /// is refused with a reason, not interleaved.
    #[test]
    fn the_log_is_private_and_has_one_writer() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("lastgasp-audit-lock-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut a = AuditLog::open(&dir, "boot-a").unwrap();
        a.append(&signal(Kind::Reboot), None).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.join(FILE_NAME)), 0o600);
        assert_eq!(mode(&dir), 0o700);
        let e = format!("{:#}", AuditLog::open(&dir, "boot-a").err().unwrap());
        assert!(e.contains("held by another process"), "{e}");
        drop(a);
        // An older agent's world-readable log becomes private when opened.
        fs::set_permissions(dir.join(FILE_NAME), fs::Permissions::from_mode(0o644)).unwrap();
        let _b = AuditLog::open(&dir, "boot-a").unwrap();
        assert_eq!(mode(&dir.join(FILE_NAME)), 0o600);
        fs::remove_dir_all(&dir).ok();
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
        drop(b);
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

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("lastgasp-audit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn rotation_keeps_a_bounded_number_of_files_and_numbering_goes_on() {
        let dir = scratch("rotate");
        let limits = Limits {
            max_file_bytes: 4096,
            files: 3,
        };
        let mut a = AuditLog::open_with(&dir, "boot-a", limits).unwrap();
        for _ in 0..40 {
            a.append_as(&signal(Kind::Reboot), None, Durability::Batched)
                .unwrap();
        }
        a.flush().unwrap();
        drop(a);
        let names: Vec<String> = files(&dir.join(FILE_NAME))
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["audit.jsonl.2", "audit.jsonl.1", "audit.jsonl"]);
        let total: u64 = files(&dir.join(FILE_NAME))
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        assert!(total <= 3 * 4096, "{total}");
        let c = read(&dir.join(FILE_NAME)).unwrap();
        let seqs: Vec<u64> = c.records.iter().map(|r| r.seq).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
        assert_eq!(*seqs.last().unwrap(), 39, "the newest kept");
        // Reopened (a restart), this boot's numbering goes on from the tail.
        let mut again = AuditLog::open_with(&dir, "boot-a", limits).unwrap();
        assert_eq!(again.outcome(1, Outcome::Cancelled).unwrap().seq, 40);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A container flood fills and rotates the containers' log only: the
    /// node's history stays whole, and numbering runs across both.
    #[test]
    fn a_container_flood_never_rotates_the_nodes_history_away() {
        let dir = scratch("containers");
        let limits = Limits {
            max_file_bytes: 4096,
            files: 2,
        };
        let mut a = AuditLog::open_with(&dir, "boot-a", limits).unwrap();
        a.append(&signal(Kind::Poweroff), None).unwrap();
        let mut flood = signal(Kind::Reboot);
        flood.scope = crate::signal::Scope::Container;
        for _ in 0..200 {
            a.append_as(&flood, None, Durability::Batched).unwrap();
        }
        let last = a.outcome(1, Outcome::Cancelled).unwrap();
        a.flush().unwrap();
        assert_eq!(last.seq, 201);
        let node = read(&dir.join(FILE_NAME)).unwrap().records;
        assert_eq!(node.len(), 2, "the node's record and its outcome, kept");
        assert_eq!(node[0].signal().map(|s| s.kind), Some(Kind::Poweroff));
        let ctr = read(&dir.join(CONTAINER_FILE_NAME)).unwrap().records;
        assert!(!ctr.is_empty() && ctr.len() < 200, "rotated: {}", ctr.len());
        assert!(ctr.iter().all(|r| r
            .signal()
            .is_some_and(|s| s.scope == crate::signal::Scope::Container)));
        drop(a);
        let mut again = AuditLog::open_with(&dir, "boot-a", limits).unwrap();
        assert_eq!(
            again.agent_start().unwrap().seq,
            202,
            "numbering goes on across both"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_torn_tail_is_ended_so_the_next_record_reads() {
        let dir = scratch("torn");
        let mut a = AuditLog::open(&dir, "b").unwrap();
        a.append(&signal(Kind::Reboot), None).unwrap();
        drop(a);
        OpenOptions::new()
            .append(true)
            .open(dir.join(FILE_NAME))
            .unwrap()
            .write_all(b"{\"boot_id\":\"b\",\"seq\":1,\"writ")
            .unwrap();
        let mut b = AuditLog::open(&dir, "b").unwrap();
        let r = b.append(&signal(Kind::Halt), None).unwrap();
        assert_eq!(r.seq, 1, "the torn record's number was never confirmed");
        let c = read(&dir.join(FILE_NAME)).unwrap();
        assert_eq!(c.records.len(), 2);
        assert_eq!(c.records[1].signal().map(|s| s.kind), Some(Kind::Halt));
        assert_eq!(
            c.unreadable.len(),
            1,
            "the torn bytes are kept and reported"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A full disk: the record that does not fit is cut back whole, the file
    /// stays clean, and no sequence number is used twice.
    #[test]
    fn a_write_that_fails_part_way_is_cut_back_and_its_number_not_reused() {
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED a_write_that_fails_part_way: mounting a small tmpfs needs root");
            return;
        }
        let dir = scratch("enospc");
        fs::create_dir_all(&dir).unwrap();
        let mounted = nix::mount::mount(
            Some("tmpfs"),
            &dir,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=8k"),
        );
        if let Err(e) = mounted {
            println!("SKIPPED a_write_that_fails_part_way: mounting a tmpfs: {e}");
            return;
        }
        let outcome = std::panic::catch_unwind(|| {
            let mut a = AuditLog::open_with(
                &dir,
                "b",
                Limits {
                    max_file_bytes: 1 << 20,
                    files: 1,
                },
            )
            .unwrap();
            let mut seqs = Vec::new();
            let mut failed = None;
            for _ in 0..100 {
                match a.append(&signal(Kind::Reboot), None) {
                    Ok(r) => seqs.push(r.seq),
                    Err(e) => {
                        failed = Some(format!("{e:#}"));
                        break;
                    }
                }
            }
            assert!(
                failed.is_some_and(|e| e.contains("No space left")),
                "the disk filled"
            );
            let len = fs::metadata(dir.join(FILE_NAME)).unwrap().len();
            let c = read(&dir.join(FILE_NAME)).unwrap();
            assert_eq!(c.unreadable.len(), 0, "no half record");
            assert_eq!(c.records.len(), seqs.len());
            assert_eq!(len, fs::read(dir.join(FILE_NAME)).unwrap().len() as u64);
            // Room again (a small outcome fits where a signal did not): its
            // number is past the failed one.
            let r = a.outcome(1, Outcome::Cancelled);
            if let Ok(r) = r {
                assert_eq!(
                    r.seq,
                    seqs.len() as u64 + 1,
                    "the failed write's number is not reused"
                );
            }
        });
        nix::mount::umount(&dir).unwrap();
        fs::remove_dir_all(&dir).ok();
        outcome.unwrap();
    }
}
