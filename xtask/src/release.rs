//! `cargo xtask release`: what an operator pulls, in `target/dist/VERSION/`:
//! the image (the one `cargo xtask image` builds and checks) as a per-arch
//! OCI archive and as a multi-arch OCI index, the chart as a package `helm
//! push` sends to any OCI registry, a CycloneDX SBOM of the agent's crates,
//! release notes from CHANGELOG.md, and SHA256SUMS over all of them.
//!
//! `verify` is the operator's side, run by `cargo xtask test`: a real
//! registry (Debian's docker-registry) on loopback, the index and the chart
//! pushed to it with skopeo and helm, pulled back and rendered.
use std::{
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use crate::{
    arch::Arch,
    build::{build_for, target_dir},
    cmd::run,
    image, setup,
};

pub struct Dist {
    pub dir: PathBuf,
    pub version: String,
}

impl Dist {
    fn index(&self) -> PathBuf {
        self.dir.join(format!("lastgasp-{}.oci.tar", self.version))
    }
    fn chart(&self) -> PathBuf {
        self.dir.join(format!("lastgasp-{}.tgz", self.version))
    }
}

pub fn release(root: &Path) -> Result<Dist> {
    let version = image::env_version(root)?;
    let notes = changelog_section(&fs::read_to_string(root.join("CHANGELOG.md"))?, &version)?;
    check_chart_version(root, &version)?;
    setup::ensure_debs(&[("sha256sum", "coreutils")])?;
    let tools = setup::ensure_manifest_tools()?;
    let sbom_tool = setup::ensure_cyclonedx()?;

    let target = target_dir(root);
    let mut images = Vec::new();
    for arch in Arch::ALL {
        let bin = build_for(root, true, arch)?;
        let img = image::build(root, &target, &bin, arch)?;
        image::check(&target, &img)?;
        images.push(img);
    }

    let dist = Dist {
        dir: target.join("dist").join(&version),
        version,
    };
    let _ = fs::remove_dir_all(&dist.dir);
    fs::create_dir_all(&dist.dir)?;
    let v = &dist.version;
    for img in &images {
        fs::copy(
            &img.archive,
            dist.dir
                .join(format!("lastgasp-{v}-linux-{}.oci.tar", img.arch.name())),
        )?;
    }
    image::save_index(&target, &images, &dist.index())?;
    run(Command::new(&tools.helm)
        .args(["package", "--version", v, "--app-version", v, "-d"])
        .arg(&dist.dir)
        .arg(root.join("deploy/helm/lastgasp")))
    .context("helm package")?;
    sbom(
        root,
        &sbom_tool,
        &dist.dir.join(format!("lastgasp-{v}.cdx.json")),
    )?;
    fs::write(dist.dir.join("RELEASE-NOTES.md"), notes)?;
    checksums(&dist.dir)?;
    println!("release {v}: {}", dist.dir.display());
    for f in sorted_files(&dist.dir)? {
        println!("  {}", f.file_name().unwrap_or_default().to_string_lossy());
    }
    Ok(dist)
}

/// The notes of `version`: its `## [VERSION]` section of a Keep a Changelog
/// file, without the heading. A version with no section, or an empty one,
/// is an error: a release says what changed.
pub fn changelog_section(changelog: &str, version: &str) -> Result<String> {
    let head = format!("## [{version}]");
    let start = changelog
        .lines()
        .position(|l| l.starts_with(&head))
        .with_context(|| format!("CHANGELOG.md has no `{head}` section"))?;
    let body: Vec<&str> = changelog
        .lines()
        .skip(start + 1)
        .take_while(|l| !l.starts_with("## "))
        .collect();
    let text = body.join("\n").trim().to_string();
    ensure!(!text.is_empty(), "CHANGELOG.md's `{head}` section is empty");
    Ok(format!("# lastgasp {version}\n\n{text}\n"))
}

fn check_chart_version(root: &Path, version: &str) -> Result<()> {
    let chart = fs::read_to_string(root.join("deploy/helm/lastgasp/Chart.yaml"))?;
    for key in ["version: ", "appVersion: "] {
        let found = chart
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().trim_matches('"'));
        ensure!(
            found == Some(version),
            "deploy/helm/lastgasp/Chart.yaml has {key}{found:?}, the agent's crate is {version}"
        );
    }
    Ok(())
}

/// The agent binary's crates (build-time-only crates left out), CycloneDX
/// 1.5 JSON. cargo-cyclonedx writes one file beside each binary crate's
/// manifest; the agent's is kept, the others removed.
fn sbom(root: &Path, tool: &Path, to: &Path) -> Result<()> {
    run(Command::new(tool)
        .current_dir(root)
        .args(["cyclonedx", "--manifest-path", "agent/Cargo.toml"])
        .args([
            "--format",
            "json",
            "--describe",
            "binaries",
            "--spec-version",
            "1.5",
        ])
        .args(["--no-build-deps", "--quiet"]))
    .context("cargo cyclonedx")?;
    let made: Vec<PathBuf> = ["agent", "apidouble", "tests", "xtask"]
        .iter()
        .flat_map(|d| fs::read_dir(root.join(d)).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with("_bin.cdx.json"))
        .collect();
    let agent = root.join("agent/lastgasp_bin.cdx.json");
    ensure!(
        made.contains(&agent),
        "cargo cyclonedx wrote no {}",
        agent.display()
    );
    fs::copy(&agent, to)?;
    for f in made {
        fs::remove_file(f)?;
    }
    Ok(())
}

fn checksums(dir: &Path) -> Result<()> {
    let names: Vec<String> = sorted_files(dir)?
        .iter()
        .map(|p| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let out = Command::new("sha256sum")
        .current_dir(dir)
        .args(&names)
        .output()
        .context("running sha256sum")?;
    ensure!(out.status.success(), "sha256sum failed");
    fs::write(dir.join("SHA256SUMS"), out.stdout)?;
    Ok(())
}

fn sorted_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// What an operator does with a release, against a real registry: checks
/// the sums, pushes the index with skopeo and the chart with helm, reads
/// the index back (one manifest per arch, each naming its platform), pulls
/// the chart by its OCI reference and renders it with the image it names.
pub fn verify(dist: &Dist) -> Result<()> {
    setup::ensure_debs(&[("skopeo", "skopeo"), ("docker-registry", "docker-registry")])?;
    let helm = setup::ensure_manifest_tools()?.helm;
    let sums = Command::new("sha256sum")
        .current_dir(&dist.dir)
        .args(["--check", "--quiet", "SHA256SUMS"])
        .status()?;
    ensure!(
        sums.success(),
        "SHA256SUMS does not match {}",
        dist.dir.display()
    );

    let registry = Registry::start(
        &dist
            .dir
            .with_file_name(format!(".registry-{}", dist.version)),
    )?;
    let host = registry.host.clone();
    let v = &dist.version;
    run(Command::new("skopeo")
        .args(["copy", "--quiet", "--all", "--dest-tls-verify=false"])
        .arg(format!("oci-archive:{}", dist.index().display()))
        .arg(format!("docker://{host}/lastgasp:{v}")))
    .context("skopeo copy of the index to the registry")?;
    let arches = index_arches(&host, v)?;

    run(Command::new(&helm)
        .args(["push", "--plain-http"])
        .arg(dist.chart())
        .arg(format!("oci://{host}/charts")))
    .context("helm push")?;
    let out = Command::new(&helm)
        .args(["template", "lastgasp", "--plain-http", "--version", v])
        .arg(format!("oci://{host}/charts/lastgasp"))
        .args(["--set", &format!("image.repository={host}/lastgasp")])
        .output()?;
    ensure!(
        out.status.success(),
        "helm template of the pushed chart: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = String::from_utf8_lossy(&out.stdout);
    let image_line = format!("image: {host}/lastgasp:{v}");
    ensure!(
        rendered.matches(&image_line).count() >= 2,
        "the chart pulled from the registry does not run {host}/lastgasp:{v} in both the agent and the controller"
    );
    println!(
        "release {v} verified: sums, index ({}) and chart pushed to and pulled from a registry",
        arches.join(", ")
    );
    Ok(())
}

/// The platforms of the index the registry serves for lastgasp:`v`: one
/// manifest per arch the release builds, or an error.
fn index_arches(host: &str, v: &str) -> Result<Vec<String>> {
    let raw = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{host}/lastgasp:{v}"))
        .output()?;
    ensure!(
        raw.status.success(),
        "skopeo inspect: {}",
        String::from_utf8_lossy(&raw.stderr)
    );
    let index: serde_json::Value = serde_json::from_slice(&raw.stdout)?;
    ensure!(
        index["mediaType"] == "application/vnd.oci.image.index.v1+json",
        "the registry serves {} for lastgasp:{v}, not an OCI index",
        index["mediaType"]
    );
    let mut arches: Vec<String> = index["manifests"]
        .as_array()
        .context("an index without manifests")?
        .iter()
        .map(|m| {
            format!("{}/{}", m["platform"]["os"], m["platform"]["architecture"]).replace('"', "")
        })
        .collect();
    arches.sort();
    let mut want: Vec<String> = Arch::ALL
        .iter()
        .map(|a| format!("linux/{}", a.name()))
        .collect();
    want.sort();
    ensure!(
        arches == want,
        "the index names {arches:?}, the release builds {want:?}"
    );
    Ok(arches)
}

/// Debian's docker-registry (distribution 2.8) on a free loopback port,
/// storage under `dir`, stopped on drop.
struct Registry {
    child: Child,
    host: String,
}

impl Registry {
    fn start(dir: &Path) -> Result<Self> {
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir)?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let host = format!("127.0.0.1:{port}");
        let config = dir.join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: {host}\n",
                dir.join("data").display()
            ),
        )?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting docker-registry")?;
        let mut reg = Registry { child, host };
        let start = Instant::now();
        while std::net::TcpStream::connect(&reg.host).is_err() {
            if let Some(st) = reg.child.try_wait()? {
                bail!("docker-registry exited at start: {st}");
            }
            ensure!(
                start.elapsed() < Duration::from_secs(20),
                "docker-registry did not listen in 20 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(reg)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::changelog_section;

    #[test]
    fn a_versions_notes_are_its_section_only() {
        let log = "# Changelog\n\n## [Unreleased]\n\n## [0.2.0] - 2027-01-01\n\n### Fixed\n- b\n\n## [0.1.0] - 2026-11-26\n\n- a\n";
        assert_eq!(
            changelog_section(log, "0.2.0").unwrap(),
            "# lastgasp 0.2.0\n\n### Fixed\n- b\n"
        );
        assert_eq!(
            changelog_section(log, "0.1.0").unwrap(),
            "# lastgasp 0.1.0\n\n- a\n"
        );
        let missing = changelog_section(log, "0.3.0").unwrap_err().to_string();
        assert!(missing.contains("no `## [0.3.0]` section"), "{missing}");
        let empty = changelog_section(log, "Unreleased")
            .unwrap_err()
            .to_string();
        assert!(empty.contains("is empty"), "{empty}");
    }
}
