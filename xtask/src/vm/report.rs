//! The matrix: every scenario's outcome and the races, as markdown.
use std::{fmt::Write as _, fs, time::Duration};

use super::{
    image::GuestImage,
    qemu::Accel,
    scenario::{Outcome, Race, Status},
};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn dist(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_by(f64::total_cmp);
    format!(
        "n={} min {:.0} p50 {:.0} p90 {:.0} max {:.0}",
        v.len(),
        v[0],
        percentile(&v, 0.5),
        percentile(&v, 0.9),
        v[v.len() - 1]
    )
}

fn ms(v: Option<f64>) -> String {
    v.map(|m| format!("{m:.0} ms"))
        .unwrap_or_else(|| "-".into())
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

pub fn matrix(
    accel: &Accel,
    img: &GuestImage,
    profile: &str,
    outcomes: &[Outcome],
    races: &[Race],
    total: Duration,
    cluster: bool,
) -> String {
    let mut m = String::new();
    header(&mut m, accel, img, profile, outcomes, races, cluster);
    scenario_rows(&mut m, outcomes);
    let ran: Vec<&Outcome> = outcomes.iter().filter(|o| !o.skipped()).collect();
    if !ran.is_empty() {
        let _ = writeln!(
            m,
            "\nBoot to runner (host s): {}. Wall time per scenario (s): {}.",
            dist(ran.iter().filter_map(|o| o.boot_s).collect()),
            dist(ran.iter().map(|o| o.wall.as_secs_f64()).collect())
        );
    }
    for r in races {
        race(&mut m, accel, r, cluster);
    }
    let _ = writeln!(
        m,
        "\nTotal: {:.1} min{}.",
        total.as_secs_f64() / 60.0,
        img.built_in
            .map(|b| format!(
                ", of which {:.1} min building the guest image",
                b.as_secs_f64() / 60.0
            ))
            .unwrap_or_default()
    );
    m
}

/// The guest, the agent as it ran, its hooks, and how to read the columns.
fn header(
    m: &mut String,
    accel: &Accel,
    img: &GuestImage,
    profile: &str,
    outcomes: &[Outcome],
    races: &[Race],
    cluster: bool,
) {
    let systemd = fs::read_to_string(img.dir.join("packages.lst"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("systemd ")
                .map(std::string::ToString::to_string)
        })
        .unwrap_or_else(|| "?".into());
    let _ = writeln!(m, "### VM end-to-end matrix (`cargo xtask vm-test`)\n");
    let _ = writeln!(
        m,
        "Guest: Debian {} (image {}) with kernel {} and systemd {}, 2 vCPUs, 1 GiB; accelerator: {accel}. \
         Guest-side times are measured under {}: inflated, not comparable with host figures.",
        img.distro.suite(),
        img.key,
        img.kernel_release,
        systemd,
        if accel.is_tcg() { "TCG" } else { "KVM" },
    );
    if let Some(o) = outcomes.iter().find(|o| !o.caps.is_empty()) {
        let _ = writeln!(
            m,
            "\nAgent: `lastgasp run {}{profile} build) as the systemd unit \
             `tests/vm/guest/lastgasp.service`; as it ran: {}.",
            if cluster {
                "--config tests/vm/cluster/lastgasp.yaml` (cluster mode; the API double on the host's \
                 loopback, seeded with `tests/vm/cluster/objects.json`, afresh for every boot; "
            } else {
                "--standalone` ("
            },
            o.caps
        );
    }
    if let Some(o) = outcomes.iter().find(|o| !o.hooks.is_empty()) {
        let _ = writeln!(
            m,
            "Hooks the guest kernel accepted: {}.",
            o.hooks.join("; ")
        );
    }
    if cluster {
        let errs: Vec<f64> = outcomes
            .iter()
            .chain(races.iter().flat_map(|r| r.runs.iter()))
            .filter_map(|o| o.cluster.as_ref()?.clock.as_ref()?.err_ms)
            .collect();
        let _ = writeln!(
            m,
            "\nCluster got: the writes the API double logged after the trigger, in order, ms from the \
             runner's trigger (guest clock, just before it runs the command) to the double receiving the \
             request (host clock); `→ N`: answered N. The clocks are related per boot: the guest's \
             offset from the host is bracketed by 6 probes (a request on an open connection between two \
             guest readings, logged with the host's time) and bounded above by every console marker; \
             the latency's error bar is half the tightest bracket: {} (ms). \
             \"after the boot ended\": what the next boot sent (reboot, kexec); \"after the next \
             boot\": what the guest sent when the harness switched it on again on the same disks, \
             with the same API double (sysrq-poweroff: the kernel powers off before any last gasp \
             can leave).",
            dist(errs)
        );
    }
    let _ = writeln!(
        m,
        "\nDetectors: in kernel order, ms after the trigger (guest clock); [D] = in the audit log on \
         the guest's disk, read after the guest was gone; [S] = only on the agent's stdout as the host \
         received it (the record never reached the disk).\n"
    );
}

/// One row per scenario.
fn scenario_rows(m: &mut String, outcomes: &[Outcome]) {
    let _ = writeln!(
        m,
        "| scenario | trigger | how the agent ran | guest | detectors, in order | first: kind / forced / scope / effect | decision | cluster got | trigger → first record written | trigger → end (host) | audit disk after | next boot | result |"
    );
    let _ = writeln!(m, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    // These scenarios run the agent as the host's service; the DaemonSet's
    // pod is `vm-test --node`'s (its own table).
    let ran_as = "host unit";
    for o in outcomes {
        let result = result_cell(o);
        if let Status::Skipped(_) = o.status {
            let _ = writeln!(
                m,
                "| {} | `{}` | {ran_as} | - | - | - | {} | {} | - | - | - | - | {} |",
                o.name,
                cell(o.trigger),
                o.decision,
                o.cluster_got,
                cell(&result)
            );
            continue;
        }
        let first = o
            .dets
            .first()
            .map(|d| {
                format!(
                    "{} / {} / {} / {}",
                    d.kind,
                    if d.forced { "forced" } else { "not forced" },
                    d.scope,
                    d.effect
                )
            })
            .unwrap_or_else(|| "-".into());
        let dets = if !o.notes.is_empty() {
            o.notes.join("<br>")
        } else if o.dets.is_empty() {
            "none".to_string()
        } else {
            o.dets
                .iter()
                .map(super::evidence::Det::short)
                .collect::<Vec<_>>()
                .join(" → ")
        };
        let _ = writeln!(
            m,
            "| {} | `{}` | {ran_as} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            o.name,
            cell(o.trigger),
            cell(&o.end_seen),
            cell(&dets),
            first,
            o.decision,
            cell(&o.cluster_got),
            ms(o.first_written_ms),
            ms(o.death_ms),
            cell(&o.audit_summary),
            cell(&o.next_boot),
            cell(&result)
        );
    }
}

/// A scenario's result cell: pass (and how), FAIL with its problems, or
/// skipped.
fn result_cell(o: &Outcome) -> String {
    match &o.status {
        Status::Pass => {
            let mut r = match &o.retried {
                Some(why) => format!("pass (on a second boot: {why})"),
                None => "pass".to_string(),
            };
            if let Some(n) = &o.pass_note {
                r.push_str(&format!(": {n}"));
            }
            r
        }
        Status::Fail => format!(
            "**FAIL**: {}{}",
            o.problems.join("; "),
            o.retried
                .as_ref()
                .map(|w| format!(" (on a second boot; the first: {w})"))
                .unwrap_or_default()
        ),
        Status::Skipped(why) => format!("skipped: {why}"),
    }
}

/// A last-gasp race: N fresh boots of one trigger, as distributions.
fn race(m: &mut String, accel: &Accel, r: &Race, cluster: bool) {
    let done: Vec<&Outcome> = r.runs.iter().collect();
    let kind = r.sc.first.and_then(|w| w.kind).unwrap_or("?");
    let delivered = done
        .iter()
        .filter(|o| o.dets.first().is_some_and(|d| d.on_disk))
        .count();
    let reboot_disk = done
        .iter()
        .filter(|o| {
            o.dets
                .iter()
                .any(|d| d.source == "reboot-syscall" && d.kind == kind && d.on_disk)
        })
        .count();
    let reboot_seen = done
        .iter()
        .filter(|o| {
            o.dets
                .iter()
                .any(|d| d.source == "reboot-syscall" && d.kind == kind)
        })
        .count();
    let ended = done
        .iter()
        .filter(|o| o.end_seen == r.sc.end.to_string())
        .count();
    let _ = writeln!(
        m,
        "\n### Last-gasp race: {} × `{}`, each a fresh boot\n",
        r.n, r.sc.trigger
    );
    if cluster {
        race_cluster(m, r, &done);
    }
    let _ = writeln!(
        m,
        "- The exec's audit record on the guest's disk before the guest died: **{delivered}/{}**. \
         The guest {} in {ended}/{}.",
        r.n, r.sc.end, r.n
    );
    let _ = writeln!(
        m,
        "- trigger → record written (guest ms, {}): {}",
        if accel.is_tcg() { "TCG" } else { "KVM" },
        dist(done.iter().filter_map(|o| o.first_written_ms).collect())
    );
    let _ = writeln!(
        m,
        "- trigger → kernel saw the exec (guest ms): {}",
        dist(done.iter().filter_map(|o| o.first_at_ms).collect())
    );
    let _ = writeln!(
        m,
        "- trigger → the kernel's \"reboot: ...\" (host ms): {}",
        dist(done.iter().filter_map(|o| o.death_ms).collect())
    );
    let _ = writeln!(
        m,
        "- the caller's own reboot(2) ({kind}): detected in {reboot_seen}/{}, its record on disk in {reboot_disk}/{}",
        r.n, r.n
    );
    for (i, o) in r.runs.iter().enumerate().filter(|(_, o)| o.failed()) {
        let _ = writeln!(m, "- run {}: FAIL: {}", i + 1, o.problems.join("; "));
    }
}

/// What the API double received in a race, and when, against the guest's end.
fn race_cluster(m: &mut String, r: &Race, done: &[&Outcome]) {
    let gots: Vec<&super::cluster::Got> = done.iter().filter_map(|o| o.cluster.as_ref()).collect();
    let evidence: Vec<f64> = gots.iter().filter_map(|g| g.evidence_ms()).collect();
    let cond: Vec<f64> = gots.iter().filter_map(|g| g.condition_ms()).collect();
    let taint: Vec<f64> = gots.iter().filter_map(|g| g.taint_ms()).collect();
    let errs: Vec<f64> = gots
        .iter()
        .filter_map(|g| g.clock.as_ref()?.err_ms)
        .collect();
    let _ = writeln!(
        m,
        "- **The last gasp's evidence (the record annotation, one Node patch) received by the \
         API double before the guest died: {}/{}** (answered 2xx, before the kernel's last \
         words, \"reboot: Power down\" or \"Restarting system\"); what follows it when time \
         remains: the condition {}/{}, the agent's taint {}/{}.",
        evidence.len(),
        r.n,
        cond.len(),
        r.n,
        taint.len(),
        r.n
    );
    let _ = writeln!(
        m,
        "- trigger → evidence received by the double (ms, guest trigger vs host receipt): {}",
        dist(evidence)
    );
    let _ = writeln!(m, "- trigger → condition received (ms): {}", dist(cond));
    let _ = writeln!(m, "- trigger → taint received (ms): {}", dist(taint));
    let _ = writeln!(
        m,
        "- trigger → the guest's end (the kernel's \"reboot: ...\" received by the host, \
         same clock, ms): {}",
        dist(gots.iter().filter_map(|g| g.end_ms).collect())
    );
    let _ = writeln!(
        m,
        "- margin: the guest's end − evidence received (ms): {}",
        dist(
            gots.iter()
                .filter_map(|g| Some(g.end_ms? - g.evidence_ms()?))
                .collect()
        )
    );
    let _ = writeln!(m, "- clock error bar per run (± ms): {}", dist(errs));
}
