//! Fills in what the kernel record does not carry: the executable, the cgroup
//! path and the pod/container it maps to, and the parent chain, read with
//! `procfs`. Best-effort: the process may already be gone (that is often the
//! point).
use std::{fs, os::unix::fs::MetadataExt, path::Path};

use procfs::{process::Process, ProcessCGroup};

use crate::signal::{Actor, Parent};

const MAX_PARENTS: usize = 8;

/// `walk_cgroups`: when the process is gone, look its cgroup up by id in
/// /sys/fs/cgroup (slow on a big node: not on the last gasp's path).
pub(crate) fn enrich_with(actor: &mut Actor, walk_cgroups: bool) {
    let proc = Process::new(actor.pid as i32).ok();
    if actor.exe.is_none() {
        actor.exe = proc
            .as_ref()
            .and_then(|p| p.exe().ok())
            .map(|p| p.display().to_string());
    }
    let cgroup = proc
        .as_ref()
        .and_then(|p| p.cgroups().ok())
        .and_then(|c| cgroup_path(&c.0))
        .or_else(|| {
            walk_cgroups
                .then(|| find_cgroup_by_id(Path::new("/sys/fs/cgroup"), actor.cgroup_id, 12))
                .flatten()
        });
    if let Some(path) = cgroup {
        let (pod, container) = pod_and_container(&path);
        actor.pod_uid = pod;
        actor.container_id = container;
        actor.cgroup = Some(path);
    }
    // The kernel's record may already name the parent; go on from there.
    match actor.parents.last().map(|p| p.pid) {
        None => actor.parents = parents(actor.pid),
        Some(1) => {}
        Some(last) => {
            let more = parents(last);
            actor.parents.extend(more);
        }
    }
}

/// The path that names the process's pod, on cgroup v2 (`0::/path`) and v1
/// (one line per hierarchy): the first that runs under the kubelet's
/// `kubepods`, else the unified one, else the first hierarchy's.
fn cgroup_path(lines: &[ProcessCGroup]) -> Option<String> {
    lines
        .iter()
        .find(|l| l.pathname.contains("kubepods"))
        .or_else(|| lines.iter().find(|l| l.hierarchy == 0))
        .or_else(|| lines.first())
        .map(|l| l.pathname.clone())
}

/// /proc/PID/cgroup's text, parsed as procfs does.
#[cfg(test)]
fn parse_cgroups(text: &str) -> Vec<ProcessCGroup> {
    use procfs::FromBufRead;
    procfs::ProcessCGroups::from_buf_read(text.as_bytes())
        .map(|c| c.0)
        .unwrap_or_default()
}

/// cgroup v2 directory inode numbers are cgroup ids.
fn find_cgroup_by_id(root: &Path, id: u64, depth: usize) -> Option<String> {
    fn walk(root: &Path, dir: &Path, id: u64, depth: usize) -> Option<String> {
        if fs::metadata(dir).ok()?.ino() == id {
            let rel = dir.strip_prefix(root).ok()?;
            return Some(format!("/{}", rel.display()));
        }
        if depth == 0 {
            return None;
        }
        for entry in fs::read_dir(dir).ok()?.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if let Some(found) = walk(root, &entry.path(), id, depth - 1) {
                    return Some(found);
                }
            }
        }
        None
    }
    if id == 0 {
        return None;
    }
    walk(root, root, id, depth)
}

/// Pod UID and container id from a kubelet cgroup path, for both cgroup
/// drivers:
/// - systemd: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope`
/// - cgroupfs: `/kubepods/burstable/pod<uid>/<id>`
pub(crate) fn pod_and_container(path: &str) -> (Option<String>, Option<String>) {
    if !path.contains("kubepods") {
        return (None, None);
    }
    let mut pod = None;
    let mut container = None;
    for part in path.split('/') {
        if let Some(rest) = part.strip_suffix(".slice") {
            if let Some(i) = rest.rfind("-pod") {
                pod = Some(rest[i + 4..].replace('_', "-"));
            }
        } else if let Some(uid) = part.strip_prefix("pod") {
            pod = Some(uid.to_string());
        } else if let Some(scope) = part.strip_suffix(".scope") {
            // cri-containerd-<id>, crio-<id>, docker-<id>
            container = scope.rsplit('-').next().map(str::to_string);
        } else if pod.is_some() && part.len() == 64 && part.bytes().all(|b| b.is_ascii_hexdigit()) {
            container = Some(part.to_string());
        }
    }
    (pod, container)
}

fn parents(pid: u32) -> Vec<Parent> {
    let mut out = Vec::new();
    let mut next = ppid_of(pid);
    // One read of each parent's stat: its comm, and its own parent.
    while let Some(ppid) = next.filter(|&p| p != 0 && out.len() < MAX_PARENTS) {
        let stat = Process::new(ppid as i32).and_then(|p| p.stat()).ok();
        next = stat.as_ref().and_then(|s| u32::try_from(s.ppid).ok());
        out.push(Parent {
            pid: ppid,
            comm: stat.map(|s| s.comm).unwrap_or_default(),
        });
        if ppid == 1 {
            break;
        }
    }
    out
}

fn ppid_of(pid: u32) -> Option<u32> {
    let stat = Process::new(pid as i32).ok()?.stat().ok()?;
    u32::try_from(stat.ppid).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemd_driver_paths() {
        let p = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6b0c3f4e_1d2a_4c5b_9e8f_0a1b2c3d4e5f.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope";
        let (pod, c) = pod_and_container(p);
        assert_eq!(pod.as_deref(), Some("6b0c3f4e-1d2a-4c5b-9e8f-0a1b2c3d4e5f"));
        assert_eq!(
            c.as_deref(),
            Some("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
        );
        let (pod, c) =
            pod_and_container("/kubepods.slice/kubepods-podabc_def.slice/crio-ff00.scope");
        assert_eq!(
            (pod.as_deref(), c.as_deref()),
            (Some("abc-def"), Some("ff00"))
        );
    }

    #[test]
    fn cgroupfs_driver_paths() {
        let id = "a".repeat(64);
        let (pod, c) = pod_and_container(&format!("/kubepods/besteffort/pod1111-2222/{id}"));
        assert_eq!(pod.as_deref(), Some("1111-2222"));
        assert_eq!(c.as_deref(), Some(id.as_str()));
    }

    #[test]
    fn non_pod_paths() {
        assert_eq!(pod_and_container("/system.slice/ssh.service"), (None, None));
        assert_eq!(
            pod_and_container("/user.slice/user-0.slice/session-1.scope"),
            (None, None)
        );
    }

    #[test]
    fn own_process_resolves() {
        let mut a = Actor {
            pid: std::process::id(),
            ..Default::default()
        };
        enrich_with(&mut a, true);
        assert!(a.exe.is_some(), "our own exe must be readable");
        assert!(!a.parents.is_empty(), "a test process has a parent");
    }

    #[test]
    fn the_parents_are_the_chain_proc_status_names() {
        // Each PPid read from /proc/PID/status, independently of procfs.
        let ppid = |pid: u32| -> u32 {
            let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            let line = status.lines().find(|l| l.starts_with("PPid:")).unwrap();
            line[5..].trim().parse().unwrap()
        };
        let me = std::process::id();
        let chain = parents(me);
        let mut want = Vec::new();
        let mut cur = me;
        while want.len() < MAX_PARENTS {
            let p = ppid(cur);
            if p == 0 {
                break;
            }
            want.push(p);
            if p == 1 {
                break;
            }
            cur = p;
        }
        let got: Vec<u32> = chain.iter().map(|p| p.pid).collect();
        assert_eq!(got, want);
        assert!(chain.iter().all(|p| !p.comm.is_empty()), "{chain:?}");
    }

    #[test]
    fn the_pod_is_found_on_cgroup_v1_and_v2() {
        let v2 = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod11_22.slice/cri-containerd-abc.scope\n";
        let v1 = "12:pids:/kubepods/burstable/pod3333-4444/ffee\n\
                  11:memory:/kubepods/burstable/pod3333-4444/ffee\n\
                  1:name=systemd:/kubepods/burstable/pod3333-4444/ffee\n\
                  0::/\n";
        let hybrid_host = "12:pids:/system.slice/ssh.service\n0::/system.slice/ssh.service\n";
        let path = |t: &str| cgroup_path(&parse_cgroups(t));
        assert_eq!(
            pod_and_container(&path(v2).unwrap()),
            (Some("11-22".into()), Some("abc".into()))
        );
        assert_eq!(
            path(v1).as_deref(),
            Some("/kubepods/burstable/pod3333-4444/ffee")
        );
        assert_eq!(
            pod_and_container(&path(v1).unwrap()).0.as_deref(),
            Some("3333-4444")
        );
        assert_eq!(
            path(hybrid_host).as_deref(),
            Some("/system.slice/ssh.service")
        );
        assert_eq!(path(""), None);
    }

    #[test]
    fn ppid_with_odd_comm() {
        assert_eq!(
            ppid_of(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
    }
}
