//! Embeds the eBPF object that `cargo xtask build` builds (agent-ebpf, with
//! the pinned nightly and bpf-linker). Without it the build fails and says
//! how to make it: an agent without its programs cannot run.
use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=LASTGASP_EBPF_OBJ");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../target"));
    let obj = env::var_os("LASTGASP_EBPF_OBJ")
        .map(PathBuf::from)
        .unwrap_or_else(|| target.join("ebpf/bpfel-unknown-none/release/lastgasp"));
    println!("cargo:rerun-if-changed={}", obj.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("lastgasp.bpf.o");
    match fs::read(&obj) {
        Ok(bytes) if !bytes.is_empty() => fs::write(&out, bytes).unwrap(),
        Ok(_) | Err(_) => {
            eprintln!(
                "error: no eBPF object at {}\n\
                 The agent embeds its eBPF programs. Build them (and the agent) with:\n\
                 \n    cargo xtask build\n\n\
                 or point LASTGASP_EBPF_OBJ at an object built from agent-ebpf.",
                obj.display()
            );
            std::process::exit(1);
        }
    }
}
