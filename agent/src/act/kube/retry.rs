//! Retries with backoff for API calls: 409 (a concurrent writer; the call
//! re-reads), 429, 5xx and lost connections. Anything else fails at once.
use std::{future::Future, time::Duration};

const ATTEMPTS: u32 = 6;
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_secs(2);

pub(crate) fn retryable(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 409 || s.code == 429 || s.code >= 500,
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => true,
        _ => false,
    }
}

pub(crate) async fn retry<T, F, Fut>(what: &str, mut call: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut delay = FIRST_DELAY;
    let mut attempt = 1;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if attempt < ATTEMPTS && retryable(&e) => {
                tracing::warn!(what, attempt, error = %e, "API call failed; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_DELAY);
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}
