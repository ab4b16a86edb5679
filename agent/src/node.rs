//! Facts about the node the agent runs on: its boot, its PID namespace, and
//! the agent's own privileges.
use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

/// The initial PID namespace's inode (the kernel's PROC_PID_INIT_INO).
pub const INIT_PIDNS_INO: u64 = 0xEFFF_FFFC;

pub fn boot_id() -> Result<String> {
    Ok(fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .context("reading /proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string())
}

/// The PID namespace that plays "the node": the kernel classifies every
/// detection as inside it (node scope) or not (container scope).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePidNs {
    pub dev: u64,
    pub ino: u64,
    /// Global pid of the namespace's init (1 for the initial namespace).
    pub init_pid: u32,
}

impl NodePidNs {
    /// The initial PID namespace: the host. nsfs has one device for every
    /// namespace file, so our own ns/pid gives it.
    pub fn initial() -> Result<Self> {
        let meta = fs::metadata("/proc/self/ns/pid").context("stat /proc/self/ns/pid")?;
        Ok(NodePidNs {
            dev: meta.dev(),
            ino: INIT_PIDNS_INO,
            init_pid: 1,
        })
    }

    /// The namespace of an `ns/pid` file such as `/proc/1234/ns/pid`; its init
    /// is found in /proc (the process whose innermost NSpid is 1).
    pub fn from_path(path: &Path) -> Result<Self> {
        let meta = fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
        if meta.ino() == INIT_PIDNS_INO {
            return Ok(NodePidNs {
                dev: meta.dev(),
                ino: meta.ino(),
                init_pid: 1,
            });
        }
        let init_pid = find_ns_init(meta.ino())?.with_context(|| {
            format!(
                "no init process found for the PID namespace {}",
                path.display()
            )
        })?;
        Ok(NodePidNs {
            dev: meta.dev(),
            ino: meta.ino(),
            init_pid,
        })
    }
}

fn find_ns_init(ino: u64) -> Result<Option<u32>> {
    for entry in fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let ns = entry.path().join("ns/pid");
        if fs::metadata(&ns).map(|m| m.ino()).ok() != Some(ino) {
            continue;
        }
        let Ok(status) = fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let innermost = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|l| l.split_whitespace().last());
        if innermost == Some("1") {
            return Ok(Some(pid));
        }
    }
    Ok(None)
}

// Capability numbers (linux/capability.h).
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_SYS_PTRACE: u32 = 19;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

pub fn effective_caps() -> Result<u64> {
    let status = fs::read_to_string("/proc/self/status")?;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .context("no CapEff in /proc/self/status")?;
    Ok(u64::from_str_radix(hex.trim(), 16)?)
}

pub fn has_cap(caps: u64, cap: u32) -> bool {
    caps & (1 << cap) != 0
}

/// Loading tracing programs needs CAP_BPF and CAP_PERFMON (or, on kernels
/// before 5.8, CAP_SYS_ADMIN). Says which are missing.
pub fn require_bpf_caps() -> Result<()> {
    let caps = effective_caps()?;
    if has_cap(caps, CAP_SYS_ADMIN) || (has_cap(caps, CAP_BPF) && has_cap(caps, CAP_PERFMON)) {
        return Ok(());
    }
    let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
        .into_iter()
        .filter(|(c, _)| !has_cap(caps, *c))
        .map(|(_, n)| n)
        .collect();
    bail!(
        "lastgasp needs {} to load its eBPF tracepoints (or CAP_SYS_ADMIN on kernels before 5.8); \
         run it as root or grant the capabilities",
        missing.join(" and ")
    )
}

/// tracefs, where tracepoints are attached; mounted if missing (that needs
/// CAP_SYS_ADMIN; a DaemonSet mounts the host's instead).
pub fn ensure_tracefs() -> Result<PathBuf> {
    for p in ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"] {
        if Path::new(p).join("events").is_dir() {
            return Ok(PathBuf::from(p));
        }
    }
    let target = Path::new("/sys/kernel/tracing");
    nix::mount::mount(Some("tracefs"), target, Some("tracefs"), nix::mount::MsFlags::empty(), None::<&str>)
        .with_context(|| {
            format!(
                "tracefs is not mounted and mounting it at {} failed (needs CAP_SYS_ADMIN, or mount it: \
                 mount -t tracefs tracefs /sys/kernel/tracing)",
                target.display()
            )
        })?;
    tracing::info!(path = %target.display(), "mounted tracefs");
    Ok(target.to_path_buf())
}

/// The kernel's release as (major, minor), from /proc/sys/kernel/osrelease.
pub fn kernel_version() -> Option<(u32, u32)> {
    parse_release(&fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
}

fn parse_release(rel: &str) -> Option<(u32, u32)> {
    let mut parts = rel.trim().split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Kernels before 5.11 charge BPF maps and programs to the loader's
/// RLIMIT_MEMLOCK (later ones to its memory cgroup). There the soft limit
/// is raised to the hard one (no privilege needed); returns the soft limit
/// in bytes when it is still not unlimited, `None` on a kernel that does not
/// charge it or with no limit.
pub fn bpf_memlock_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
    if kernel_version().is_none_or(|v| v >= (5, 11)) {
        return None;
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_MEMLOCK).ok()?;
    if soft < hard {
        let _ = setrlimit(Resource::RLIMIT_MEMLOCK, hard, hard);
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_MEMLOCK).ok()?;
    (soft != RLIM_INFINITY).then_some(soft)
}

/// What to do about [`bpf_memlock_limit`]'s limit.
pub fn memlock_advice(limit: u64) -> String {
    format!(
        "this kernel (< 5.11) charges BPF maps to RLIMIT_MEMLOCK, {} KiB here: start the agent with \
         LimitMEMLOCK=infinity (systemd) or `ulimit -l unlimited` (the container runtime's default for \
         its containers), or grant CAP_SYS_RESOURCE",
        limit / 1024
    )
}

#[cfg(test)]
mod release_tests {
    #[test]
    fn releases_read_as_major_minor() {
        use super::parse_release;
        assert_eq!(parse_release("5.10.0-32-amd64\n"), Some((5, 10)));
        assert_eq!(parse_release("6.12.117+deb13-amd64"), Some((6, 12)));
        assert_eq!(parse_release("6.18.44-fc-v782"), Some((6, 18)));
        assert!((5, 10) < (5, 11) && (6, 1) >= (5, 11));
        assert_eq!(parse_release("garbage"), None);
    }
}
