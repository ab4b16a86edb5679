//! The docs tell the truth: every `lastgasp_*` metric that README.md and
//! docs/*.md name exists in what the agent and the controller serve.
use std::collections::BTreeSet;

use lastgasp::{
    act::metrics::Metrics,
    controller::{metrics::EntryLabels, ControllerMetrics, Stage},
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
    m.set_last_word("shutdown-hook", true);
    m.count_boot_end(lastgasp::act::report::BootEnd::Forced.as_str());
    m.set_ringbuf_drops(&Drops::default().by_label());
    m.set_hook_errors(Drops::default().hook_errors_by_label());
    let c = ControllerMetrics::default();
    c.count_action("taint-added");
    c.count_ledger_write("applied", 1);
    c.set_ledger_entries(std::iter::once(EntryLabels {
        kind: "poweroff".into(),
        path: "immediate".into(),
        ending: "fenced".into(),
        graceful: "false".into(),
    }));
    c.count_error(Stage::pass);
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

// ------------------------------------------------ links, sizes, examples

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use lastgasp_tests::{
    doccmd::{self, blocks, commands, doc_files, filled, flag, DocCommand},
    render::{chart_dir, helm, helm_command, repo, split_yaml},
};

/// A heading's anchor as GitHub makes it: lowercase, punctuation but `-`
/// and `_` dropped, spaces to `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for l in text.lines() {
        if l.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && l.starts_with('#') {
            out.insert(anchor(l.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn every_link_in_the_docs_resolves() {
    let mut broken = Vec::new();
    let mut n = 0;
    for f in doc_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("](") {
            let tail = &rest[i + 2..];
            let end = tail.find(')').unwrap_or(tail.len());
            let target = &tail[..end];
            rest = &tail[end..];
            if target.starts_with("http") || target.contains(' ') {
                continue;
            }
            n += 1;
            let (path, frag) = target.split_once('#').unwrap_or((target, ""));
            let file = if path.is_empty() {
                f.clone()
            } else {
                f.parent().unwrap().join(path)
            };
            if !file.exists() {
                broken.push(format!("{}: {target}: no such file", f.display()));
            } else if !frag.is_empty() {
                let there = std::fs::read_to_string(&file).unwrap_or_default();
                if !anchors(&there).contains(frag) {
                    broken.push(format!("{}: {target}: no such heading", f.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(n > 50, "only {n} links found: the scan is broken");
}

/// The size goals: a README a newcomer reads through, guide pages of one
/// subject each, a testing summary (its log apart).
#[test]
fn the_docs_keep_their_size() {
    let root = repo();
    let size = |p: &str| std::fs::metadata(root.join(p)).unwrap().len();
    let mut over = Vec::new();
    if size("README.md") > 12 * 1024 {
        over.push(format!("README.md: {} bytes > 12 KiB", size("README.md")));
    }
    if size("docs/testing.md") > 20 * 1024 {
        over.push(format!(
            "docs/testing.md: {} bytes > 20 KiB",
            size("docs/testing.md")
        ));
    }
    for f in doc_files() {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let exempt = ["README.md", "testing.md", "development.md"];
        if f.starts_with(root.join("docs")) && !exempt.contains(&name.as_str()) {
            let n = std::fs::metadata(&f).unwrap().len();
            if n > 15 * 1024 {
                over.push(format!("docs/{name}: {n} bytes > 15 KiB"));
            }
        }
    }
    assert!(over.is_empty(), "{}", over.join("\n"));
}

/// The agent's version (the chart's appVersion is checked against it by
/// `cargo xtask release`).
fn version() -> String {
    let chart = std::fs::read_to_string(chart_dir().join("Chart.yaml")).unwrap();
    chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion: "))
        .unwrap()
        .trim_matches('"')
        .to_string()
}

/// Objects of the kustomize base by (kind, name), read from its files.
fn base_objects() -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(repo().join("deploy/kustomize"))
        .unwrap()
        .flatten()
    {
        if e.file_name() == "kustomization.yaml" {
            continue;
        }
        for v in split_yaml(&std::fs::read_to_string(e.path()).unwrap()) {
            let s = |p: &str| {
                v.pointer(p)
                    .and_then(|x| x.as_str())
                    .unwrap_or("")
                    .to_string()
            };
            out.insert((s("/kind"), s("/metadata/name")));
        }
    }
    out
}

/// The annotation, label and taint keys lastgasp defines.
fn known_keys() -> BTreeSet<&'static str> {
    use lastgasp::{act::kube, controller};
    BTreeSet::from([
        kube::RECORD_ANNOTATION,
        kube::TAINT_KEY,
        controller::PAUSE_ANNOTATION,
        controller::OPT_OUT_LABEL,
        controller::TAINTED_BY_ANNOTATION,
        controller::FENCED_BOOT_ANNOTATION,
        controller::OUT_OF_SERVICE_KEY,
        lastgasp::record::PROOF_ANNOTATION,
        lastgasp::record::UNANNOUNCED_ANNOTATION,
    ])
    .into_iter()
    .chain(controller::ledger_writer::LABEL_KEYS)
    .collect()
}

/// Runs `lastgasp ARGS --help`: clap parses every argument before it (an
/// unknown flag or a bad value fails), then prints the help.
fn cli_accepts(bin: &Path, args: &[String]) -> Result<(), String> {
    let out = Command::new(bin).args(args).arg("--help").output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .next()
            .unwrap_or("")
            .to_string())
    }
}

fn xtask_accepts(sub: &str) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(repo())
        .args(["run", "-q", "-p", "xtask", "--", sub, "--help"])
        .output()
        .unwrap();
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_string()),
    }
}

/// `helm template` with the chart `helm install|upgrade|template` names
/// (an OCI reference: the chart it was pushed from) and the same values.
fn helm_renders(helm: &Path, w: &[String]) -> Result<(), String> {
    let chart = &w[3];
    let dir: PathBuf = if chart.starts_with("oci://") {
        chart_dir()
    } else {
        repo().join(chart)
    };
    if !dir.join("Chart.yaml").is_file() {
        return Err(format!("{chart}: no chart there"));
    }
    let home = std::env::temp_dir().join(format!("lastgasp-docs-helm-{}", std::process::id()));
    let mut cmd = helm_command(helm, &home);
    cmd.args(["template", &w[2]]).arg(&dir);
    let mut i = 4;
    while i < w.len() {
        match w[i].as_str() {
            "--set" | "-f" | "--values" | "-n" | "--namespace" => {
                let v = w.get(i + 1).ok_or("a flag without its value")?;
                cmd.args([&w[i], &filled(v)]);
                i += 2;
            }
            "--version" => i += 2,
            // Rendered over the chart's defaults: the installed values are not here.
            "--reuse-values" => i += 1,
            other => return Err(format!("{other}: a helm flag this check does not know")),
        }
    }
    let out = cmd.output().unwrap();
    std::fs::remove_dir_all(&home).ok();
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr).to_string()),
    }
}

/// What is wrong with one documented command, if anything.
fn judge(c: &DocCommand, ctx: &Ctx) -> Result<(), String> {
    // `VERSION=$(cargo xtask version)`: the release's name, whatever the commit.
    let w: &Vec<String> = &c
        .words
        .iter()
        .map(|x| x.replace("$VERSION", &ctx.version))
        .collect();
    let s = |i: usize| w.get(i).map(String::as_str).unwrap_or("");
    for word in w {
        if let Some(i) = word.find("lastgasp.dev/") {
            let key: String = word[i..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || matches!(c, '.' | '/' | '-' | '_'))
                .collect();
            let key = key.trim_end_matches('-');
            if !known_keys().contains(key) {
                return Err(format!("{key}: not a key lastgasp uses"));
            }
        }
    }
    match s(0) {
        "lastgasp" => ctx.cli(&w[1..]),
        "kubectl" => {
            if let Some(ns) = flag(w, &["-n", "--namespace"]) {
                if !["lastgasp", "default"].contains(&ns) {
                    return Err(format!("namespace {ns}: lastgasp installs into lastgasp"));
                }
            }
            if let Some(p) = flag(w, &["-k", "-f"]) {
                if !repo().join(p).exists() {
                    return Err(format!("{p}: no such file or directory"));
                }
            }
            for word in w.iter().filter(|x| !repo().join(x).exists()) {
                for (prefix, kind) in [("ds/", "DaemonSet"), ("deploy/", "Deployment")] {
                    if let Some(name) = word.strip_prefix(prefix) {
                        if !ctx.objects.contains(&(kind.to_string(), name.to_string())) {
                            return Err(format!("{word}: no {kind} {name} in deploy/kustomize"));
                        }
                    }
                }
            }
            if let Some(i) = w.iter().position(|x| x == "lease") {
                if s(i + 1) != "lastgasp-controller" {
                    return Err(format!(
                        "lease {}: the controller's Lease is lastgasp-controller",
                        s(i + 1)
                    ));
                }
            }
            match w.iter().position(|x| x == "--") {
                Some(i) if s(i + 1) == "lastgasp" => ctx.cli(&w[i + 2..]),
                _ => Ok(()),
            }
        }
        "helm" => match s(1) {
            "install" | "upgrade" | "template" => match &ctx.helm {
                Some(h) => helm_renders(h, w),
                None => Ok(()),
            },
            "push" => {
                let want = format!("lastgasp-{}.tgz", ctx.version);
                match Path::new(s(2)).file_name().and_then(|f| f.to_str()) == Some(want.as_str()) {
                    true => Ok(()),
                    false => Err(format!("{}: the release's chart is {want}", s(2))),
                }
            }
            "test" | "uninstall" | "lint" => Ok(()),
            other => Err(format!(
                "helm {other}: a subcommand this check does not know"
            )),
        },
        "cargo" if s(1) == "xtask" => xtask_accepts(s(2)),
        "VERSION=$(cargo" if s(1) == "xtask" => xtask_accepts(s(2).trim_end_matches(')')),
        "skopeo" => {
            let archive = w
                .iter()
                .find_map(|x| x.strip_prefix("oci-archive:"))
                .ok_or("no oci-archive: source")?;
            let name = Path::new(archive)
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or("");
            let v = &ctx.version;
            match [
                format!("lastgasp-{v}.oci.tar"),
                format!("lastgasp-{v}-linux-amd64.oci.tar"),
                format!("lastgasp-{v}-linux-arm64.oci.tar"),
            ]
            .contains(&name.to_string())
            {
                true => Ok(()),
                false => Err(format!(
                    "{archive}: not an archive `cargo xtask release` writes"
                )),
            }
        }
        "podman" | "docker" => match s(1) {
            // `cargo xtask release` builds that file (the release step of `cargo xtask test`).
            "build" | "buildx" => match repo().join("Containerfile").is_file() {
                true => Ok(()),
                false => Err("no Containerfile at the repository's root".into()),
            },
            "push" => Ok(()),
            other => Err(format!(
                "{} {other}: a subcommand this check does not know",
                s(0)
            )),
        },
        "cd" if s(1).starts_with("target/dist/") => {
            match s(1) == format!("target/dist/{}", ctx.version) {
                true => Ok(()),
                false => Err(format!(
                    "{}: the release directory is target/dist/{}",
                    s(1),
                    ctx.version
                )),
            }
        }
        _ => Ok(()),
    }
}

struct Ctx {
    bin: Option<PathBuf>,
    helm: Option<PathBuf>,
    objects: BTreeSet<(String, String)>,
    version: String,
}

impl Ctx {
    fn cli(&self, args: &[String]) -> Result<(), String> {
        match &self.bin {
            Some(b) => cli_accepts(b, args),
            None => Ok(()),
        }
    }
}

#[test]
fn every_command_in_the_docs_is_one_the_tools_accept() {
    let bin = lastgasp_tests::support::agent_bin();
    let ctx = Ctx {
        bin: bin.is_file().then_some(bin),
        helm: helm(),
        objects: base_objects(),
        version: version(),
    };
    if ctx.bin.is_none() {
        println!("SKIPPED the `lastgasp` lines: no agent binary (cargo xtask test builds it)");
    }
    if ctx.helm.is_none() {
        println!("SKIPPED the helm renders: no helm (cargo xtask test installs it)");
    }
    let mut wrong = Vec::new();
    let mut by_tool: BTreeMap<String, usize> = BTreeMap::new();
    for f in doc_files() {
        for c in commands(&f) {
            *by_tool.entry(c.words[0].clone()).or_default() += 1;
            if let Err(e) = judge(&c, &ctx) {
                wrong.push(format!("{c}\n    {e}"));
            }
        }
    }
    println!("documented commands checked, by tool: {by_tool:?}");
    assert!(
        wrong.is_empty(),
        "documented commands that would fail:\n{}",
        wrong.join("\n")
    );
    assert!(
        by_tool.get("kubectl").copied().unwrap_or(0) > 5,
        "{by_tool:?}"
    );
    // And the check is real: a wrong one is caught.
    let bad = |words: &[&str]| DocCommand {
        file: "x".into(),
        line: 1,
        words: words.iter().map(std::string::ToString::to_string).collect(),
    };
    for b in [
        bad(&[
            "kubectl",
            "-n",
            "lastgasp",
            "exec",
            "ds/lastgasp-agents",
            "--",
            "lastgasp",
            "check",
        ]),
        bad(&[
            "kubectl",
            "annotate",
            "lease",
            "lastgasp-controller",
            "lastgasp.dev/pause=true",
        ]),
        bad(&["kubectl", "apply", "-k", "deploy/no-such-overlay"]),
        bad(&["cargo", "xtask", "no-such-task"]),
    ] {
        assert!(judge(&b, &ctx).is_err(), "not caught: {b}");
    }
    if ctx.bin.is_some() {
        assert!(judge(&bad(&["lastgasp", "check", "--no-such-flag"]), &ctx).is_err());
    }
}

/// The YAML the docs show: the agent's config parses with the agent's own
/// parser; the remediators' recipes match lastgasp's condition, True, at
/// once.
#[test]
fn every_yaml_in_the_docs_is_what_it_claims() {
    let mut seen = BTreeMap::new();
    for f in doc_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        for (line, body) in blocks(&text, "yaml") {
            let at = format!("{}:{line}", f.display());
            let v: serde_json::Value =
                serde_norway::from_str(&body).unwrap_or_else(|e| panic!("{at}: {e}"));
            let kind = v["kind"].as_str().unwrap_or("").to_string();
            let conds = match kind.as_str() {
                "" => {
                    lastgasp::config::Config::parse(&body)
                        .unwrap_or_else(|e| panic!("{at}: the agent's config: {e:#}"));
                    None
                }
                "NodeHealthCheck" => Some((
                    v["spec"]["unhealthyConditions"].clone(),
                    "duration",
                    serde_json::json!("0s"),
                )),
                "MachineHealthCheck" => Some((
                    v["spec"]["checks"]["unhealthyNodeConditions"].clone(),
                    "timeoutSeconds",
                    serde_json::json!(0),
                )),
                other => panic!("{at}: a {other} in the docs, and no check for it here"),
            };
            if let Some((list, key, zero)) = conds {
                let c = &list[0];
                assert_eq!(c["type"], lastgasp::controller::FENCED_CONDITION, "{at}");
                assert_eq!(c["status"], "True", "{at}");
                assert_eq!(c[key], zero, "{at}");
            }
            *seen
                .entry(if kind.is_empty() {
                    "config".to_string()
                } else {
                    kind
                })
                .or_insert(0) += 1;
        }
    }
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        ["MachineHealthCheck", "NodeHealthCheck", "config"],
        "{seen:?}"
    );
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    assert_eq!(
        anchor(" Preflight: `lastgasp check`"),
        "preflight-lastgasp-check"
    );
    assert_eq!(
        anchor("Remediators: NodeHealthCheck and MachineHealthCheck"),
        "remediators-nodehealthcheck-and-machinehealthcheck"
    );
    let _ = doccmd::words;
}

/// Every source file the docs name in backticks (`hooks/exec/{mod,tools}.rs`
/// included) is in the repository: a file that moves takes its mentions with
/// it.
#[test]
fn every_source_file_the_docs_name_exists() {
    fn rs_files(dir: &std::path::Path, root: &std::path::Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() && !matches!(name.as_str(), "target" | ".git" | "node_modules") {
                rs_files(&p, root, out);
            } else if name.ends_with(".rs") {
                out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let root = repo();
    let mut files = Vec::new();
    rs_files(&root, &root, &mut files);
    let exists = |name: &str| {
        files
            .iter()
            .any(|f| f == name || f.ends_with(&format!("/{name}")))
    };
    let (mut missing, mut n) = (Vec::new(), 0);
    for f in doc_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, token) in text.split('`').enumerate() {
            if i % 2 == 0 || !token.ends_with(".rs") || token.contains([' ', '<']) {
                continue;
            }
            let names: Vec<String> = match (token.find('{'), token.find('}')) {
                (Some(a), Some(b)) if a < b => token[a + 1..b]
                    .split(',')
                    .map(|alt| format!("{}{alt}{}", &token[..a], &token[b + 1..]))
                    .collect(),
                _ => vec![token.to_string()],
            };
            for name in names {
                n += 1;
                if !exists(&name) {
                    missing.push(format!("{}: `{token}`: no {name}", f.display()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "files the docs name that are not there:\n{}",
        missing.join("\n")
    );
    assert!(n > 20, "only {n} file names found: the scan is broken");
}
