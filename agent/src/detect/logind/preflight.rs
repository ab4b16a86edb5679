//! What `lastgasp check` reports of logind: the delay limit and who sets it,
//! the kubelet's own lock, and whether a lock can be taken.
use std::{path::Path, time::Duration};

use super::config::{self, Setting, DROPIN_NAME};
use crate::{
    bus::{
        self, delay_lock,
        logind::{Host, Inhibitor},
    },
    preflight::{Report, Status},
    timespan::secs,
};

/// logind's limit against what lastgasp needs (`want`), the drop-ins in
/// logind's read order, the locks held now, and a lock taken and closed.
pub(crate) async fn preflight(r: &mut Report, host: &Host, root: &Path, want: Option<Duration>) {
    let ours = config::dropin_path(root);
    let settings = config::inhibit_delay_settings(root);
    match host.current_inhibit_delay().await {
        Ok(have) => delay_check(r, have, want, &settings, &ours),
        Err(e) => r.push(
            Status::Fail,
            "inhibit delay",
            format!("reading InhibitDelayMaxUSec: {e}"),
        ),
    }
    r.push(Status::Info, "drop-ins", read_order(root, &settings));
    // Listed before the check takes (and closes) a lock of its own.
    if let Ok(list) = host.logind.list_inhibitors().await {
        held_locks(r, &list);
    }
    match delay_lock::take_lock(host).await {
        Ok(fd) => {
            drop(fd);
            r.push(
                Status::Ok,
                "delay lock",
                "Inhibit(shutdown, delay) gave a lock fd; closed again",
            );
        }
        Err(e) => r.push(
            Status::Fail,
            "delay lock",
            format!("logind refused Inhibit(shutdown, delay): {e}"),
        ),
    }
    if let Ok(true) = host.logind.preparing_for_shutdown().await {
        r.push(
            Status::Warn,
            "shutdown",
            "logind is preparing a shutdown right now",
        );
    }
    if let Ok((t, usec)) = host.logind.scheduled_shutdown().await {
        if !t.is_empty() && usec > 0 {
            let at = humantime::format_rfc3339_seconds(bus::wall_usec(usec));
            r.push(
                Status::Warn,
                "shutdown",
                format!("a {t} is scheduled for {at}"),
            );
        }
    }
}

/// The drop-ins that set InhibitDelayMaxSec, in logind's read order.
fn read_order(root: &Path, settings: &[Setting]) -> String {
    if settings.is_empty() {
        return format!(
            "no file under {} sets InhibitDelayMaxSec (logind's default: 5s)",
            root.display()
        );
    }
    let n = settings.len();
    settings
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let win = if i + 1 == n { " (wins)" } else { "" };
            format!("{}: {}{win}", s.file.display(), s.value)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The shutdown delay locks held now; the kubelet's fails the check: two
/// drains would race for the same pods.
fn held_locks(r: &mut Report, list: &[crate::bus::logind::InhibitorEntry]) {
    let shutdown_delay =
        |what: &str, mode: &str| mode == "delay" && what.split(':').any(|w| w == "shutdown");
    for (what, who, why, mode, _, pid) in list {
        if shutdown_delay(what, mode)
            && (who.to_lowercase().contains("kubelet") || why.to_lowercase().contains("kubelet"))
        {
            r.push(
                Status::Fail,
                "kubelet lock",
                format!(
                    "the kubelet (pid {pid}) holds a shutdown delay lock: its graceful node shutdown is on; \
                     set shutdownGracePeriod and shutdownGracePeriodCriticalPods to 0 in its KubeletConfiguration and restart it"
                ),
            );
        }
    }
    let held: Vec<String> = list
        .iter()
        .filter(|(what, _, _, mode, _, _)| shutdown_delay(what, mode))
        .map(|(_, who, _, _, _, pid)| format!("{who} (pid {pid})"))
        .collect();
    if !held.is_empty() {
        r.push(
            Status::Info,
            "held locks",
            format!("shutdown delay locks held now: {}", held.join(", ")),
        );
    }
}

/// Whether logind allows the delay, or will once `run` writes its drop-in.
fn delay_check(
    r: &mut Report,
    have: Duration,
    want: Option<Duration>,
    settings: &[Setting],
    ours: &Path,
) {
    let Some(want) = want else {
        r.push(
            Status::Info,
            "inhibit delay",
            format!(
                "logind allows {} (InhibitDelayMaxUSec); nothing requested (--inhibit-delay)",
                secs(have)
            ),
        );
        return;
    };
    if have >= want {
        r.push(
            Status::Ok,
            "inhibit delay",
            format!(
                "logind allows {}, lastgasp needs {}",
                secs(have),
                secs(want)
            ),
        );
        return;
    }
    // Drop-ins are read by file name: one named after ours overrides it.
    let after_ours = settings.iter().rfind(|s| {
        s.file
            .parent()
            .and_then(|d| d.file_name())
            .is_some_and(|d| d == "logind.conf.d")
            && s.file
                .file_name()
                .is_some_and(|n| n.to_string_lossy().as_ref() > DROPIN_NAME)
    });
    match after_ours {
        Some(s) if s.delay.is_none_or(|d| d < want) => r.push(
            Status::Fail,
            "inhibit delay",
            format!(
                "logind allows {}, lastgasp needs {}: {} sets InhibitDelayMaxSec={} and is read after {}, so it wins; raise it there or remove it",
                secs(have),
                secs(want),
                s.file.display(),
                s.value,
                ours.display()
            ),
        ),
        _ => {
            let dir = ours.parent().expect("drop-in dir");
            let writable = nix::unistd::access(
                dir.ancestors().find(|d| d.exists()).unwrap_or(dir),
                nix::unistd::AccessFlags::W_OK,
            )
            .is_ok();
            if writable {
                r.push(
                    Status::Warn,
                    "inhibit delay",
                    format!(
                        "logind allows {}, lastgasp needs {}: `lastgasp run` will write {} and reload logind",
                        secs(have),
                        secs(want),
                        ours.display()
                    ),
                );
            } else {
                r.push(
                    Status::Fail,
                    "inhibit delay",
                    format!(
                        "logind allows {}, lastgasp needs {}, and {} is not writable",
                        secs(have),
                        secs(want),
                        dir.display()
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn setting(file: &str, secs: u64) -> Setting {
        Setting {
            file: PathBuf::from(file),
            value: secs.to_string(),
            delay: Some(Duration::from_secs(secs)),
        }
    }

    fn one(have: u64, want: Option<u64>, settings: &[Setting]) -> (Status, String) {
        let mut r = Report::default();
        // Under a writable directory: `run` could write the drop-in there.
        let ours = std::env::temp_dir()
            .join("lastgasp-preflight/etc/systemd/logind.conf.d/99-lastgasp.conf");
        delay_check(
            &mut r,
            Duration::from_secs(have),
            want.map(Duration::from_secs),
            settings,
            &ours,
        );
        let l = r.line("inhibit delay").expect("one line").clone();
        (l.status, l.text)
    }

    #[test]
    fn the_delay_is_judged_against_who_wins() {
        assert_eq!(one(30, None, &[]).0, Status::Info);
        assert_eq!(one(30, Some(30), &[]).0, Status::Ok);
        // A drop-in read after ours, too low: it wins, and is named.
        let (s, text) = one(
            5,
            Some(30),
            &[setting("/etc/systemd/logind.conf.d/zz-kubelet.conf", 20)],
        );
        assert_eq!(s, Status::Fail);
        assert!(
            text.contains("zz-kubelet.conf") && text.contains("wins"),
            "{text}"
        );
        // Read before ours: ours will win once `run` writes it.
        let (s, text) = one(
            5,
            Some(30),
            &[setting("/etc/systemd/logind.conf.d/10-kubelet.conf", 20)],
        );
        assert_eq!(s, Status::Warn);
        assert!(text.contains("will write"), "{text}");
    }
}
