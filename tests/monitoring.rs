//! Monitoring: the alerts pass `promtool test rules`; they name only metrics
//! the agent and the controller export; each has a runbook in docs/runbooks.md; the chart and the kustomize component ship the same
//! rules and dashboard.
//!
//! promtool comes from Debian's `prometheus` package (`cargo xtask test`
//! installs it and passes LASTGASP_PROMTOOL); without it the promtool test
//! prints SKIPPED.
use std::{collections::BTreeSet, path::PathBuf, process::Command};

use lastgasp::{
    act::metrics::Metrics,
    controller::ControllerMetrics,
    decide::{Action, Decision},
    signal::{Kind, ShutdownSignal, Source},
};
use lastgasp_tests::render::{chart_dir, helm, kustomize, render_helm, render_kustomize_dir, repo};
use serde_json::Value;

fn rules_file() -> PathBuf {
    chart_dir().join("files/prometheus-rules.yaml")
}

fn rules() -> Value {
    serde_norway::from_str(&std::fs::read_to_string(rules_file()).unwrap()).unwrap()
}

/// Every alerting rule of `rules`: (alert, expr, annotations).
fn alerts(rules: &Value) -> Vec<(String, String, Value)> {
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .map(|r| {
            (
                r["alert"]
                    .as_str()
                    .expect("alerting rules only")
                    .to_string(),
                r["expr"].as_str().unwrap().to_string(),
                r["annotations"].clone(),
            )
        })
        .collect()
}

/// What `/metrics` of the agent and of the controller show once every
/// family has a sample (an empty family is not encoded at all).
fn exported() -> String {
    let m = Metrics::default();
    let s = ShutdownSignal::of(Source::Exec, Kind::Poweroff);
    m.count_detection(&s);
    m.count_decision(&Decision {
        action: Action::Join,
        episode: None,
    });
    m.set_ringbuf_drops(&[("node", "full", 1)]);
    m.count_boot_end("graceful");
    m.set_hook("exec", "tracepoint", true);
    m.set_boot("b");
    m.set_last_word("courier", true);
    m.set_hook_errors([("exec", 1)]);
    let c = ControllerMetrics::default();
    c.count_action("taint-added");
    c.count_ledger_write("applied", 1);
    c.count_error(lastgasp::controller::Stage::action);
    c.set_ledger_entries(std::iter::once(
        lastgasp::controller::metrics::EntryLabels {
            kind: "poweroff".into(),
            path: "immediate".into(),
            ending: "fenced".into(),
            graceful: "false".into(),
        },
    ));
    format!("{}{}", m.encode(), c.encode())
}

fn promtool() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LASTGASP_PROMTOOL") {
        return Some(p.into());
    }
    let p = PathBuf::from("/usr/bin/promtool");
    p.is_file().then_some(p)
}

#[test]
fn promtool_checks_and_unit_tests_the_alerts() {
    let Some(promtool) = promtool() else {
        println!(
            "SKIPPED promtool_checks_and_unit_tests_the_alerts: no promtool (Debian's prometheus package; `cargo xtask test` installs it)"
        );
        return;
    };
    for args in [
        vec!["check".into(), "rules".into(), rules_file()],
        vec![
            "test".into(),
            "rules".into(),
            repo().join("deploy/monitoring/rules-test.yaml"),
        ],
    ] {
        let out = Command::new(&promtool).args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Every alert is exercised by the unit tests (firing at least once).
    let tests = std::fs::read_to_string(repo().join("deploy/monitoring/rules-test.yaml")).unwrap();
    for (alert, _, _) in alerts(&rules()) {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - exp_labels"
            )),
            "{alert} never fires in deploy/monitoring/rules-test.yaml"
        );
    }
}

#[test]
fn the_alerts_name_only_exported_metrics() {
    let exported = exported();
    let mut seen = BTreeSet::new();
    for (alert, expr, _) in alerts(&rules()) {
        for (i, _) in expr.match_indices("lastgasp_") {
            let name: String = expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // Counters' families are named without `_total` until a label set exists.
            let family = name.strip_suffix("_total").unwrap_or(&name);
            assert!(
                exported.contains(&format!("# TYPE {family} ")),
                "{alert} uses {name}, which neither the agent nor the controller exports"
            );
            seen.insert(family.to_string());
        }
    }
    assert!(seen.contains("lastgasp_graceful_path_armed"), "{seen:?}");
}

/// docs/runbooks.md's heading anchors, as GitHub makes them (lowercase, spaces to
/// dashes, punctuation dropped).
fn runbook_anchors() -> BTreeSet<String> {
    std::fs::read_to_string(repo().join("docs/runbooks.md"))
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| {
            h.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[test]
fn every_alert_has_a_runbook() {
    let anchors = runbook_anchors();
    for (alert, _, ann) in alerts(&rules()) {
        let runbook = ann["runbook_url"].as_str().unwrap_or_default();
        let anchor = runbook
            .strip_prefix("docs/runbooks.md#")
            .unwrap_or_else(|| panic!("{alert}: runbook {runbook:?} is not in docs/runbooks.md"));
        assert_eq!(
            anchor,
            alert.to_lowercase(),
            "{alert}: one section per alert"
        );
        assert!(
            anchors.contains(anchor),
            "{alert}: no heading `{alert}` in docs/runbooks.md"
        );
        for key in ["summary", "description"] {
            assert!(
                ann[key].as_str().is_some_and(|s| !s.is_empty()),
                "{alert}: no {key}"
            );
        }
    }
}

#[test]
fn the_chart_and_the_kustomize_component_ship_the_same_rules_and_dashboard() {
    let (Some(h), Some(k)) = (helm(), kustomize()) else {
        println!("SKIPPED the_chart_and_the_kustomize_component_ship_the_same_rules_and_dashboard: no helm or kustomize (`cargo xtask test` installs them)");
        return;
    };
    let find = |objs: &[Value], kind: &str, name: &str| -> Value {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    let chart = render_helm(
        &h,
        &[
            "monitoring.prometheusRule.enabled=true",
            "monitoring.dashboard.enabled=true",
            "monitoring.controllerPodMonitor.enabled=true",
        ],
    );
    let kust = render_kustomize_dir(&k, &repo().join("deploy/overlays/monitoring"));
    let rule = |objs: &[Value]| find(objs, "PrometheusRule", "lastgasp")["spec"].clone();
    assert_eq!(
        rule(&chart),
        rules(),
        "the chart renders files/prometheus-rules.yaml"
    );
    assert_eq!(
        rule(&kust),
        rules(),
        "deploy/components/monitoring/prometheusrule.yaml"
    );
    let dashboard = |objs: &[Value]| -> Value {
        let cm = find(objs, "ConfigMap", "lastgasp-dashboard");
        assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
        serde_json::from_str(cm["data"]["lastgasp.json"].as_str().unwrap()).unwrap()
    };
    let d = dashboard(&chart);
    assert_eq!(d, dashboard(&kust), "the two dashboards differ");
    // The dashboard's queries name exported metrics too.
    let exported = exported();
    let text = d.to_string();
    for (i, _) in text.match_indices("lastgasp_") {
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let family = name
            .strip_suffix("_bucket")
            .unwrap_or(&name)
            .trim_end_matches("_total");
        let family = family.strip_suffix("_seconds").unwrap_or(family);
        assert!(
            exported.contains(&format!("# TYPE {family}")),
            "the dashboard uses {name}, which is not exported"
        );
    }
    let pm = |objs: &[Value]| find(objs, "PodMonitor", "lastgasp-controller")["spec"].clone();
    assert_eq!(pm(&chart), pm(&kust));
    // A renamed release's alerts select its own agents.
    let renamed = render_helm(
        &h,
        &[
            "monitoring.prometheusRule.enabled=true",
            "nameOverride=shutdown",
        ],
    );
    let spec = find(&renamed, "PrometheusRule", "shutdown")["spec"].to_string();
    assert!(!spec.contains("lastgasp-agent"), "{spec}");
    assert!(spec.contains(r#"up{job=~\".*shutdown-agent\"}"#), "{spec}");
    assert!(
        spec.contains(r#"daemonset=~\"shutdown-agent(-.+)?\""#),
        "{spec}"
    );
}
