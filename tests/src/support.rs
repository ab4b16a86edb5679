use std::path::PathBuf;

/// Tests that need root (to load eBPF) call this first; without it they print
/// why they are skipped and return `false`. They never pass silently.
pub fn can_load_ebpf(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED {test}: needs root to load eBPF programs");
        return false;
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        println!("note {test}: no kernel BTF: exec args will not be captured");
    }
    true
}

/// `lastgasp-trigger`, built beside the test or bench binary that calls this.
pub fn trigger_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join("lastgasp-trigger")
}

/// The agent binary built by `cargo xtask` (LASTGASP_BIN), else the default
/// debug build.
pub fn agent_bin() -> PathBuf {
    std::env::var_os("LASTGASP_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/debug/lastgasp"
            ))
        })
}
