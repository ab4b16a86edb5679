//! What `lastgasp check` reports of the kernel side: tracefs, BTF,
//! kprobes, the privileges, and each hook armed for real (or predicted).
use std::path::Path;

use super::EbpfDetector;
use crate::{
    detect::hooks::{Attach, HookState},
    node::{self, CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE},
    preflight::{Report, Status},
};

fn tracefs() -> Option<&'static str> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .find(|p| Path::new(p).join("events").is_dir())
}

/// Where tracefs is mounted (from /proc/self/mounts), readable or not:
/// tracefs is root-only, so without privileges it cannot be looked into.
fn tracefs_mounted() -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_, at, fstype) = (f.next()?, f.next()?, f.next()?);
        (fstype == "tracefs").then(|| at.to_string())
    })
}

/// The kernel: tracefs and the hooks' tracepoints, BTF, kprobes.
pub(crate) fn kernel(r: &mut Report) {
    version(r);
    let fs = tracepoints(r);
    kprobes(r, fs);
    btf(r);
    match std::fs::read_to_string("/sys/kernel/security/lockdown") {
        Ok(l) => r.push(Status::Info, "lockdown", l.trim().to_string()),
        Err(_) => r.push(
            Status::Info,
            "lockdown",
            "unknown (securityfs not mounted or no lockdown LSM)",
        ),
    }
}

fn version(r: &mut Report) {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    match read("/proc/sys/kernel/osrelease") {
        Ok(rel) => r.push(
            Status::Info,
            "version",
            format!(
                "Linux {rel} {} ({})",
                std::env::consts::ARCH,
                read("/proc/sys/kernel/version").unwrap_or_default()
            ),
        ),
        Err(e) => r.push(
            Status::Warn,
            "version",
            format!("/proc/sys/kernel/osrelease: {e}"),
        ),
    }
}

/// tracefs (mounted if it is not) and each hook's tracepoint in it.
fn tracepoints(r: &mut Report) -> Option<&'static str> {
    let mut fs = tracefs();
    let unreadable = if fs.is_none() {
        tracefs_mounted()
    } else {
        None
    };
    if let Some(at) = &unreadable {
        r.push(
            Status::Warn,
            "tracefs",
            format!("mounted at {at} but not readable here (root only): the tracepoints cannot be looked up"),
        );
    } else if fs.is_none() {
        match node::ensure_tracefs() {
            Ok(_) => {
                fs = tracefs();
                r.push(
                    Status::Ok,
                    "tracefs",
                    "was not mounted: mounted it at /sys/kernel/tracing, as `lastgasp run` does",
                );
            }
            Err(e) => r.push(Status::Fail, "tracefs", format!("{e:#}")),
        }
    } else {
        r.push(Status::Ok, "tracefs", fs.unwrap_or_default());
    }
    if let Some(fs) = fs {
        for (_, cat, name, required) in Attach::tracepoints() {
            let dir = Path::new(fs).join("events").join(cat).join(name);
            let what = format!("tracepoint {cat}/{name}");
            if dir.is_dir() {
                r.push(Status::Ok, what, "present");
            } else if required {
                r.push(
                    Status::Fail,
                    what,
                    format!("missing ({}): lastgasp cannot see reboot(2)", dir.display()),
                );
            } else {
                r.push(Status::Warn, what, format!("missing ({})", dir.display()));
            }
        }
    }
    fs
}

fn kprobes(r: &mut Report, fs: Option<&str>) {
    // aya attaches kprobes through the perf `kprobe` PMU.
    let pmu = Path::new("/sys/bus/event_source/devices/kprobe");
    let events = fs.map(|f| Path::new(f).join("kprobe_events"));
    if pmu.is_dir() {
        r.push(
            Status::Ok,
            "kprobes",
            format!("supported ({} present)", pmu.display()),
        );
    } else {
        r.push(
            Status::Warn,
            "kprobes",
            format!(
                "not supported: no {}{} (CONFIG_KPROBES off?); the kernel power-off hooks need fentry",
                pmu.display(),
                match &events {
                    Some(e) if !e.exists() => format!(", no {}", e.display()),
                    _ => String::new(),
                }
            ),
        );
    }
}

/// BTF, and the task offsets the exec hook reads through it.
fn btf(r: &mut Report) {
    let btf = Path::new("/sys/kernel/btf/vmlinux");
    match std::fs::metadata(btf) {
        Ok(m) => r.push(
            Status::Ok,
            "BTF",
            format!("{} ({} KiB)", btf.display(), m.len() / 1024),
        ),
        Err(e) => r.push(
            Status::Warn,
            "BTF",
            format!(
                "{}: {e}: no fentry, no argv at exec, no parents in the kernel",
                btf.display()
            ),
        ),
    }
    match crate::detect::ebpf::TaskOffsets::from_btf(&btf.to_string_lossy()) {
        Ok(o) => r.push(
            Status::Ok,
            "task offsets",
            format!(
                "task_struct.mm +{}, .real_parent +{}, .tgid +{}, .comm +{}; mm_struct.arg_start +{}, .arg_end +{}",
                o.task_mm, o.task_real_parent, o.task_tgid, o.task_comm, o.mm_arg_start, o.mm_arg_end
            ),
        ),
        Err(e) => r.push(
            Status::Warn,
            "task offsets",
            format!("not resolved ({e:#}): exec signals without argv, actors without parent"),
        ),
    }
}

/// The hooks, loaded for real and dropped again (or predicted, `no_load`).
pub(crate) fn hooks(r: &mut Report, no_load: bool, caps: Option<u64>) {
    let permitted = caps.is_some_and(|c| {
        node::has_cap(c, CAP_SYS_ADMIN)
            || (node::has_cap(c, CAP_BPF) && node::has_cap(c, CAP_PERFMON))
    });
    if no_load || !permitted {
        let why = if no_load {
            "--no-load"
        } else {
            "no CAP_BPF+CAP_PERFMON to load them"
        };
        predicted_hooks(r, why);
        return;
    }
    let node = match node::NodePidNs::initial() {
        Ok(n) => n,
        Err(e) => {
            r.push(Status::Fail, "loaded", format!("{e:#}"));
            return;
        }
    };
    let started = std::time::Instant::now();
    match EbpfDetector::load(node) {
        Ok(det) => {
            loaded_hooks(r, &det, started);
            // Dropping the detector detaches and unloads everything.
            drop(det);
        }
        Err(e) => r.push(
            Status::Fail,
            "loaded",
            format!("the real loader failed: {e:#}"),
        ),
    }
}

/// Without loading: what tracefs, the kprobe PMU and BTF predict.
fn predicted_hooks(r: &mut Report, why: &str) {
    r.push(
        Status::Warn,
        "loaded",
        format!("not loaded ({why}): predicted from tracefs, the kprobe PMU and BTF"),
    );
    let fs = tracefs();
    for (_, cat, name, required) in Attach::tracepoints() {
        if fs.is_none() && tracefs_mounted().is_some() {
            r.push(
                Status::Info,
                name,
                format!("tracepoint {cat}/{name}: cannot tell (tracefs not readable here)"),
            );
            continue;
        }
        let present = fs.is_some_and(|f| Path::new(f).join("events").join(cat).join(name).is_dir());
        let status = match (present, required) {
            (true, _) => Status::Ok,
            (false, true) => Status::Fail,
            (false, false) => Status::Warn,
        };
        r.push(
            status,
            name,
            format!(
                "tracepoint {cat}/{name}: {}",
                if present {
                    "should arm"
                } else {
                    "will not arm"
                }
            ),
        );
    }
    let kprobes = Path::new("/sys/bus/event_source/devices/kprobe").is_dir();
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    r.push(
        if kprobes || btf {
            Status::Info
        } else {
            Status::Warn
        },
        "kernel hooks",
        format!(
            "fentry {} (BTF {}; lockdown can still refuse it), kprobe {}",
            if btf { "possible" } else { "impossible" },
            if btf { "present" } else { "missing" },
            if kprobes {
                "possible"
            } else {
                "impossible (no kprobe PMU)"
            }
        ),
    );
}

/// What the real loader armed, each hook and attach method.
fn loaded_hooks(r: &mut Report, det: &EbpfDetector, started: std::time::Instant) {
    let ms = started.elapsed().as_secs_f64() * 1e3;
    r.push(
        Status::Ok,
        "loaded",
        format!("the real loader armed and dropped the programs in {ms:.0} ms"),
    );
    for h in &det.report {
        let required = Attach::tracepoints().any(|(prog, _, _, req)| prog == h.hook && req);
        let (status, state) = match &h.state {
            HookState::Armed => (Status::Ok, "armed".to_string()),
            HookState::Degraded(why) => (Status::Warn, format!("armed, degraded: {why}")),
            HookState::Unavailable(why) if required => (Status::Fail, format!("refused: {why}")),
            HookState::Unavailable(why) => (Status::Warn, format!("refused: {why}")),
        };
        r.push(status, h.hook.clone(), format!("{}: {state}", h.attach));
    }
    let fentry = det
        .report
        .iter()
        .any(|h| h.attach.starts_with("fentry ") && h.state == HookState::Armed);
    let kprobe = det
        .report
        .iter()
        .any(|h| h.attach.starts_with("kprobe ") && h.state == HookState::Armed);
    // Why each attach method was refused, as the loader said (the
    // first kernel hook's reason: they share their cause).
    let refused = det.report.iter().find_map(|h| match &h.state {
        HookState::Unavailable(why) if h.attach.starts_with("fentry|kprobe") => Some(why.clone()),
        _ => None,
    });
    let part = |method: &str| -> Option<String> {
        let why = refused.as_deref()?;
        why.split("; ")
            .find_map(|p| p.strip_prefix(&format!("{method}: ")).map(String::from))
    };
    for (method, works) in [("fentry", fentry), ("kprobe", kprobe)] {
        match (works, part(method)) {
            (true, _) => r.push(Status::Ok, method, "the kernel accepted it"),
            (false, Some(why)) => r.push(Status::Warn, method, format!("refused: {why}")),
            (false, None) => r.push(
                Status::Info,
                method,
                "not needed (the other method armed the kernel hooks)",
            ),
        }
    }
    r.push(
        if fentry || kprobe { Status::Ok } else { Status::Warn },
        "kernel hooks",
        match (fentry, kprobe) {
            (true, _) => "fentry works: the kernel's own power-off paths are seen".to_string(),
            (false, true) => "kprobes work (fentry refused): the kernel's own power-off paths are seen".into(),
            (false, false) => "neither fentry nor kprobes: only the tracepoints (reboot(2), exec, signals to PID 1) see a shutdown".into(),
        },
    );
}

const CAPS: &[(u32, &str)] = &[
    (CAP_BPF, "CAP_BPF"),
    (CAP_PERFMON, "CAP_PERFMON"),
    (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"),
];

/// The capabilities loading and attaching need.
pub(crate) fn privileges(r: &mut Report, caps: Option<u64>, paranoid: Option<i32>) {
    if let Some(limit) = node::bpf_memlock_limit() {
        r.push(Status::Warn, "RLIMIT_MEMLOCK", node::memlock_advice(limit));
    }
    let Some(caps) = caps else {
        r.push(
            Status::Fail,
            "CapEff",
            "cannot read CapEff from /proc/self/status",
        );
        return;
    };
    let held: Vec<&str> = CAPS
        .iter()
        .filter(|(c, _)| node::has_cap(caps, *c))
        .map(|(_, n)| *n)
        .collect();
    r.push(
        Status::Info,
        "CapEff",
        format!(
            "{caps:016x} (of those needed: {})",
            if held.is_empty() {
                "none".into()
            } else {
                held.join(", ")
            }
        ),
    );
    perf_paranoid(r, paranoid);
    needed_caps(r, caps, paranoid);
}

fn perf_paranoid(r: &mut Report, paranoid: Option<i32>) {
    match paranoid {
        Some(p) => r.push(
            Status::Info,
            "perf_paranoid",
            format!(
                "kernel.perf_event_paranoid = {p}{}",
                if p >= 3 {
                    ": attaching tracepoints needs CAP_SYS_ADMIN"
                } else {
                    ""
                }
            ),
        ),
        None => r.push(
            Status::Warn,
            "perf_paranoid",
            "cannot read /proc/sys/kernel/perf_event_paranoid",
        ),
    }
}

/// Each capability loading and attaching needs: held, stood in for, or
/// missing.
fn needed_caps(r: &mut Report, caps: u64, paranoid: Option<i32>) {
    let has = |c| node::has_cap(caps, c);
    let admin = has(CAP_SYS_ADMIN);
    for (cap, name, why) in [
        (CAP_BPF, "CAP_BPF", "loading the eBPF programs and maps"),
        (CAP_PERFMON, "CAP_PERFMON", "attaching tracing programs"),
    ] {
        if has(cap) {
            r.push(Status::Ok, name, format!("held: {why}"));
        } else if admin {
            r.push(
                Status::Warn,
                name,
                format!("missing, CAP_SYS_ADMIN stands in (kernels before 5.8): {why}"),
            );
        } else {
            r.push(Status::Fail, name, format!("missing: needed for {why}"));
        }
    }
    let need_admin = paranoid.is_some_and(|p| p >= 3);
    match (admin, need_admin) {
        (true, _) => r.push(Status::Ok, "CAP_SYS_ADMIN", "held: tracepoint attach where perf_event_paranoid >= 3, mounting tracefs"),
        (false, true) => r.push(
            Status::Fail,
            "CAP_SYS_ADMIN",
            "missing, and perf_event_paranoid >= 3: the kernel refuses the tracepoint attach (EACCES) without it",
        ),
        (false, false) => r.push(
            Status::Warn,
            "CAP_SYS_ADMIN",
            "missing: fine with perf_event_paranoid <= 2, but tracefs must then be mounted already",
        ),
    }
    if has(CAP_SYS_PTRACE) {
        r.push(
            Status::Ok,
            "CAP_SYS_PTRACE",
            "held: the exe of other users' processes",
        );
    } else {
        r.push(
            Status::Warn,
            "CAP_SYS_PTRACE",
            "missing: actors of other users are reported without exe",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hook_tracepoint_is_predicted_when_not_loading() {
        let mut r = Report::default();
        hooks(&mut r, true, None);
        assert_eq!(r.line("loaded").unwrap().status, Status::Warn, "{r}");
        for (_, cat, name, _) in Attach::tracepoints() {
            let l = r
                .line(name)
                .unwrap_or_else(|| panic!("{name} missing:\n{r}"));
            assert!(
                l.text.starts_with(&format!("tracepoint {cat}/{name}")),
                "{}",
                l.text
            );
        }
        assert!(r.line("kernel hooks").is_some(), "{r}");
    }

    #[test]
    fn without_bpf_capabilities_nothing_is_loaded() {
        let mut r = Report::default();
        hooks(&mut r, false, Some(0));
        let l = r.line("loaded").unwrap();
        assert!(l.text.contains("no CAP_BPF+CAP_PERFMON"), "{}", l.text);
    }
}
