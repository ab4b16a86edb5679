//! `cargo xtask release`: what an operator pulls, in `target/dist/VERSION/`:
//! the image (the root `Containerfile`, its build stage compiling the agent
//! for each arch, checked as `cargo xtask image` checks) as a per-arch
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

use crate::{arch::Arch, build::target_dir, cmd::run, image, setup};

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

mod version;

/// What `release` calls this checkout's build (`cargo xtask version`).
pub fn version_name(root: &Path) -> Result<String> {
    let changelog = fs::read_to_string(root.join("CHANGELOG.md"))?;
    Ok(version::of_checkout(root, &image::env_version(root)?, &changelog)?.name)
}

/// The release of this checkout over `base`; with `repository`, its chart
/// runs the image from there, pinned by the index's digest.
pub fn release(root: &Path, repository: Option<&str>, base: image::Base) -> Result<Dist> {
    let crate_version = image::env_version(root)?;
    check_chart_version(root, &crate_version)?;
    let changelog = fs::read_to_string(root.join("CHANGELOG.md"))?;
    let version::Version {
        name: version,
        notes,
        ..
    } = version::of_checkout(root, &crate_version, &changelog)?;
    setup::ensure_debs(&[("sha256sum", "coreutils")])?;
    let tools = setup::ensure_manifest_tools()?;
    let sbom_tool = setup::ensure_cyclonedx()?;

    let target = target_dir(root);
    let mut images = Vec::new();
    for arch in Arch::ALL {
        let img = image::build(root, &target, image::From::Source, arch, &version, base)?;
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
    package_chart(root, &dist, &tools.helm, repository, &dist.dir)?;
    sbom(
        root,
        &sbom_tool,
        &images,
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

/// The chart, versioned as the release. With `repository`, its default
/// image is that repository pinned by the index's digest (what a registry
/// serves for it after `skopeo copy --all`); without, `lastgasp` at the
/// release's tag, for a registry named at install time.
pub fn package_chart(
    root: &Path,
    dist: &Dist,
    helm: &Path,
    repository: Option<&str>,
    out: &Path,
) -> Result<PathBuf> {
    let v = &dist.version;
    let packaged = out.join(format!("lastgasp-{v}.tgz"));
    let _ = fs::remove_file(&packaged);
    let mut chart = root.join("deploy/helm/lastgasp");
    let staged = dist.dir.with_file_name(format!(".chart-{v}"));
    if let Some(repo) = repository {
        ensure!(
            repo.contains('/') && !repo.contains('@') && !repo.rsplit('/').next().unwrap_or("").contains(':'),
            "--image-repository {repo}: a registry and a path (REGISTRY/PATH/lastgasp), without a tag or digest"
        );
        let digest = index_digest(&dist.index())?;
        let _ = fs::remove_dir_all(&staged);
        copy_dir(&chart, &staged.join("lastgasp"))?;
        chart = staged.join("lastgasp");
        let values = chart.join("values.yaml");
        let text = fs::read_to_string(&values)?;
        let pinned = pin_values(&text, repo, &digest)?;
        fs::write(&values, pinned)?;
        println!("release {v}: the chart runs {repo}@{digest}");
    }
    run(Command::new(helm)
        .args(["package", "--version", v, "--app-version", v, "-d"])
        .arg(out)
        .arg(&chart))
    .context("helm package")?;
    let _ = fs::remove_dir_all(&staged);
    Ok(packaged)
}

/// values.yaml with its top-level `image:` block naming `repo` and `digest`.
fn pin_values(values: &str, repo: &str, digest: &str) -> Result<String> {
    let mut out = Vec::new();
    let (mut in_image, mut repo_set, mut digest_set) = (false, false, false);
    for line in values.lines() {
        if !line.starts_with(' ') && !line.starts_with('#') && !line.is_empty() {
            in_image = line == "image:";
        }
        if in_image && line.starts_with("  repository: ") {
            out.push(format!("  repository: {repo}"));
            repo_set = true;
        } else if in_image && line.starts_with("  digest: ") {
            out.push(format!("  digest: \"{digest}\""));
            digest_set = true;
        } else {
            out.push(line.to_string());
        }
    }
    ensure!(
        repo_set && digest_set,
        "values.yaml has no top-level image.repository and image.digest to pin"
    );
    Ok(out.join("\n") + "\n")
}

/// The digest of the image index an `oci-archive` holds (its `index.json`'s
/// one manifest).
pub fn index_digest(archive: &Path) -> Result<String> {
    let out = Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg("index.json")
        .output()
        .context("running tar")?;
    ensure!(
        out.status.success(),
        "no index.json in {}",
        archive.display()
    );
    let index: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let manifests = index["manifests"]
        .as_array()
        .context("index.json without manifests")?;
    ensure!(
        manifests.len() == 1
            && manifests[0]["mediaType"] == "application/vnd.oci.image.index.v1+json",
        "{} does not hold exactly one image index: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stdout)
    );
    let d = manifests[0]["digest"].as_str().unwrap_or_default();
    ensure!(
        d.starts_with("sha256:") && d.len() == 71,
        "a digest that is not sha256: {d}"
    );
    Ok(d.to_string())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for e in fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dest)?;
        } else {
            fs::copy(e.path(), &dest)?;
        }
    }
    Ok(())
}

/// The agent binary's crates (build-time-only crates left out), CycloneDX
/// 1.5 JSON. cargo-cyclonedx writes one file beside each binary crate's
/// manifest; the agent's is kept, the others removed.
fn sbom(root: &Path, tool: &Path, images: &[image::Image], to: &Path) -> Result<()> {
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
    let mut bom: serde_json::Value = serde_json::from_slice(&fs::read(&agent)?)?;
    add_base(&mut bom, images)?;
    fs::write(to, serde_json::to_vec_pretty(&bom)?)?;
    for f in made {
        fs::remove_file(f)?;
    }
    Ok(())
}

/// The images' base: the Debian packages installed in each (its dpkg
/// status), as components (purl `pkg:deb/debian/...`), once per purl (an
/// `all` package is in both arches' images), naming the images.
fn add_base(bom: &mut serde_json::Value, images: &[image::Image]) -> Result<()> {
    let mut base: std::collections::BTreeMap<String, (&image::DebPackage, Vec<&str>)> =
        std::collections::BTreeMap::new();
    for img in images {
        ensure!(
            !img.packages.is_empty(),
            "the {} image names no base package",
            img.arch.name()
        );
        for p in &img.packages {
            let purl = format!("pkg:deb/debian/{}@{}?arch={}", p.name, p.version, p.arch);
            base.entry(purl)
                .or_insert((p, Vec::new()))
                .1
                .push(img.arch.name());
        }
    }
    let comps = bom["components"]
        .as_array_mut()
        .context("an SBOM without components")?;
    for (purl, (p, arches)) in base {
        let images: Vec<String> = arches.iter().map(|a| format!("linux/{a}")).collect();
        let images = match images.len() {
            1 => format!("the {} image", images[0]),
            _ => format!("the {} images", images.join(" and ")),
        };
        comps.push(serde_json::json!({
            "type": "library",
            "bom-ref": purl,
            "name": p.name,
            "version": p.version,
            "purl": purl,
            "description": format!("installed in the base of {images}"),
        }));
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
pub fn verify(root: &Path, dist: &Dist) -> Result<()> {
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
    // The release workflow's chart: pinned to where the index was pushed.
    let pinned_dir = dist.dir.with_file_name(format!(".pinned-{v}"));
    let _ = fs::remove_dir_all(&pinned_dir);
    fs::create_dir_all(&pinned_dir)?;
    let repo = format!("{host}/lastgasp");
    let pinned = package_chart(root, dist, &helm, Some(&repo), &pinned_dir)?;
    let digest = index_digest(&dist.index())?;
    let served = served_digest(&host, v)?;
    ensure!(
        served == digest,
        "the registry serves lastgasp:{v} as {served}, the chart pins {digest}"
    );
    for (chart, image) in [
        (dist.chart(), format!("image: lastgasp:{v}")),
        (pinned, format!("image: {repo}@{digest}")),
    ] {
        let pushed = pushed_render(&helm, &host, &chart, v)?;
        ensure!(
            pushed.matches(&image).count() >= 2,
            "the chart {} pulled from the registry does not run `{image}` in both the agent and the controller",
            chart.display()
        );
    }
    let _ = fs::remove_dir_all(&pinned_dir);
    println!(
        "release {v} verified: sums, index ({}) and chart pushed to and pulled from a registry; \
         the pinned chart runs {repo}@{digest}, the digest the registry serves",
        arches.join(", ")
    );
    Ok(())
}

/// `chart` pushed to the registry, pulled back by its reference and rendered
/// with its defaults.
fn pushed_render(helm: &Path, host: &str, chart: &Path, v: &str) -> Result<String> {
    run(Command::new(helm)
        .args(["push", "--plain-http"])
        .arg(chart)
        .arg(format!("oci://{host}/charts")))
    .context("helm push")?;
    let out = Command::new(helm)
        .args(["template", "lastgasp", "--plain-http", "--version", v])
        .arg(format!("oci://{host}/charts/lastgasp"))
        .output()?;
    ensure!(
        out.status.success(),
        "helm template of the pushed chart: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The digest of what the registry serves for lastgasp:`v` (its raw manifest's sha256).
fn served_digest(host: &str, v: &str) -> Result<String> {
    let raw = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{host}/lastgasp:{v}"))
        .output()?;
    ensure!(
        raw.status.success(),
        "skopeo inspect: {}",
        String::from_utf8_lossy(&raw.stderr)
    );
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .context("sha256sum's stdin")?
            .write_all(&raw.stdout)?;
    }
    let out = child.wait_with_output()?;
    let hex = String::from_utf8_lossy(&out.stdout);
    Ok(format!(
        "sha256:{}",
        hex.split_whitespace().next().unwrap_or_default()
    ))
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
    use super::{add_base, changelog_section, image, Arch};

    #[test]
    fn a_package_in_both_images_is_one_component() {
        let pkg = |name: &str, arch: &str| image::DebPackage {
            name: name.into(),
            version: "1".into(),
            arch: arch.into(),
        };
        let img = |arch: Arch| image::Image {
            tag: String::new(),
            arch,
            archive: Default::default(),
            packages: vec![pkg("adduser", "all"), pkg("libc6", arch.name())],
        };
        let mut bom = serde_json::json!({"components": []});
        add_base(&mut bom, &[img(Arch::Amd64), img(Arch::Arm64)]).unwrap();
        let refs: Vec<&str> = bom["components"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["bom-ref"].as_str().unwrap())
            .collect();
        assert_eq!(
            refs,
            [
                "pkg:deb/debian/adduser@1?arch=all",
                "pkg:deb/debian/libc6@1?arch=amd64",
                "pkg:deb/debian/libc6@1?arch=arm64"
            ]
        );
        assert_eq!(
            bom["components"][0]["description"],
            "installed in the base of the linux/amd64 and linux/arm64 images"
        );
    }

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
