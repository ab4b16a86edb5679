//! Reading what a guest left behind: the runner's timeline, the audit log,
//! the detections and decisions, the hooks armed and the capabilities held.
//!
//! The audit log is read from the guest's audit disk (a raw ext4 image) on
//! the host after qemu is gone: its journal is replayed first on a copy
//! (`e2fsck -E journal_only`), as the next boot's mount would do, then the
//! file is read with `debugfs`. Nothing is mounted on the host.
use std::{fs, path::Path, process::Command, time::Duration};

use anyhow::{bail, Context, Result};
use serde_json::Value;

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
    /// Detections (`type: signal`, or the older records without a type).
    pub records: Vec<Value>,
    /// Everything else the agent wrote (`agent-start`, `outcome`...).
    pub others: Vec<Value>,
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
    let mut records = Vec::new();
    let mut others = Vec::new();
    let mut unreadable = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v.get("signal").is_some() => records.push(v),
            Ok(v) if v.get("type").is_some() => others.push(v),
            _ => unreadable += 1,
        }
    }
    fs::write(img.with_extension("audit.jsonl"), &text)?;
    // In the order written, across the two logs.
    let written = |v: &Value| {
        v.get("written_at")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    records.sort_by_key(written);
    others.sort_by_key(written);
    Ok(AuditDisk {
        records,
        others,
        unreadable,
        needed_recovery,
    })
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
fn argv_text(detail: &Value) -> String {
    let argv: Vec<&str> = detail
        .get("argv")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
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
    fn from_signal(s: &Value) -> Option<Det> {
        let str_of = |k: &str| s.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
        let actor = s.get("actor");
        let comm = actor
            .and_then(|a| a.get("comm"))
            .and_then(|c| c.as_str())
            .unwrap_or("")
            .to_string();
        let pid = actor
            .and_then(|a| a.get("pid"))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        let detail = s.get("detail").cloned().unwrap_or_default();
        let source = str_of("source");
        let what = match source.as_str() {
            "exec" => format!("exec `{}`", argv_text(&detail)),
            "reboot-syscall" => {
                let cmd = detail
                    .get("cmd")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0);
                format!("reboot(2) {} by {comm}", reboot_cmd(cmd))
            }
            "signal-pid1" => format!(
                "{} to PID 1 by {comm}",
                detail.get("name").and_then(|n| n.as_str()).unwrap_or("?")
            ),
            "kernel-hook" => format!(
                "{} ({})",
                detail
                    .get("function")
                    .and_then(|n| n.as_str())
                    .unwrap_or("?"),
                detail.get("via").and_then(|n| n.as_str()).unwrap_or("?")
            ),
            _ if detail.get("hook").and_then(|h| h.as_str()) == Some("dbus") => format!(
                "{source} {}{}",
                detail.get("member").and_then(|m| m.as_str()).unwrap_or("?"),
                detail
                    .get("unit")
                    .and_then(|u| u.as_str())
                    .map(|u| format!(" {u}"))
                    .unwrap_or_default()
            ),
            other => format!("{other} {comm}"),
        };
        Some(Det {
            kind: str_of("kind"),
            forced: s
                .get("forced")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            scope: str_of("scope"),
            effect: str_of("effect"),
            comm,
            pid,
            what,
            boot_ns: s.get("boot_ns")?.as_u64()?,
            at_ns: s
                .get("at")
                .and_then(|a| a.as_str())
                .and_then(parse_rfc3339_ns),
            written_ns: None,
            on_disk: false,
            on_stdout: false,
            stdout_t: None,
            at_ms: None,
            written_ms: None,
            decision: None,
            source,
        })
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

/// `{"action":{"action":"graceful","protected":true,..},"episode":{..}}` as
/// "graceful (protected)".
fn decision_label(d: &Value) -> String {
    // The audit nests the action ({"action":{..},"episode":{..}}); stdout
    // carries the action itself ({"action":"graceful",..}).
    let a = match d.get("action") {
        Some(Value::Object(_)) => d.get("action").cloned().unwrap_or_default(),
        _ => d.clone(),
    };
    let name = a
        .get("action")
        .and_then(|x| x.as_str())
        .unwrap_or("?")
        .to_string();
    let mut extra = Vec::new();
    if a.get("protected").and_then(serde_json::Value::as_bool) == Some(true) {
        extra.push("protected".to_string());
    }
    if a.get("escalated").and_then(serde_json::Value::as_bool) == Some(true) {
        extra.push("escalated".to_string());
    }
    if let Some(why) = a.get("why").and_then(|x| x.as_str()) {
        extra.push(why.to_string());
    }
    if extra.is_empty() {
        name
    } else {
        format!("{name} ({})", extra.join(", "))
    }
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
        let in_window = o.get("boot_id").and_then(|b| b.as_str()) == Some(boot1)
            && o.get("written_at")
                .and_then(|w| w.as_str())
                .and_then(parse_rfc3339_ns)
                .is_some_and(|w| w >= trig_ns);
        if in_window && o.get("type").and_then(|t| t.as_str()) == Some("outcome") {
            let oc = o.get("outcome").cloned().unwrap_or_default();
            out.push(format!(
                "outcome {}",
                oc.get("outcome").and_then(|x| x.as_str()).unwrap_or("?")
            ));
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
    for r in &audit.records {
        if r.get("boot_id").and_then(|b| b.as_str()) != Some(boot1) {
            continue;
        }
        if let Some(mut d) = r.get("signal").and_then(Det::from_signal) {
            d.on_disk = true;
            d.decision = r.get("decision").map(decision_label);
            d.written_ns = r
                .get("written_at")
                .and_then(|w| w.as_str())
                .and_then(parse_rfc3339_ns);
            dets.push(d);
        }
    }
    for line in &run.agent {
        if boot2_t.is_some_and(|b| line.t >= b) {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(line.text.trim()) else {
            continue;
        };
        let Some(d) = Det::from_signal(&v) else {
            continue;
        };
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
                decision: v.get("decision").map(decision_label),
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
    let recs: Vec<Value> = text
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
        .filter(|r| r.get("boot_id").and_then(|b| b.as_str()) == Some(boot1))
        .filter(|r| r.get("signal").is_some())
        .count();
    let on_disk = dets.iter().filter(|d| d.on_disk).count();
    let last = recs
        .iter()
        .rev()
        .find_map(|r| r.get("signal"))
        .and_then(Det::from_signal)
        .map(|d| d.what)
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
}
