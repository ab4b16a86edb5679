//! The observability endpoint: `/metrics` (Prometheus text), `/readyz` and
//! `/healthz`. hyper 1 (HTTP/1.1 only), one small task per connection.
//!
//! The port is reachable from every pod (the agent runs on the node's
//! network), so each connection is bounded: its request head within
//! `HEAD_TIMEOUT` and `MAX_BUF` bytes, its whole life within
//! `CONN_LIFETIME`; at most `PER_PEER` connections per peer address and
//! `MAX_CONNS` in all. To make room the oldest connection that has not yet
//! sent a whole request head is closed: a probe's request is whole at once,
//! a slow attacker's never is.
//!
//! - `/readyz`: 200 `ok` once the agent is ready (hooks armed and, in cluster
//!   mode, the warm watches listed); `ok, degraded: ...` while a bus part it
//!   had (logind, its delay lock, systemd) is lost, or 503 with
//!   `--unready-unless-armed`; else 503 with a one-line reason.
//! - `/healthz`: 200 while the main loop turns (it stamps a heartbeat every
//!   tick); 503 once the last stamp is older than the stall limit (30 s).
use std::{
    convert::Infallible,
    net::{IpAddr, SocketAddr},
    str::FromStr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{bail, Context, Result};
use http_body_util::Full;
use hyper::{body::Bytes, header, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, task::AbortHandle};

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
    let listen = || -> std::io::Result<TcpListener> {
        let sock = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        sock.set_reuseaddr(true)?;
        sock.bind(addr)?;
        // A deep accept queue: a peer opening connections as fast as it can
        // must not make a probe's SYN wait for a retransmit.
        sock.listen(4096)
    };
    listen().with_context(|| format!("--metrics-listen {addr}: cannot listen there"))
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

/// Per-connection limits (see the module's comment).
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
const CONN_LIFETIME: Duration = Duration::from_secs(30);
/// hyper's smallest read buffer: a longer head is answered 431 and closed.
const MAX_BUF: usize = 8192;
const MAX_CONNS: usize = 128;
const PER_PEER: usize = 16;

/// One connection: its peer, whether a whole request head came, its task.
struct Conn {
    peer: IpAddr,
    asked: Arc<AtomicBool>,
    task: AbortHandle,
}

/// The connections alive, oldest first.
#[derive(Default)]
struct Conns(std::collections::VecDeque<Conn>);

impl Conns {
    /// Makes room for one more from `peer`: one of its own beyond
    /// `PER_PEER - 1`, then any beyond `MAX_CONNS - 1`, closed.
    fn admit(&mut self, peer: IpAddr) {
        self.0.retain(|c| !c.task.is_finished());
        if self.0.iter().filter(|c| c.peer == peer).count() >= PER_PEER {
            self.close_one(|c| c.peer == peer);
        }
        while self.0.len() >= MAX_CONNS {
            self.close_one(|_| true);
        }
    }

    /// Closes the oldest of `which` still waiting for its request head, or
    /// else the oldest of `which`.
    fn close_one(&mut self, which: impl Fn(&Conn) -> bool) {
        let i = self
            .0
            .iter()
            .position(|c| which(c) && !c.asked.load(Ordering::Relaxed))
            .or_else(|| self.0.iter().position(&which));
        if let Some(c) = i.and_then(|i| self.0.remove(i)) {
            c.task.abort();
        }
    }
}

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
        let mut conns = Conns::default();
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of fds, most likely: wait rather than spin.
                    tracing::warn!(error = %e, "metrics endpoint: accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            conns.admit(peer.ip());
            let (metrics, health) = (metrics.clone(), health.clone());
            let asked = Arc::new(AtomicBool::new(false));
            let flag = asked.clone();
            let task = tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    flag.store(true, Ordering::Relaxed);
                    let resp = route(req.method(), req.uri().path(), &*metrics, &health);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .max_buf_size(MAX_BUF)
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), svc);
                let _ = tokio::time::timeout(CONN_LIFETIME, conn).await;
            });
            conns.0.push_back(Conn {
                peer: peer.ip(),
                asked,
                task: task.abort_handle(),
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
    let status = |r: Result<String, String>| match r {
        Ok(body) => text(StatusCode::OK, format!("{body}\n"), PLAIN),
        Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"), PLAIN),
    };
    match path {
        "/metrics" => text(StatusCode::OK, metrics(), OPENMETRICS),
        "/readyz" => status(health.readiness()),
        "/healthz" | "/livez" => status(health.liveness().map(|()| "ok".into())),
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
            tracing::warn!(error = format!("{e:#}"), "metrics endpoint off");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let local = listener.local_addr()?;
    tracing::info!(listen = %local, "serving /metrics, /readyz and /healthz");
    Ok(Some((local, serve(listener, metrics, health))))
}

/// `lastgasp_build_info{version, component}` = 1 in `r`.
pub(crate) fn register_build_info(r: &mut prometheus_client::registry::Registry, component: &str) {
    let info = prometheus_client::metrics::family::Family::<
        Vec<(String, String)>,
        prometheus_client::metrics::gauge::Gauge,
    >::default();
    info.get_or_create(&vec![
        ("version".into(), env!("CARGO_PKG_VERSION").into()),
        ("component".into(), component.into()),
    ])
    .set(1);
    r.register(
        "lastgasp_build_info",
        "The running binary's version and component (agent or controller), always 1",
        info,
    );
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

    #[tokio::test]
    async fn room_is_made_by_closing_the_oldest_that_never_asked() {
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut conns = Conns::default();
        let add = |conns: &mut Conns, peer: IpAddr, asked: bool| {
            conns.admit(peer);
            let t = tokio::spawn(std::future::pending::<()>());
            conns.0.push_back(Conn {
                peer,
                asked: Arc::new(AtomicBool::new(asked)),
                task: t.abort_handle(),
            });
            t
        };
        // A probe that asked, then a peer's flood of silent connections.
        let probe = add(&mut conns, a, true);
        let silent: Vec<_> = (0..PER_PEER + 3)
            .map(|_| add(&mut conns, a, false))
            .collect();
        tokio::task::yield_now().await;
        assert!(!probe.is_finished(), "the probe that asked stays");
        assert!(
            silent[..4].iter().all(tokio::task::JoinHandle::is_finished),
            "the oldest silent ones went"
        );
        assert_eq!(
            conns
                .0
                .iter()
                .filter(|c| c.peer == a && !c.task.is_finished())
                .count(),
            PER_PEER
        );
        // Others are admitted beside it, up to the total.
        for _ in 0..MAX_CONNS {
            add(&mut conns, b, false);
        }
        tokio::task::yield_now().await;
        conns.admit(b);
        assert!(conns.0.len() < MAX_CONNS, "{}", conns.0.len());
        assert!(!probe.is_finished(), "the probe that asked stays");
    }

    #[test]
    fn health() {
        let h = Health::new("arming the hooks");
        assert_eq!(h.readiness(), Err("arming the hooks".into()));
        h.ready();
        assert_eq!(h.readiness(), Ok("ok".into()));
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
