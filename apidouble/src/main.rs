//! `lastgasp-apidouble --listen 127.0.0.1:PORT [--objects FILE.json]`
//!
//! Serves the Kubernetes API double until SIGINT/SIGTERM. FILE is a JSON
//! object, a JSON array of objects, or a `List` with `items`.
#![warn(clippy::too_many_lines)]

use std::net::SocketAddr;

use anyhow::{bail, Context};
use lastgasp_apidouble::ApiDouble;

fn usage() -> ! {
    eprintln!("usage: lastgasp-apidouble [--listen 127.0.0.1:PORT] [--objects FILE.json]");
    std::process::exit(2)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let mut listen: SocketAddr = "127.0.0.1:0".parse()?;
    let mut objects = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => {
                listen = args
                    .next()
                    .unwrap_or_else(|| usage())
                    .parse()
                    .context("--listen")?;
            }
            "--objects" => objects = Some(args.next().unwrap_or_else(|| usage())),
            "-h" | "--help" => usage(),
            other => bail!("unknown argument {other}"),
        }
    }
    if !listen.ip().is_loopback() {
        bail!("--listen must be a loopback address (got {listen})");
    }
    let double = ApiDouble::start_on(listen).await?;
    if let Some(path) = objects {
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {path} as JSON"))?;
        let n = double
            .create_all(v)
            .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
            .len();
        tracing::info!(objects = n, "seeded");
    }
    // The harness reads this line to learn the address.
    println!("listening on {}", double.url());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
