//! The observability endpoint: `/metrics` (Prometheus text), `/readyz` and
//! `/healthz`. hyper 1 (HTTP/1.1 only), one small task per connection.
//!
//! - `/readyz`: 200 `ok` once the agent is ready (hooks armed and, in cluster
//!   mode, the warm watches listed) and while no part it had is lost (the
//!   logind or systemd bus connection); else 503 with a one-line reason.
//! - `/healthz`: 200 while the main loop turns (it stamps a heartbeat every
//!   tick); 503 once the last stamp is older than the stall limit (30 s).
use std::{
    convert::Infallible,
    net::{IpAddr, SocketAddr},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use http_body_util::Full;
use hyper::{body::Bytes, header, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub(crate) use crate::health::Health;

/// Default ports: the agent's and the controller's.
pub(crate) const AGENT_PORT: u16 = 9850;
pub(crate) const CONTROLLER_PORT: u16 = 9851;

/// `--metrics-listen`: `ADDR:PORT`, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    Off,
    At(SocketAddr),
}

impl FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "off" {
            return Ok(Listen::Off);
        }
        s.parse::<SocketAddr>().map(Listen::At).map_err(|e| {
            format!("{e}: expected ADDR:PORT (e.g. 127.0.0.1:9850, [::1]:9850) or `off`")
        })
    }
}

/// Where to listen: the flag when given; else loopback in standalone mode,
/// and `$POD_IP` (the downward API) in cluster mode.
pub(crate) fn resolve(
    flag: Option<Listen>,
    standalone: bool,
    port: u16,
    pod_ip: Option<&str>,
) -> Result<Listen> {
    if let Some(l) = flag {
        return Ok(l);
    }
    if standalone {
        return Ok(Listen::At(SocketAddr::from(([127, 0, 0, 1], port))));
    }
    match pod_ip.filter(|s| !s.is_empty()) {
        Some(ip) => {
            let ip: IpAddr = ip
                .parse()
                .with_context(|| format!("$POD_IP is {ip:?}, not an IP address (or set --metrics-listen)"))?;
            Ok(Listen::At(SocketAddr::new(ip, port)))
        }
        None => bail!(
            "cluster mode serves /metrics, /readyz and /healthz on $POD_IP:{port}, but $POD_IP is not set: \
             set it from the downward API (status.podIP), or give --metrics-listen ADDR:PORT (or `off`)"
        ),
    }
}

/// Binds the listener (so that a bad address fails at start).
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("--metrics-listen {addr}: cannot listen there"))
}

fn text(code: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

const PLAIN: &str = "text/plain; charset=utf-8";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves until the task is dropped. `metrics` renders the registry.
pub(crate) fn serve<F>(
    listener: TcpListener,
    metrics: F,
    health: Arc<Health>,
) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let metrics = Arc::new(metrics);
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("metrics endpoint: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (metrics, health) = (metrics.clone(), health.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let resp = route(req.method(), req.uri().path(), &*metrics, &health);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

fn route(
    method: &hyper::Method,
    path: &str,
    metrics: &dyn Fn() -> String,
    health: &Health,
) -> Response<Full<Bytes>> {
    if method != hyper::Method::GET && method != hyper::Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into(), PLAIN);
    }
    let status = |r: Result<(), String>| match r {
        Ok(()) => text(StatusCode::OK, "ok\n".into(), PLAIN),
        Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"), PLAIN),
    };
    match path {
        "/metrics" => text(StatusCode::OK, metrics(), OPENMETRICS),
        "/readyz" => status(health.readiness()),
        "/healthz" | "/livez" => status(health.liveness()),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /metrics, /readyz, /healthz\n".into(),
            PLAIN,
        ),
    }
}

/// Binds `listen` (unless off), starts serving, and says where. `required`:
/// a bind failure is an error; otherwise it is logged and the endpoint is off.
pub(crate) async fn start<F>(
    listen: Listen,
    required: bool,
    metrics: F,
    health: Arc<Health>,
) -> Result<Option<(SocketAddr, tokio::task::JoinHandle<()>)>>
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let Listen::At(addr) = listen else {
        tracing::info!("metrics endpoint off (--metrics-listen off)");
        return Ok(None);
    };
    let listener = match bind(addr).await {
        Ok(l) => l,
        Err(e) if !required => {
            tracing::warn!("metrics endpoint off: {e:#}");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let local = listener.local_addr()?;
    tracing::info!(listen = %local, "serving /metrics, /readyz and /healthz");
    Ok(Some((local, serve(listener, metrics, health))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_flag_and_defaults() {
        assert_eq!("off".parse::<Listen>(), Ok(Listen::Off));
        assert_eq!(
            "10.0.0.1:9850".parse::<Listen>(),
            Ok(Listen::At("10.0.0.1:9850".parse().unwrap()))
        );
        assert!("localhost"
            .parse::<Listen>()
            .unwrap_err()
            .contains("ADDR:PORT"));
        assert_eq!(
            resolve(None, true, AGENT_PORT, Some("10.1.2.3")).unwrap(),
            Listen::At("127.0.0.1:9850".parse().unwrap())
        );
        assert_eq!(
            resolve(None, false, AGENT_PORT, Some("10.1.2.3")).unwrap(),
            Listen::At("10.1.2.3:9850".parse().unwrap())
        );
        assert_eq!(
            resolve(None, false, CONTROLLER_PORT, Some("fd00::5")).unwrap(),
            Listen::At("[fd00::5]:9851".parse().unwrap())
        );
        let e = resolve(None, false, AGENT_PORT, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("POD_IP") && e.contains("--metrics-listen"),
            "{e}"
        );
        assert!(resolve(None, false, AGENT_PORT, Some("node-1")).is_err());
        assert_eq!(
            resolve(Some(Listen::Off), false, AGENT_PORT, None).unwrap(),
            Listen::Off
        );
    }

    #[test]
    fn health() {
        let h = Health::new("arming the hooks");
        assert_eq!(h.readiness(), Err("arming the hooks".into()));
        h.ready();
        assert_eq!(h.readiness(), Ok(()));
        assert!(h.liveness().is_ok(), "alive while starting");
        assert_eq!(h.since_beat(), None);
        h.beat();
        assert!(h.liveness().is_ok());
        // A loop that stopped turning 31 s ago.
        let h2 = Health::stalled_for(Duration::from_secs(31));
        let why = h2.liveness().unwrap_err();
        assert!(why.contains("31s"), "{why}");
        let r = route(&hyper::Method::GET, "/healthz", &|| String::new(), &h2);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let r = route(&hyper::Method::GET, "/readyz", &|| String::new(), &h);
        assert_eq!(r.status(), StatusCode::OK);
        h.not_ready("the watches are down");
        let r = route(&hyper::Method::GET, "/readyz", &|| String::new(), &h);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let r = route(&hyper::Method::GET, "/metrics", &|| "x 1\n".into(), &h);
        assert_eq!(r.status(), StatusCode::OK);
    }
}
