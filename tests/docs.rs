//! The docs tell the truth: every `lastgasp_*` metric that README.md and
//! docs/*.md name exists in what the agent and the controller serve.
use std::collections::BTreeSet;

use lastgasp::{
    act::metrics::{ControllerMetrics, Metrics},
    detect::ebpf::Drops,
};

/// The metric names a text mentions (`lastgasp_` then [a-z0-9_]).
fn named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("lastgasp_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].trim_end_matches('_').to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn every_metric_the_docs_name_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            files.push(e.path());
        }
    }
    // Every family as served: labelled families appear once they have a
    // sample, so give each one.
    let m = Metrics::default();
    let s = lastgasp_tests::support::forced_exec();
    m.count_detection(&s);
    m.count_decision(&lastgasp::decide::Decider::new().decide(&s));
    m.set_hook(
        "sys_enter_reboot",
        "tracepoint syscalls/sys_enter_reboot",
        true,
    );
    m.set_boot("b");
    m.count_boot_end(lastgasp::report::BootEnd::Forced.as_str());
    m.set_ringbuf_drops(&Drops::default().by_label());
    let c = ControllerMetrics::default();
    c.count_action("taint-added");
    let served = format!("{}\n{}", m.encode(), c.encode());
    let families: BTreeSet<String> = served
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    // A counter family `x` is served as `x_total`; a histogram as `x_bucket`,
    // `x_sum`, `x_count`.
    let exists = |name: &str| {
        families.contains(name)
            || ["_total", "_bucket", "_sum", "_count"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|base| families.contains(base))
            })
    };
    let mut missing = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for n in named(&text) {
            // Names of files, crates and binaries are not metrics.
            if ["lastgasp_tests", "lastgasp_apidouble", "lastgasp_common"].contains(&n.as_str()) {
                continue;
            }
            if !exists(&n) {
                missing.push(format!("{}: {n}", f.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "metrics the docs name but nothing serves:\n{}\nserved families: {families:?}",
        missing.join("\n")
    );
}

#[test]
fn names_are_read_whole() {
    assert_eq!(
        named("see `lastgasp_ringbuf_drops_total{scope=\"node\"}` and lastgasp_hook_armed."),
        BTreeSet::from([
            "lastgasp_ringbuf_drops_total".into(),
            "lastgasp_hook_armed".into()
        ])
    );
}
