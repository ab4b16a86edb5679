//! Reading what a guest left behind: the runner's timeline, the audit log,
//! the detections and decisions, the hooks armed and the capabilities held.
//!
//! The audit log is read from the guest's audit disk (a raw ext4 image) on
//! the host after qemu is gone: its journal is replayed first on a copy
//! (`e2fsck -E journal_only`), as the next boot's mount would do, then the
//! file is read with `debugfs`. Nothing is mounted on the host.
use std::{fs, path::Path, process::Command, time::Duration};

use anyhow::{bail, Context, Result};
use lastgasp_common::wire::{
    audit::{AuditRecord, Entry, StdoutLine},
    episode::Action,
    signal::{Detail, ShutdownSignal},
};

use super::qemu::Run;
use crate::cmd::output;

/// The runner's `out/timeline` ("NS WORD ...", guest CLOCK_REALTIME) and `out/boots`.
pub struct Timeline {
    lines: Vec<(i128, String)>,
    pub boots: Vec<String>,
}

impl Timeline {
    pub fn read(out: &Path) -> Timeline {
        let lines = fs::read_to_string(out.join("timeline"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (ns, rest) = l.split_once(' ')?;
                Some((ns.parse().ok()?, rest.to_string()))
            })
            .collect();
        let boots = fs::read_to_string(out.join("boots"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        Timeline { lines, boots }
    }
    fn first(&self, word: &str) -> Option<&(i128, String)> {
        self.lines
            .iter()
            .find(|(_, l)| l == word || l.starts_with(&format!("{word} ")))
    }
    pub fn trigger_ns(&self) -> Option<i128> {
        self.first("TRIGGER").map(|(t, _)| *t)
    }
    pub fn armed(&self) -> bool {
        self.first("ARMED").is_some()
    }
    pub fn fails(&self) -> Vec<String> {
        self.lines
            .iter()
            .filter(|(_, l)| l.starts_with("FAIL"))
            .map(|(_, l)| l.clone())
            .collect()
    }
    pub fn ended(&self, how: &str) -> bool {
        self.lines.iter().any(|(_, l)| l == &format!("END {how}"))
    }
    /// Where the scenario's window closes: the runner's own "still up" or
    /// "end" marker (what it runs after that is the harness's, not the scenario's).
    pub fn after_trigger_end_ns(&self) -> Option<i128> {
        let t0 = self.trigger_ns()?;
        self.lines
            .iter()
            .find(|(t, l)| *t > t0 && (l.starts_with("STILL-UP") || l.starts_with("END")))
            .map(|(t, _)| *t)
    }
}

pub struct AuditDisk {
    /// Detections (`type: signal`).
    pub records: Vec<AuditRecord>,
    /// Everything else the agent wrote (`agent-start`, `outcome`...).
    pub others: Vec<AuditRecord>,
    pub unreadable: usize,
    /// The file system was not cleanly unmounted: its journal had to be replayed.
    pub needed_recovery: bool,
}

impl AuditDisk {
    pub fn summary(&self) -> String {
        format!(
            "{} record(s){}{}",
            self.records.len() + self.others.len(),
            if self.needed_recovery {
                ", journal replayed"
            } else {
                ", clean"
            },
            if self.unreadable > 0 {
                format!(", {} torn line(s)", self.unreadable)
            } else {
                String::new()
            }
        )
    }
}

pub fn read_audit(img: &Path) -> Result<AuditDisk> {
    let stats = output(Command::new("debugfs").args(["-R", "stats"]).arg(img))?;
    let needed_recovery = stats
        .lines()
        .any(|l| l.starts_with("Filesystem features:") && l.contains("needs_recovery"));
    let copy = img.with_extension("replayed.img");
    fs::copy(img, &copy)?;
    let st = Command::new("e2fsck")
        .args(["-E", "journal_only", "-y"])
        .arg(&copy)
        .output()
        .context("running e2fsck")?;
    // 0: clean, 1: corrected (the journal replayed).
    if !matches!(st.status.code(), Some(0 | 1)) {
        bail!(
            "e2fsck -E journal_only on a copy of {}: {}",
            img.display(),
            String::from_utf8_lossy(&st.stderr).trim()
        );
    }
    // The node's log and the containers' beside it (absent: none written).
    let mut text = String::new();
    for file in ["/audit.jsonl", "/audit-containers.jsonl"] {
        let cmd = format!("cat {file}");
        text.push_str(&output(
            Command::new("debugfs").args(["-R", &cmd]).arg(&copy),
        )?);
    }
    let _ = fs::remove_file(&copy);
    fs::write(img.with_extension("audit.jsonl"), &text)?;
    Ok(AuditDisk {
        needed_recovery,
        ..AuditDisk::parse(&text)
    })
}

impl AuditDisk {
    /// The audit's lines, read as the agent writes them (`wire::audit`): a
    /// line that is not one (torn, or of another format) is counted.
    pub fn parse(text: &str) -> AuditDisk {
        let (mut records, mut others) = (Vec::new(), Vec::new());
        let mut unreadable = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<AuditRecord>(line) {
                Ok(r) if r.signal().is_some() => records.push(r),
                Ok(r) => others.push(r),
                Err(_) => unreadable += 1,
            }
        }
        // In the order written, across the two logs.
        records.sort_by_key(|r| r.written_at);
        others.sort_by_key(|r| r.written_at);
        AuditDisk {
            records,
            others,
            unreadable,
            needed_recovery: false,
        }
    }
}

/// One detection, merged from the audit on disk and the agent's stdout.
#[derive(Clone, Debug)]
pub struct Det {
    pub source: String,
    pub kind: String,
    pub forced: bool,
    pub scope: String,
    /// now | scheduled | cancel | none
    pub effect: String,
    pub comm: String,
    pub pid: u64,
    /// Human label: the argv, the reboot(2) command, the signal...
    pub what: String,
    pub boot_ns: u64,
    pub at_ns: Option<i128>,
    pub written_ns: Option<i128>,
    pub on_disk: bool,
    pub on_stdout: bool,
    /// Arrival of the agent's stdout line on the host (host clock from qemu's start).
    pub stdout_t: Option<Duration>,
    /// From the trigger, guest clock.
    pub at_ms: Option<f64>,
    pub written_ms: Option<f64>,
    /// The decision core's action for it, as audited (on disk only).
    pub decision: Option<String>,
}

/// An exec's argv, its program's base name first, cut at 48 characters.
fn argv_text(argv: &[String]) -> String {
    let mut s = argv
        .iter()
        .enumerate()
        .map(|(i, a)| {
            if i == 0 {
                a.rsplit('/').next().unwrap_or(a)
            } else {
                a
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    if s.len() > 48 {
        s.truncate(45);
        s.push_str("...");
    }
    s
}

impl Det {
    fn from_signal(s: &ShutdownSignal) -> Det {
        let (comm, pid) = s
            .actor
            .as_ref()
            .map_or((String::new(), 0), |a| (a.comm.clone(), u64::from(a.pid)));
        let what = match &s.detail {
            Detail::Exec { argv, .. } => format!("exec `{}`", argv_text(argv)),
            Detail::Reboot { cmd, .. } => {
                format!("reboot(2) {} by {comm}", reboot_cmd(u64::from(*cmd)))
            }
            Detail::Signal { name, .. } => format!("{name} to PID 1 by {comm}"),
            Detail::Kernel { function, via } => format!("{function} ({via})"),
            Detail::Dbus { member, unit } => format!(
                "{} {member}{}",
                s.source,
                unit.as_ref().map(|u| format!(" {u}")).unwrap_or_default()
            ),
            _ => format!("{} {comm}", s.source),
        };
        Det {
            source: s.source.to_string(),
            kind: s.kind.to_string(),
            forced: s.forced,
            scope: s.scope.to_string(),
            effect: s.effect.name().to_string(),
            comm,
            pid,
            what,
            boot_ns: s.boot_ns,
            at_ns: system_ns(s.at),
            written_ns: None,
            on_disk: false,
            on_stdout: false,
            stdout_t: None,
            at_ms: None,
            written_ms: None,
            decision: None,
        }
    }

    /// For the matrix: label, ms after the trigger, where it was found.
    pub fn short(&self) -> String {
        format!(
            "{}{} [{}]",
            self.what,
            self.at_ms.map(|m| format!(" +{m:.0}")).unwrap_or_default(),
            if self.on_disk { "D" } else { "S" }
        )
    }

    pub fn long(&self) -> String {
        format!(
            "{} (source={} kind={} forced={} scope={} effect={} comm={} pid={}{})",
            self.what,
            self.source,
            self.kind,
            self.forced,
            self.scope,
            self.effect,
            self.comm,
            self.pid,
            if self.on_disk {
                ", on disk"
            } else {
                ", stdout only"
            }
        )
    }
}

/// An action as "graceful (protected)", "audit-only (why)".
fn decision_label(a: &Action) -> String {
    let mut extra = Vec::new();
    match a {
        Action::Graceful {
            protected: true, ..
        } => extra.push("protected"),
        Action::Immediate { escalated: true } => extra.push("escalated"),
        _ => {}
    }
    extra.extend(a.why());
    if extra.is_empty() {
        a.name().to_string()
    } else {
        format!("{} ({})", a.name(), extra.join(", "))
    }
}

/// Nanoseconds since the epoch (the timeline's clock).
fn system_ns(t: std::time::SystemTime) -> Option<i128> {
    t.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_nanos() as i128)
}

/// The decisions of a scenario's detections, in order, without the joins,
/// and the outcomes the agent audited after the trigger; `None` when the
/// agent wrote no decisions (a build without the decision core).
pub fn decisions(dets: &[Det], audit: &AuditDisk, boot1: &str, trig_ns: i128) -> Option<String> {
    if !dets.iter().any(|d| d.decision.is_some()) {
        return None;
    }
    let mut out: Vec<String> = Vec::new();
    for d in dets {
        if let Some(x) = &d.decision {
            let name = x.split(' ').next().unwrap_or("");
            if name == "join" || out.last() == Some(x) {
                continue;
            }
            out.push(x.clone());
        }
    }
    for o in &audit.others {
        let in_window = o.boot_id == boot1 && system_ns(o.written_at).is_some_and(|w| w >= trig_ns);
        if let (true, Entry::Outcome { outcome, .. }) = (in_window, &o.entry) {
            out.push(format!("outcome {}", outcome.name()));
        }
    }
    Some(out.join(" → "))
}

fn reboot_cmd(cmd: u64) -> String {
    match cmd {
        0x0123_4567 => "RESTART".into(),
        0xa1b2_c3d4 => "RESTART2".into(),
        0x4321_fedc => "POWER_OFF".into(),
        0xcdef_0123 => "HALT".into(),
        0x4558_4543 => "KEXEC".into(),
        0x89ab_cdef => "CAD_ON".into(),
        0 => "CAD_OFF".into(),
        c => format!("{c:#x}"),
    }
}

/// Detections of boot `boot1` between the trigger and `until_ns` (guest
/// clock), from the audit on disk and from the agent's stdout as the host
/// got it before the second boot, merged and in kernel order.
pub fn merge(
    audit: &AuditDisk,
    boot1: &str,
    run: &Run,
    boot2_t: Option<Duration>,
    trig_ns: i128,
    until_ns: Option<i128>,
) -> Vec<Det> {
    let mut dets: Vec<Det> = Vec::new();
    for r in audit.records.iter().filter(|r| r.boot_id == boot1) {
        if let Entry::Signal { signal, decision } = &r.entry {
            let mut d = Det::from_signal(signal);
            d.on_disk = true;
            d.decision = decision.as_ref().map(|x| decision_label(&x.action));
            d.written_ns = system_ns(r.written_at);
            dets.push(d);
        }
    }
    for line in &run.agent {
        if boot2_t.is_some_and(|b| line.t >= b) {
            break;
        }
        let Ok(v) = serde_json::from_str::<StdoutLine>(line.text.trim()) else {
            continue;
        };
        let d = Det::from_signal(&v.signal);
        match dets
            .iter_mut()
            .find(|x| x.source == d.source && x.boot_ns == d.boot_ns)
        {
            Some(x) => {
                x.on_stdout = true;
                x.stdout_t = Some(line.t);
            }
            None => dets.push(Det {
                on_stdout: true,
                stdout_t: Some(line.t),
                decision: Some(decision_label(&v.decision)),
                ..d
            }),
        }
    }
    dets.retain(|d| {
        d.at_ns
            .is_some_and(|a| a >= trig_ns && until_ns.is_none_or(|u| a < u))
    });
    dets.sort_by_key(|d| d.boot_ns);
    for d in &mut dets {
        d.at_ms = d.at_ns.map(|a| (a - trig_ns) as f64 / 1e6);
        d.written_ms = d.written_ns.map(|w| (w - trig_ns) as f64 / 1e6);
    }
    dets
}

/// What the second boot's `lastgasp history --boot previous` said: how many
/// records of the first boot, and a summary.
pub fn next_boot_report(out: &Path, boot1: &str, dets: &[Det]) -> (usize, String) {
    let text = fs::read_to_string(out.join("history-boot2.jsonl")).unwrap_or_default();
    let recs: Vec<AuditRecord> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if recs.is_empty() {
        let err = fs::read_to_string(out.join("history-boot2.err")).unwrap_or_default();
        return (
            0,
            format!(
                "no records{}",
                if err.trim().is_empty() {
                    String::new()
                } else {
                    format!(" ({})", err.trim())
                }
            ),
        );
    }
    let of_boot1 = recs
        .iter()
        .filter(|r| r.boot_id == boot1 && r.signal().is_some())
        .count();
    let on_disk = dets.iter().filter(|d| d.on_disk).count();
    let last = recs
        .iter()
        .rev()
        .find_map(AuditRecord::signal)
        .map(|s| Det::from_signal(s).what)
        .unwrap_or_else(|| "-".into());
    (
        of_boot1,
        format!(
            "`history --boot previous`: {of_boot1} detection(s) of the shut-down boot (the trigger window had {on_disk} on disk); last: {last}"
        ),
    )
}

/// The agent's hook report, from the console (first boot). The agent writes
/// it with `eprintln!`, whose pieces reach /dev/kmsg as separate records
/// (one per write(2)), so the lines are glued back: an empty record is a
/// newline.
pub fn hook_lines(run: &Run) -> Vec<String> {
    let Some(start) = run
        .console
        .iter()
        .position(|l| l.text.contains("lastgasp: hooks"))
    else {
        return Vec::new();
    };
    let mut text = String::new();
    for l in &run.console[start + 1..] {
        if l.text.contains("lastgasp: armed") || l.text.contains("lastgasp-vm: ") {
            break;
        }
        // Kernel records only ("[    1.234567] text"); systemd's own console lines are not the agent's.
        let Some(rest) = l
            .text
            .strip_prefix('[')
            .and_then(|t| t.split_once("] "))
            .filter(|(ts, _)| ts.trim().parse::<f64>().is_ok())
            .map(|(_, r)| r)
        else {
            continue;
        };
        if rest.is_empty() {
            text.push('\n');
        } else {
            text.push_str(rest);
        }
    }
    text.lines()
        // The report's heading may be glued to its first line.
        .map(|l| l.rsplit_once("): ").map(|(_, r)| r).unwrap_or(l))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| l.contains("armed") || l.contains("unavailable"))
        .collect()
}

const CAP_NAMES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

fn cap_names(hex: &str) -> String {
    let Ok(v) = u64::from_str_radix(hex.trim(), 16) else {
        return format!("?{hex}");
    };
    let names: Vec<String> = (0..64)
        .filter(|b| v & (1 << b) != 0)
        .map(|b| {
            CAP_NAMES
                .get(b)
                .map(|n| format!("CAP_{n}"))
                .unwrap_or_else(|| format!("cap{b}"))
        })
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(" ")
    }
}

/// The running agent's uid and capabilities, as /proc showed them.
pub fn caps(out: &Path) -> String {
    let s = fs::read_to_string(out.join("agent-status-boot1")).unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
    };
    match (get("CapEff:"), get("Uid:")) {
        (Some(eff), Some(uid)) => format!(
            "uid {}, effective {}, bounding {}, NoNewPrivs {}",
            uid.split_whitespace().next().unwrap_or("?"),
            cap_names(&eff),
            cap_names(&get("CapBnd:").unwrap_or_default()),
            get("NoNewPrivs:").unwrap_or_default()
        ),
        _ => "unknown (the agent did not start)".into(),
    }
}

/// `2026-11-22T21:17:05.353341895Z` as ns since the epoch.
pub fn parse_rfc3339_ns(s: &str) -> Option<i128> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(str::parse::<i64>);
    let (h, mi, sec) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let frac_ns: i128 = format!("{frac:0<9}")[..9].parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec;
    Some(secs as i128 * 1_000_000_000 + frac_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339() {
        assert_eq!(parse_rfc3339_ns("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ns("2026-11-22T21:17:05.353341895Z"),
            Some(1_795_382_225_353_341_895)
        );
        assert_eq!(
            parse_rfc3339_ns("2000-03-01T00:00:01.5Z"),
            Some(951_868_801_500_000_000)
        );
    }

    #[test]
    fn hook_report_glued_from_kmsg_records() {
        use super::super::qemu::{Exit, Line};
        let texts = [
            "[  139.067069] lastgasp: hooks (node pid namespace ",
            "[  139.067646] 4026531836",
            "[  139.068185] ):",
            "[  139.068424]   ",
            "[  139.068990] sys_enter_reboot",
            "[  139.069237]  ",
            "[  139.070052] tracepoint syscalls/sys_enter_reboot",
            "[  139.070169]  ",
            "[  139.094919] armed",
            "[  139.095267] ",
            "[  OK  ] Started something.",
            "[  139.095459]   ",
            "[  139.096962] kernel_power_off",
            "[  139.097014]  ",
            "[  139.097396] fentry kernel_power_off",
            "[  139.097457]  ",
            "[  139.098074] armed",
            "[  139.098126] ",
            "[  139.161459] 2026-11-22T21:50:14.416838Z  INFO lastgasp: armed armed_ms=\"9337.0\"",
        ];
        let run = Run {
            out: std::path::PathBuf::new(),
            audit_img: std::path::PathBuf::new(),
            console: texts
                .iter()
                .map(|t| Line {
                    t: Duration::ZERO,
                    text: t.to_string(),
                })
                .collect(),
            agent: Vec::new(),
            qmp: Vec::new(),
            exit: Exit::Halted,
            exit_t: Duration::ZERO,
            stderr: String::new(),
            start_wall: std::time::UNIX_EPOCH,
        };
        assert_eq!(
            hook_lines(&run),
            vec![
                "sys_enter_reboot tracepoint syscalls/sys_enter_reboot armed",
                "kernel_power_off fentry kernel_power_off armed"
            ]
        );
    }

    #[test]
    fn caps_decoded() {
        assert_eq!(
            cap_names("000000c000080000"),
            "CAP_SYS_PTRACE CAP_PERFMON CAP_BPF"
        );
    }

    fn golden(name: &str) -> String {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../common/golden");
        fs::read_to_string(dir.join(name)).unwrap()
    }

    /// The harness reads the agent's audit and stdout through the same
    /// types the agent writes them with (`common/golden/`).
    #[test]
    fn the_harness_reads_the_golden_audit_and_stdout() {
        let audit = AuditDisk::parse(&golden("audit-v2.jsonl"));
        assert_eq!(audit.unreadable, 0);
        assert_eq!((audit.records.len(), audit.others.len()), (2, 2));
        let boot = audit.records[0].boot_id.clone();
        let Entry::Signal { signal, decision } = &audit.records[0].entry else {
            panic!("not a detection: {:?}", audit.records[0]);
        };
        let d = Det::from_signal(signal);
        assert_eq!(d.what, "exec `poweroff -ff`");
        assert_eq!((d.source.as_str(), d.effect.as_str()), ("exec", "now"));
        assert_eq!(
            decision
                .as_ref()
                .map(|x| decision_label(&x.action))
                .as_deref(),
            Some("immediate")
        );
        let stdout = golden("stdout-v2.json");
        let run = Run {
            out: "out".into(),
            audit_img: "audit.img".into(),
            console: Vec::new(),
            agent: vec![super::super::qemu::Line {
                t: Duration::from_secs(1),
                text: stdout.clone(),
            }],
            qmp: Vec::new(),
            exit: super::super::qemu::Exit::Halted,
            exit_t: Duration::ZERO,
            stderr: String::new(),
            start_wall: std::time::SystemTime::UNIX_EPOCH,
        };
        let dets = merge(&audit, &boot, &run, None, 0, None);
        assert_eq!(dets.len(), 2, "{dets:?}");
        // The stdout line is the reboot(2) the disk also has.
        assert!(dets[1].on_disk && dets[1].on_stdout, "{dets:?}");
        assert_eq!(
            decisions(&dets, &audit, &boot, 0).as_deref(),
            Some("immediate → last-word → outcome last-gasp-delivered")
        );
        let line: StdoutLine = serde_json::from_str(stdout.trim()).unwrap();
        let d = Det::from_signal(&line.signal);
        assert_eq!(d.what, "reboot(2) POWER_OFF by poweroff");
        assert_eq!(decision_label(&line.decision), "last-word");
    }
}
