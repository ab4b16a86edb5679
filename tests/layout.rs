//! Every crate's modules form layers: no module reaches, through its
//! siblings, back into itself. Read from the sources: `use` trees and
//! `crate::`/`super::` paths, outside `#[cfg(test)]` modules.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// Module path ("detect::logind") of each file under `src`.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    fn walk(dir: &Path, src: &Path, out: &mut BTreeMap<String, PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, src, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(src).unwrap().with_extension("");
                let mut parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if matches!(
                    parts.last().map(String::as_str),
                    Some("mod" | "lib" | "main")
                ) {
                    parts.pop();
                }
                out.insert(parts.join("::"), p);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

/// The code before the file's test module: the first `#[cfg(test)]` that
/// opens a `mod NAME {` (test modules come last). A `#[cfg(test)] mod
/// tests;` line or a test-only helper above it is read as code.
fn before_tests(text: &str) -> &str {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let rest = &text[at + line.len()..];
        let next = rest.lines().next().unwrap_or("").trim_start();
        let opens = next
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ");
        if line.trim() == "#[cfg(test)]" && opens.starts_with("mod ") && opens.ends_with('{') {
            return &text[..at];
        }
        at += line.len();
    }
    text
}

/// The code before the test module, comments dropped.
fn non_test(text: &str) -> String {
    before_tests(text)
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Expands `use` trees into full paths: `crate::{a::{b, c}, d}` gives
/// `crate::a::b`, `crate::a::c`, `crate::d`.
fn expand(tree: &str, prefix: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let prefix = join(prefix, head);
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&inner[start..i], &prefix, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(&inner[start..], &prefix, out);
    } else if !tree.is_empty() {
        let path = tree.split(" as ").next().unwrap().trim();
        out.push(join(prefix, path));
    }
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}::{b}"),
    }
}

/// Every path the module's code names, made absolute (`crate::` dropped).
fn references(module: &str, text: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("use ") {
        let after = &rest[i + 4..];
        let end = after.find(';').unwrap_or(after.len());
        let word_start = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
        if word_start {
            expand(&after[..end], "", &mut paths);
        }
        rest = &after[end..];
    }
    for (i, _) in text.match_indices("crate::") {
        let tail = &text[i..];
        let end = tail
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        paths.push(tail[..end].to_string());
    }
    for (i, _) in text.match_indices("super::") {
        if text[..i].ends_with("super::") || text[..i].ends_with("use ") {
            continue;
        }
        let tail = &text[i..];
        let end = tail
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        paths.push(tail[..end].to_string());
    }
    let here: Vec<String> = module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    paths
        .into_iter()
        .filter_map(|p| {
            let mut segs: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Vec<String> = match segs.first() {
                Some(&"crate") => {
                    segs.remove(0);
                    Vec::new()
                }
                Some(&"super") => {
                    let mut b = here.clone();
                    while segs.first() == Some(&"super") {
                        segs.remove(0);
                        b.pop();
                    }
                    b
                }
                Some(&"self") => {
                    segs.remove(0);
                    here.clone()
                }
                _ => return None,
            };
            base.extend(segs.iter().map(std::string::ToString::to_string));
            Some(base)
        })
        .collect()
}

/// Edges between sibling modules of one crate: a reference from X to Y is
/// an edge between the children of their deepest common ancestor that lead
/// to each.
fn sibling_edges(mods: &BTreeMap<String, PathBuf>) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, file) in mods {
        if m.is_empty() {
            continue;
        }
        let text = non_test(&std::fs::read_to_string(file).unwrap());
        let from: Vec<&str> = m.split("::").collect();
        for path in references(m, &text) {
            // The longest prefix that is a module.
            let Some(to) = (1..=path.len())
                .rev()
                .map(|k| path[..k].join("::"))
                .find(|p| mods.contains_key(p))
            else {
                continue;
            };
            let to: Vec<&str> = to.split("::").collect();
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common >= from.len() || common >= to.len() {
                continue; // into an ancestor, or into a descendant
            }
            let a = from[..=common].join("::");
            let b = to[..=common].join("::");
            edges.entry(a).or_default().insert(b);
        }
    }
    edges
}

/// The cycles a depth-first search meets (each back edge once), as
/// `a -> b -> a`.
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
        found: &mut Vec<String>,
    ) {
        stack.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(i) = stack.iter().position(|s| s == m) {
                let mut cycle = stack[i..].to_vec();
                cycle.push(m.clone());
                found.push(cycle.join(" -> "));
            } else if !done.contains(m) {
                visit(m, edges, done, stack, found);
            }
        }
        stack.pop();
        done.insert(n.to_string());
    }
    let mut done = BTreeSet::new();
    let mut found = Vec::new();
    for n in edges.keys() {
        if !done.contains(n) {
            visit(n, edges, &mut done, &mut Vec::new(), &mut found);
        }
    }
    found
}

/// Every crate of the repository, by its source directory, with a module
/// each must have (so a reader that found nothing fails). `tests/src/bin`
/// holds crates of their own, one file each.
const CRATES: &[(&str, &str)] = &[
    ("agent/src", "detect::logind"),
    ("agent-ebpf/src", "reboot"),
    ("apidouble/src", "store"),
    ("common/src", ""),
    ("tests/src", "controlplane"),
    ("xtask/src", "vm::scenario"),
];

#[test]
fn no_module_reaches_back_into_itself_through_its_siblings() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut circles = Vec::new();
    for (dir, must) in CRATES {
        let mut mods = modules(&root.join(dir));
        mods.retain(|m, _| m != "bin" && !m.starts_with("bin::"));
        assert!(
            mods.contains_key(*must),
            "{dir}: the reader did not find module `{must}` in {:?}",
            mods.keys()
        );
        let edges = sibling_edges(&mods);
        assert!(
            mods.len() < 3 || !edges.is_empty(),
            "{dir}: the reader found no reference between {} modules",
            mods.len()
        );
        circles.extend(cycles(&edges).into_iter().map(|c| format!("{dir}: {c}")));
    }
    assert!(
        circles.is_empty(),
        "modules import in a circle:\n{}",
        circles.join("\n")
    );
}

/// The agent's pipeline stages sit side by side under its loop: a stage
/// does not reach into another (`from` never imports `to`).
const APART: &[(&str, &str)] = &[("act", "detect"), ("detect", "decide"), ("detect", "act")];

#[test]
fn the_agent_s_stages_do_not_import_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mods = modules(&root.join("agent/src"));
    let edges = sibling_edges(&mods);
    let found: Vec<String> = APART
        .iter()
        .filter(|(from, to)| edges.get(*from).is_some_and(|e| e.contains(*to)))
        .map(|(from, to)| format!("{from} -> {to}"))
        .collect();
    assert!(
        edges.get("act").is_some_and(|e| e.contains("decide")),
        "the reader found no edge act -> decide: {edges:?}"
    );
    assert!(found.is_empty(), "stages import each other: {found:?}");
}

/// The shipped crates' files, their code before the tests (`tests.rs`
/// files are tests), stay within this many lines.
const MAX_LINES: usize = 600;
const SHIPPED: &[&str] = &["agent/src", "agent-ebpf/src", "common/src"];

#[test]
fn no_shipped_file_is_over_600_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    let mut seen = 0;
    for dir in SHIPPED {
        for (_, file) in modules(&root.join(dir)) {
            if file.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let n = before_tests(&text).lines().count();
            seen += 1;
            if n > MAX_LINES {
                long.push(format!("{} ({n} lines)", file.display()));
            }
        }
    }
    assert!(seen > 50, "the reader found only {seen} files");
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}

/// The walk of a `reboot -ff` from the kernel's record to the cluster's
/// write, in the order the code first enters each file: (the file, a
/// function defined there, the file whose code calls it); a file's steps
/// stand together. A hook's decoder
/// is called through the `HOOKS` table (`(h.decode)(`, `decode: record`).
/// docs/development.md lists the same files in the same order.
const WALK: &[(&str, &str, &str)] = &[
    ("agent/src/agent/mod.rs", "turn", "agent/src/agent/mod.rs"),
    (
        "agent/src/detect/ebpf/mod.rs",
        "next_batch",
        "agent/src/agent/mod.rs",
    ),
    (
        "agent/src/detect/hooks/mod.rs",
        "decode",
        "agent/src/detect/ebpf/mod.rs",
    ),
    (
        "agent/src/detect/hooks/exec/mod.rs",
        "record",
        "agent/src/detect/hooks/mod.rs",
    ),
    (
        "agent/src/detect/hooks/exec/tools/sysv.rs",
        "halt",
        "agent/src/detect/hooks/exec/mod.rs",
    ),
    (
        "agent/src/detect/hooks/exec/getopt.rs",
        "tokenize",
        "agent/src/detect/hooks/exec/tools/sysv.rs",
    ),
    (
        "agent/src/detect/actor.rs",
        "enrich_with",
        "agent/src/agent/mod.rs",
    ),
    (
        "agent/src/decide/mod.rs",
        "decide",
        "agent/src/agent/mod.rs",
    ),
    (
        "agent/src/decide/claims.rs",
        "authority",
        "agent/src/decide/mod.rs",
    ),
    (
        "agent/src/decide/claims.rs",
        "prove",
        "agent/src/decide/mod.rs",
    ),
    (
        "agent/src/act/audit.rs",
        "append_as",
        "agent/src/agent/mod.rs",
    ),
    ("agent/src/act/mod.rs", "act", "agent/src/agent/mod.rs"),
    (
        "agent/src/act/last_gasp.rs",
        "last_gasp",
        "agent/src/act/mod.rs",
    ),
    (
        "common/src/wire/record.rs",
        "new",
        "agent/src/act/last_gasp.rs",
    ),
];

#[test]
fn the_documented_walk_is_the_call_path() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read =
        |f: &str| std::fs::read_to_string(root.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    let code = |f: &str| before_tests(&read(f)).to_string();
    let mut wrong = Vec::new();
    for (i, (file, func, caller)) in WALK.iter().enumerate() {
        let text = code(file);
        if !["(", "<"]
            .iter()
            .any(|p| text.contains(&format!("fn {func}{p}")))
        {
            wrong.push(format!("{file} defines no `fn {func}`"));
        }
        if !WALK[..=i].iter().any(|(f, _, _)| f == caller) {
            wrong.push(format!(
                "{file}: its caller {caller} is not earlier in the walk"
            ));
        }
        let calls = code(caller);
        let called = if *func == "record" {
            calls.contains("(h.decode)(") && read(file).contains("decode: record")
        } else {
            [
                format!("{func}("),
                format!(".{func}("),
                format!("::{func}("),
            ]
            .iter()
            .any(|c| calls.contains(c.as_str()))
        };
        if !called {
            wrong.push(format!("{caller} does not call `{func}` ({file})"));
        }
    }
    // Each file is entered once: its steps stand together (no double-back).
    let mut entered: Vec<&str> = Vec::new();
    for (f, _, _) in WALK {
        if entered.last() != Some(f) {
            entered.push(f);
        }
    }
    let files: BTreeSet<&str> = entered.iter().copied().collect();
    assert_eq!(
        files.len(),
        entered.len(),
        "a file entered twice in the walk: {entered:?}"
    );
    // The docs' list, in order.
    let doc = read("docs/development.md");
    let para = doc
        .split("\n\n")
        .find(|p| p.starts_with("Following one `reboot -ff`"))
        .expect("docs/development.md: the walk's paragraph");
    let named: Vec<&str> = para
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| t.ends_with(".rs") && !t.starts_with("tests/") && !t.starts_with("agent-ebpf/"))
        .collect();
    let walk: Vec<&str> = entered
        .iter()
        .map(|f| f.trim_start_matches("agent/src/"))
        .collect();
    if named != walk {
        wrong.push(format!("the docs list {named:?}, the walk is {walk:?}"));
    }
    assert!(wrong.is_empty(), "the walk:\n{}", wrong.join("\n"));
}

#[test]
fn the_reader_expands_use_trees_and_relative_paths() {
    let mut paths = Vec::new();
    expand("crate::{a::{b, c as d}, e}", "", &mut paths);
    assert_eq!(paths, ["crate::a::b", "crate::a::c", "crate::e"]);
    let refs = references("x::y", "use super::z::{W, V};\nfn f() { crate::q::r(); }");
    assert!(
        refs.contains(&vec!["x".to_string(), "z".into(), "W".into()]),
        "{refs:?}"
    );
    assert!(
        refs.contains(&vec!["q".to_string(), "r".into()]),
        "{refs:?}"
    );
    let edges: BTreeMap<String, BTreeSet<String>> =
        [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
            .into_iter()
            .map(|(from, to)| (from.to_string(), BTreeSet::from([to.to_string()])))
            .collect();
    assert_eq!(cycles(&edges), ["a -> b -> c -> a"]);
    let text = "use a;\n#[cfg(test)]\nmod tests;\nfn f() {}\n#[cfg(test)]\nmod tests {\n}\n";
    assert_eq!(
        before_tests(text),
        "use a;\n#[cfg(test)]\nmod tests;\nfn f() {}\n"
    );
}
