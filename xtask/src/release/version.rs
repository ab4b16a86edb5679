//! What a release is called. A tag `vX.Y.Z` at the commit (or
//! `LASTGASP_RELEASE_TAG`, as the release workflow sets it) makes release
//! X.Y.Z: the agent's crate must say X.Y.Z and CHANGELOG.md must date its
//! `[X.Y.Z]` section. Any other commit builds `X.Y.Z-dev.gSHA` (a source
//! tree without git: `X.Y.Z-dev.nogit`), a pre-release of the next
//! version, with the `[Unreleased]` notes; a
//! version CHANGELOG.md already dates must be bumped first, so that no two
//! builds share a name.
use std::{path::Path, process::Command};

use anyhow::{bail, ensure, Context, Result};

use super::changelog_section;

/// A release's name and its notes.
#[derive(Debug, PartialEq)]
pub struct Version {
    pub name: String,
    pub tagged: bool,
    pub notes: String,
}

/// The name of this checkout's build: its tag, else its commit.
pub fn of_checkout(root: &Path, crate_version: &str, changelog: &str) -> Result<Version> {
    let tag = match std::env::var("LASTGASP_RELEASE_TAG") {
        Ok(t) if !t.is_empty() => Some(t),
        _ => git(
            root,
            &[
                "describe",
                "--exact-match",
                "--tags",
                "--match",
                "v*",
                "HEAD",
            ],
        )
        .ok(),
    };
    // Outside a git checkout (a source archive) a dev build says so in its name.
    let commit = match git(root, &["rev-parse", "--short=12", "HEAD"]) {
        Ok(sha) => format!("g{sha}"),
        Err(e) => {
            eprintln!("xtask: no commit to name the build by ({e:#}): it is named `nogit`");
            "nogit".into()
        }
    };
    name(crate_version, tag.as_deref(), &commit, changelog)
}

fn git(root: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .context("running git")?;
    ensure!(
        out.status.success(),
        "git {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The pure rule: `tag` (if any), the commit (`gSHA`), the crate's version
/// and the changelog make the name, or the reason there is none.
pub fn name(
    crate_version: &str,
    tag: Option<&str>,
    commit: &str,
    changelog: &str,
) -> Result<Version> {
    let dated = dated(changelog, crate_version)?;
    if let Some(tag) = tag {
        ensure!(
            tag == format!("v{crate_version}"),
            "the tag {tag} is not the agent's crate version (v{crate_version}, agent/Cargo.toml)"
        );
        ensure!(
            dated,
            "a tagged release is dated: CHANGELOG.md needs `## [{crate_version}] - YYYY-MM-DD`"
        );
        return Ok(Version {
            name: crate_version.to_string(),
            tagged: true,
            notes: changelog_section(changelog, crate_version)?,
        });
    }
    if dated {
        bail!(
            "CHANGELOG.md dates {crate_version} as released, and this commit is not its tag: \
             bump the version (agent/Cargo.toml, the chart) for what follows"
        );
    }
    let name = format!("{crate_version}-dev.{commit}");
    let notes = changelog_section(changelog, "Unreleased")
        .map(|n| n.replace("lastgasp Unreleased", &format!("lastgasp {name}")))
        .unwrap_or_else(|_| {
            format!("# lastgasp {name}\n\nNothing recorded since the last release.\n")
        });
    Ok(Version {
        name,
        tagged: false,
        notes,
    })
}

/// Whether `version`'s section is dated (`## [V] - YYYY-MM-DD`); an
/// undated or malformed date on a section of that version is an error.
fn dated(changelog: &str, version: &str) -> Result<bool> {
    let head = format!("## [{version}]");
    let Some(line) = changelog.lines().find(|l| l.starts_with(&head)) else {
        return Ok(false);
    };
    let rest = line[head.len()..].trim();
    if rest.is_empty() {
        return Ok(false);
    }
    let date = rest.strip_prefix("- ").unwrap_or(rest).trim();
    let ok = date.len() == 10
        && date.char_indices().all(|(i, c)| match i {
            4 | 7 => c == '-',
            _ => c.is_ascii_digit(),
        });
    ensure!(ok, "CHANGELOG.md's `{line}`: the date is not YYYY-MM-DD");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::name;

    const LOG: &str = "# Changelog\n\n## [Unreleased]\n\n- c\n\n## [0.2.0] - 2027-01-01\n\n- b\n\n## [0.1.0] - 2026-11-26\n\n- a\n";

    #[test]
    fn a_tag_names_a_dated_release_of_the_crates_version() {
        let v = name("0.2.0", Some("v0.2.0"), "abc", LOG).unwrap();
        assert_eq!((v.name.as_str(), v.tagged), ("0.2.0", true));
        assert_eq!(v.notes, "# lastgasp 0.2.0\n\n- b\n");
        let other = name("0.2.0", Some("v0.3.0"), "abc", LOG).unwrap_err();
        assert!(
            other.to_string().contains("not the agent's crate version"),
            "{other}"
        );
        let undated = "## [Unreleased]\n\n## [0.3.0]\n\n- d\n";
        let e = name("0.3.0", Some("v0.3.0"), "abc", undated).unwrap_err();
        assert!(e.to_string().contains("a tagged release is dated"), "{e}");
    }

    #[test]
    fn any_other_commit_is_a_dev_build_of_an_unreleased_version() {
        let v = name("0.3.0", None, "g0123456789ab", LOG).unwrap();
        assert_eq!(
            (v.name.as_str(), v.tagged),
            ("0.3.0-dev.g0123456789ab", false)
        );
        assert_eq!(v.notes, "# lastgasp 0.3.0-dev.g0123456789ab\n\n- c\n");
        // Released per the changelog, not at its tag: the version was not bumped.
        let e = name("0.2.0", None, "abc", LOG).unwrap_err();
        assert!(e.to_string().contains("bump the version"), "{e}");
        let bad = "## [0.4.0] - 27.01.2027\n";
        let e = name("0.4.0", None, "abc", bad).unwrap_err();
        assert!(e.to_string().contains("not YYYY-MM-DD"), "{e}");
        let empty = name("0.4.0", None, "abc", "## [Unreleased]\n").unwrap();
        assert!(empty.notes.contains("Nothing recorded"), "{}", empty.notes);
    }
}
