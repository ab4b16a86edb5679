//! The API server client the agent, the controller and the tools share:
//! its settings (no retries inside kube, short timeouts), and a watch kept
//! warm in the background.
use std::time::Duration;

use anyhow::{Context, Result};
use kube::{
    runtime::{reflector, reflector::Store, watcher, WatchStreamExt},
    Api,
};

/// How long a client may wait on the API server: watches hold their
/// requests open for minutes; every other request is short, and bounded.
#[derive(Clone, Copy)]
pub enum Use {
    Watch,
    Requests,
}

pub async fn client(usage: Use, server: Option<&str>) -> anyhow::Result<kube::Client> {
    let mut config = kube::Config::infer()
        .await
        .context("no Kubernetes configuration (in-cluster or $KUBECONFIG)")?;
    if let Some(url) = server {
        // Only the address changes: the credentials stay the agent's own.
        config.cluster_url = url.parse().with_context(|| format!("apiServer: {url}"))?;
    }
    tune(&mut config, usage);
    Ok(kube::Client::try_from(config)?)
}

/// The agent's client settings on any configuration (tests use them with
/// their own credentials): no retries inside kube (a 429 from a budget must
/// come back to the graceful path at once; `retry` decides), short timeouts.
pub fn tune(config: &mut kube::Config, usage: Use) {
    config.default_retry = false;
    config.connect_timeout = Some(Duration::from_secs(3));
    config.write_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(match usage {
        // The watcher asks for 290 s windows; kube's own default is 295 s.
        Use::Watch => Duration::from_secs(295),
        Use::Requests => Duration::from_secs(10),
    });
}

/// A reflector store kept up to date by a watch in the background (with
/// backoff on errors); returns once the first list is in.
pub async fn warm_store<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    trim: fn(&mut K),
) -> Result<Store<K>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config).modify(trim))
        .default_backoff()
        .touched_objects();
    tokio::spawn(async move {
        use futures::StreamExt;
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                tracing::warn!(error = %e, "{what} watch");
            }
        }
    });
    store
        .wait_until_ready()
        .await
        .with_context(|| format!("the {what} watch ended before its first list"))?;
    Ok(store)
}
