//! The previous release's agent, for the version-skew tests (tests/skew.rs):
//! the newest version CHANGELOG.md dates other than this checkout's, its
//! tree taken from git (its tag `vX.Y.Z`, else the commit that dated its
//! section) and built by its own xtask under `target/previous/`; its binary
//! kept in `~/.cache/lastgasp/previous/VERSION-COMMIT/`, once per commit.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{ensure, Context, Result};

use crate::{build::target_dir, cmd::output, setup};

/// The previous release: its version and agent binary.
pub struct Previous {
    pub version: String,
    pub bin: PathBuf,
}

/// The previous release built, or why there is none (no git history, no
/// earlier dated version): the skew tests then say SKIPPED with it.
pub fn build(root: &Path, current: &str) -> Result<std::result::Result<Previous, String>> {
    let changelog = fs::read_to_string(root.join("CHANGELOG.md"))?;
    let Some((version, date)) = dated_before(&changelog, current) else {
        return Ok(Err(format!(
            "CHANGELOG.md dates no version before {current}"
        )));
    };
    let git = |args: &[&str]| output(Command::new("git").current_dir(root).args(args));
    let tagged = git(&[
        "rev-parse",
        "--verify",
        "--quiet",
        &format!("v{version}^{{commit}}"),
    ]);
    let heading = format!("## [{version}] - {date}");
    let commit = match tagged {
        Ok(c) => c.trim().to_string(),
        Err(_) => match git(&["log", "-1", "--format=%H", "-S", &heading, "--", "CHANGELOG.md"]) {
            Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
            Ok(_) | Err(_) => {
                return Ok(Err(format!(
                    "no tag v{version} and no commit that dated {heading:?} in this checkout's git history"
                )))
            }
        },
    };
    let manifest = git(&["show", &format!("{commit}:agent/Cargo.toml")])?;
    ensure!(
        manifest.contains(&format!("version = \"{version}\"")),
        "commit {commit} (the previous release {version}) has another version in agent/Cargo.toml"
    );
    // A commit's binary never changes: kept beyond this checkout, so that a
    // clean checkout (CI's) does not build the old tree again.
    let cached = setup::cache_dir()
        .join("previous")
        .join(format!("{version}-{commit}"))
        .join("lastgasp");
    if cached.is_file() {
        println!(
            "previous release {version} ({commit}): {}",
            cached.display()
        );
        return Ok(Ok(Previous {
            version,
            bin: cached,
        }));
    }
    // Built where a checkout builds; cargo's own cache there makes a rebuild short.
    let dir = target_dir(root).join("previous").join(&version);
    let bin = dir.join("target/debug/lastgasp");
    build_tree(root, &version, &commit, &dir, &bin)?;
    keep(&bin, &cached)?;
    Ok(Ok(Previous {
        version,
        bin: cached,
    }))
}

/// The commit's tree from git, built by its own xtask into `dir/target`.
fn build_tree(root: &Path, version: &str, commit: &str, dir: &Path, bin: &Path) -> Result<()> {
    let src = dir.join("src");
    let _ = fs::remove_dir_all(&src);
    fs::create_dir_all(&src)?;
    println!(
        "previous release {version}: building commit {commit} in {}",
        dir.display()
    );
    let mut archive = Command::new("git")
        .current_dir(root)
        .args(["archive", "--format=tar", commit])
        .stdout(Stdio::piped())
        .spawn()
        .context("git archive")?;
    let st = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&src)
        .stdin(archive.stdout.take().context("git archive's output")?)
        .status()?;
    let archived = archive.wait()?;
    ensure!(
        st.success() && archived.success(),
        "unpacking commit {commit}"
    );
    let mut cmd = Command::new("cargo");
    setup::clean_toolchain_env(&mut cmd);
    crate::run(
        cmd.current_dir(&src)
            .args(["xtask", "build"])
            .env("CARGO_TARGET_DIR", dir.join("target")),
    )
    .with_context(|| format!("building the previous release {version} ({commit})"))?;
    ensure!(
        bin.is_file(),
        "the previous release's build left no {}",
        bin.display()
    );
    fs::remove_dir_all(&src)?;
    Ok(())
}

/// Copies the built binary into the cache, whole or not at all.
fn keep(bin: &Path, cached: &Path) -> Result<()> {
    let dir = cached.parent().context("the cache's directory")?;
    fs::create_dir_all(dir)?;
    let part = dir.join("lastgasp.part");
    fs::copy(bin, &part)
        .with_context(|| format!("copying {} to {}", bin.display(), part.display()))?;
    fs::rename(&part, cached)?;
    Ok(())
}

/// The newest `## [X.Y.Z] - DATE` section other than `current`'s.
fn dated_before(changelog: &str, current: &str) -> Option<(String, String)> {
    changelog.lines().find_map(|l| {
        let (v, date) = l.strip_prefix("## [")?.split_once("] - ")?;
        (v != current).then(|| (v.to_string(), date.trim().to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_previous_release_is_the_newest_dated_other_version() {
        let log = "# Changelog\n\n## [Unreleased]\n\n## [0.3.0] - 2026-12-01\n\n## [0.2.0] - 2026-11-30\n";
        assert_eq!(
            dated_before(log, "0.3.0"),
            Some(("0.2.0".into(), "2026-11-30".into()))
        );
        assert_eq!(
            dated_before(log, "0.4.0"),
            Some(("0.3.0".into(), "2026-12-01".into()))
        );
        assert_eq!(dated_before("## [Unreleased]\n", "0.1.0"), None);
    }
}
