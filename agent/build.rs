//! Embeds the eBPF object that `cargo xtask` builds (agent-ebpf). Without it
//! the agent still compiles (for unit tests and clippy) but refuses to run.
use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=LASTGASP_EBPF_OBJ");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let obj = env::var_os("LASTGASP_EBPF_OBJ")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../target/ebpf/bpfel-unknown-none/release/lastgasp"));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("lastgasp.bpf.o");
    println!("cargo:rerun-if-changed={}", obj.display());
    match fs::read(&obj) {
        Ok(bytes) => fs::write(&out, bytes).unwrap(),
        Err(_) => {
            println!(
                "cargo:warning=no eBPF object at {}: the agent will refuse to run; build with `cargo xtask build`",
                obj.display()
            );
            fs::write(&out, []).unwrap();
        }
    }
}
