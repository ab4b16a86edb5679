//! The request log: every API request with its timing, for latency and ordering assertions.

use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// Arrival order (0-based).
    pub seq: u64,
    pub method: String,
    pub path: String,
    /// The raw query string (without `?`).
    pub query: String,
    pub content_type: Option<String>,
    /// The request body: parsed JSON when it is JSON, else a JSON string.
    pub body: Option<Value>,
    /// The response status; 0 for a dropped connection.
    pub status: u16,
    /// The fault applied, if any ("latency 200ms", "status 503", "drop").
    pub fault: Option<String>,
    pub watch: bool,
    pub user_agent: Option<String>,
    /// Wall-clock arrival time.
    pub at: SystemTime,
    /// Monotonic arrival time.
    pub instant: Instant,
    /// Arrival time since the double started.
    pub since_start: Duration,
    /// Time to produce the response head (for a watch: until the stream started).
    pub elapsed: Duration,
}

impl RequestRecord {
    /// The decoded value of a query parameter.
    pub fn query_param(&self, key: &str) -> Option<String> {
        form_urlencoded::parse(self.query.as_bytes())
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.into_owned())
    }

    pub fn to_json(&self) -> Value {
        let at = jiff::Timestamp::try_from(self.at)
            .map(|t| t.to_string())
            .unwrap_or_default();
        json!({
            "seq": self.seq,
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "contentType": self.content_type,
            "body": self.body,
            "status": self.status,
            "fault": self.fault,
            "watch": self.watch,
            "userAgent": self.user_agent,
            "at": at,
            "sinceStartMs": self.since_start.as_secs_f64() * 1000.0,
            "elapsedMs": self.elapsed.as_secs_f64() * 1000.0,
        })
    }
}
