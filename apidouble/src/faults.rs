//! Fault injection: latency, N× a status code, N× a dropped connection,
//! matched by HTTP method and path (prefix or regex).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a fault does to a matching request.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// Delay the response (the request is then served normally, or by another fault).
    Latency(Duration),
    /// Answer with this status code and a `metav1.Status` body instead of serving the request.
    Status { code: u16, retry_after: Option<u32> },
    /// Close the connection without answering.
    Drop,
}

#[derive(Debug, Clone)]
enum PathMatch {
    Any,
    Prefix(String),
    Regex(regex_lite::Regex),
}

/// A fault rule. Build with [`Fault::latency`], [`Fault::status`] or [`Fault::drop`], then narrow it.
#[derive(Debug, Clone)]
pub struct Fault {
    pub(crate) method: Option<String>,
    path: PathMatch,
    pub(crate) kind: FaultKind,
    /// How many requests it applies to (`None`: all).
    pub(crate) times: Option<u32>,
}

/// Handle to remove an injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FaultId(pub u64);

impl Fault {
    pub fn new(kind: FaultKind) -> Self {
        Self {
            method: None,
            path: PathMatch::Any,
            kind,
            times: None,
        }
    }

    pub fn latency(d: Duration) -> Self {
        Self::new(FaultKind::Latency(d))
    }

    /// Answer `code` (e.g. 500, 503, 429); applies once unless [`Fault::times`] says otherwise.
    pub fn status(code: u16) -> Self {
        Self {
            times: Some(1),
            ..Self::new(FaultKind::Status {
                code,
                retry_after: None,
            })
        }
    }

    /// Drop the connection without an answer; applies once unless [`Fault::times`] says otherwise.
    pub fn drop_connection() -> Self {
        Self {
            times: Some(1),
            ..Self::new(FaultKind::Drop)
        }
    }

    /// Only for this HTTP method (`GET`, `PATCH`, ...).
    pub fn method(mut self, m: &str) -> Self {
        self.method = Some(m.to_ascii_uppercase());
        self
    }

    /// Only for paths starting with `p` (the query is not part of the path).
    pub fn path_prefix(mut self, p: &str) -> Self {
        self.path = PathMatch::Prefix(p.into());
        self
    }

    /// Only for paths matching the regex.
    pub fn path_regex(mut self, re: &str) -> Result<Self, regex_lite::Error> {
        self.path = PathMatch::Regex(regex_lite::Regex::new(re)?);
        Ok(self)
    }

    /// Apply to the next `n` matching requests only.
    pub fn times(mut self, n: u32) -> Self {
        self.times = Some(n);
        self
    }

    /// Apply to every matching request.
    pub fn always(mut self) -> Self {
        self.times = None;
        self
    }

    /// `Retry-After` (seconds) for a status fault.
    pub fn retry_after(mut self, secs: u32) -> Self {
        if let FaultKind::Status { retry_after, .. } = &mut self.kind {
            *retry_after = Some(secs);
        }
        self
    }

    pub(crate) fn matches(&self, method: &str, path: &str) -> bool {
        if self.times == Some(0) {
            return false;
        }
        if let Some(m) = &self.method {
            if m != method {
                return false;
            }
        }
        match &self.path {
            PathMatch::Any => true,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            PathMatch::Regex(r) => r.is_match(path),
        }
    }

    pub(crate) fn describe(&self) -> String {
        match &self.kind {
            FaultKind::Latency(d) => format!("latency {}ms", d.as_millis()),
            FaultKind::Status { code, .. } => format!("status {code}"),
            FaultKind::Drop => "drop".into(),
        }
    }
}

/// The JSON form accepted by `POST /_double/faults`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultSpec {
    pub method: Option<String>,
    pub path_prefix: Option<String>,
    pub path_regex: Option<String>,
    pub latency_ms: Option<u64>,
    pub status: Option<u16>,
    pub retry_after: Option<u32>,
    #[serde(default)]
    pub drop: bool,
    pub times: Option<u32>,
}

impl FaultSpec {
    pub fn into_fault(self) -> Result<Fault, String> {
        let mut f = match (self.latency_ms, self.status, self.drop) {
            (Some(ms), None, false) => Fault::latency(Duration::from_millis(ms)),
            (None, Some(code), false) => Fault::status(code),
            (None, None, true) => Fault::drop_connection(),
            _ => return Err("exactly one of latencyMs, status, drop must be given".into()),
        };
        if let Some(m) = self.method {
            f = f.method(&m);
        }
        if let Some(p) = self.path_prefix {
            f = f.path_prefix(&p);
        }
        if let Some(r) = self.path_regex {
            f = f.path_regex(&r).map_err(|e| e.to_string())?;
        }
        if let Some(ra) = self.retry_after {
            f = f.retry_after(ra);
        }
        f.times = match self.times {
            Some(n) => Some(n),
            None if matches!(f.kind, FaultKind::Latency(_)) => None,
            None => Some(1),
        };
        Ok(f)
    }
}
