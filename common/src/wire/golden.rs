//! Every golden file (`common/golden/`) parses into its type, whatever its
//! format version; the current version's read back unchanged.
use std::path::PathBuf;

use serde_json::Value;

use super::{
    audit::{AuditRecord, StdoutLine},
    record::{ShutdownRecord, UnannouncedEnd, VERSION},
};

fn files() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// The file's lines, each read as its type and written again.
fn read(name: &str, text: &str) -> Result<Vec<(Value, Value)>, String> {
    fn again<T: serde::de::DeserializeOwned + serde::Serialize>(l: &str) -> Result<Value, String> {
        let t: T = serde_json::from_str(l).map_err(|e| e.to_string())?;
        serde_json::to_value(&t).map_err(|e| e.to_string())
    }
    let kind = name.split('-').next().unwrap_or("");
    text.lines()
        .map(|l| {
            let written = match kind {
                "record" => ShutdownRecord::parse(l)
                    .and_then(|r| serde_json::to_value(&r).map_err(|e| e.to_string())),
                "audit" => again::<AuditRecord>(l),
                "stdout" => again::<StdoutLine>(l),
                "unannounced" => again::<UnannouncedEnd>(l),
                other => Err(format!("no reader for golden files of kind {other:?}")),
            }?;
            Ok((serde_json::from_str(l).map_err(|e| e.to_string())?, written))
        })
        .collect()
}

#[test]
fn every_golden_file_parses_and_the_current_ones_read_back_unchanged() {
    let files = files();
    let current = format!("-v{VERSION}.");
    assert!(
        files.iter().filter(|(n, _)| n.contains(&current)).count() >= 4,
        "the golden files of version {VERSION} are missing: {:?}",
        files.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    assert!(files.iter().any(|(n, _)| n == "record-v1.json"));
    for (name, text) in &files {
        let lines = read(name, text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!lines.is_empty(), "{name} is empty");
        if name.contains(&current) {
            for (golden, again) in lines {
                assert_eq!(golden, again, "{name}: a field was lost or renamed");
            }
        }
    }
}

#[test]
fn a_newer_version_is_refused_with_why() {
    let v2 = files()
        .into_iter()
        .find(|(n, _)| n == "record-v2.json")
        .unwrap()
        .1;
    let newer = v2.replacen("\"v\":2", "\"v\":3", 1);
    let e = ShutdownRecord::parse(newer.trim()).unwrap_err();
    assert!(e.contains("newer than this build's 2"), "{e}");
}
