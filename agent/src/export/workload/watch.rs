//! Keeping the node's pods up to date: list them, then watch them from the
//! list's resource version (`watch=true`), as client-go's reflector does, so
//! a pod is known as soon as the API server says so rather than at the next
//! list. A watch the server ends is opened again from the last version
//! seen; one that fails, after a backoff; 410 Gone (the version compacted
//! away) lists again. Each distinct failure is said once, with its cause.
use std::{
    hash::{BuildHasher as _, RandomState},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use tracing::{debug, info, warn};

use super::{
    client::Api,
    pods::{Applied, Pods, WatchEvent},
};

/// The first wait after a failure; doubled at each failure after it.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The longest watch event kept while it arrives (a pod is a few KiB).
const MAX_EVENT: usize = 16 << 20;

/// What the lookups share with the watch: the pods, a counter bumped at
/// each change (lookups wait on it), the lists made, and the last failure.
#[derive(Clone)]
pub(super) struct Shared {
    pub pods: Arc<Mutex<Pods>>,
    pub changes: tokio::sync::watch::Sender<u64>,
    lists: Arc<AtomicU64>,
    pub failing: Arc<Mutex<Option<String>>>,
}

impl Shared {
    pub(super) fn new() -> Self {
        let changes = tokio::sync::watch::Sender::new(0);
        Self { pods: Arc::default(), changes, lists: Arc::default(), failing: Arc::default() }
    }

    pub(super) fn lists(&self) -> u64 {
        self.lists.load(Ordering::Relaxed)
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// Said once per distinct failure (a retry that fails the same way is
    /// a debug line), so a down API server is one warning, not one a retry.
    fn failed(&self, err: &anyhow::Error, retry: Duration) {
        let text = format!("{err:#}");
        let Ok(mut failing) = self.failing.lock() else { return };
        if failing.as_deref() == Some(text.as_str()) {
            debug!("workload identity: {text}; again in {retry:?}");
        } else {
            warn!("workload identity: {text}; trying again with backoff (first in {retry:?})");
            *failing = Some(text);
        }
    }

    fn recovered(&self, api: &Api, pods: usize) {
        if let Ok(mut failing) = self.failing.lock() {
            if failing.take().is_some() {
                info!(pods, "workload identity: the pods at {} are listed again", api.base());
            }
        }
    }
}

/// Doubling waits from [`FIRST_BACKOFF`] to [`MAX_BACKOFF`], each with up
/// to a quarter more at random, so the agents of a fleet that lost the API
/// server together do not come back to it together.
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Self { next: FIRST_BACKOFF }
    }

    fn reset(&mut self) {
        self.next = FIRST_BACKOFF;
    }

    fn next(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(MAX_BACKOFF);
        let quarter = u64::try_from(wait.as_millis() / 4).unwrap_or(1).max(1);
        wait + Duration::from_millis(RandomState::new().hash_one(wait) % quarter)
    }
}

/// How a watch ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The server closed it (its `timeoutSeconds`): open it again; at
    /// once if it carried anything, else after a backoff (a proxy that
    /// ends every watch at once would otherwise be asked in a busy loop).
    Closed,
    /// 410 Gone: list again (after a backoff).
    Gone,
}

/// List, then watch, forever (the task ends with the agent).
pub(super) async fn run(api: Api, shared: Shared) {
    let mut backoff = Backoff::new();
    loop {
        let version = match list(&api, &shared).await {
            Ok(version) => version,
            Err(err) => {
                let wait = backoff.next();
                shared.failed(&err, wait);
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        let Some(mut version) = version else {
            shared.failed(
                &anyhow::anyhow!("the pod list from {} has no resourceVersion to watch from", api.base()),
                MAX_BACKOFF,
            );
            tokio::time::sleep(MAX_BACKOFF).await;
            continue;
        };
        loop {
            // Backoff starts over only once a watch carried something: a
            // list that works before a watch that does not (or one gone at
            // once, again and again) is no reason to ask at once again.
            let mut carried = false;
            let ended = watch(&api, &shared, &version, &mut carried).await;
            if carried {
                backoff.reset();
            }
            match ended {
                Ok(Ended::Closed) if carried => {}
                Ok(Ended::Closed) => tokio::time::sleep(backoff.next()).await,
                Ok(Ended::Gone) => {
                    debug!("workload identity: the watch's resource version {version} is gone; listing again");
                    tokio::time::sleep(backoff.next()).await;
                    break;
                }
                Err(err) => {
                    let wait = backoff.next();
                    shared.failed(&err, wait);
                    tokio::time::sleep(wait).await;
                }
            }
            match shared.pods.lock().ok().and_then(|pods| pods.resource_version().map(str::to_owned)) {
                Some(last) => version = last,
                None => break,
            }
        }
    }
}

/// One list, in place of every pod known: its resource version.
async fn list(api: &Api, shared: &Shared) -> Result<Option<String>> {
    let list = api.list().await?;
    let (pods, version) = {
        let mut pods = shared.pods.lock().map_err(|_| anyhow::anyhow!("the pods' lock is poisoned"))?;
        pods.replace(list);
        (pods.len(), pods.resource_version().map(str::to_owned))
    };
    shared.lists.fetch_add(1, Ordering::Relaxed);
    shared.changed();
    shared.recovered(api, pods);
    debug!(pods, version, "listed the node's pods");
    Ok(version)
}

/// One watch from `version`, its events applied as they come; `carried`:
/// whether the server sent anything.
async fn watch(api: &Api, shared: &Shared, version: &str, carried: &mut bool) -> Result<Ended> {
    let mut response = api.watch(version).await?;
    let mut events = Events::default();
    while let Some(chunk) = response.chunk().await.with_context(|| format!("watching pods at {}", api.base()))? {
        if !*carried {
            // The server took the version: the API is reachable again.
            shared.recovered(api, shared.pods.lock().map_or(0, |pods| pods.len()));
            *carried = true;
        }
        let parsed = events.push(&chunk).with_context(|| format!("watching pods at {}", api.base()))?;
        if parsed.is_empty() {
            continue;
        }
        let applied = {
            let mut pods = shared.pods.lock().map_err(|_| anyhow::anyhow!("the pods' lock is poisoned"))?;
            parsed.into_iter().map(|event| pods.apply(event)).collect::<Result<Vec<_>>>()
        };
        shared.changed();
        for applied in applied.with_context(|| format!("watching pods at {}", api.base()))? {
            match applied {
                Applied::Changed => {}
                Applied::Gone => return Ok(Ended::Gone),
                Applied::Failed(status) => bail!("watching pods at {}: {status}", api.base()),
            }
        }
    }
    Ok(Ended::Closed)
}

/// A watch's body cut into events: JSON objects one after another
/// (newline-separated by the API server), split across chunks anywhere.
#[derive(Default)]
struct Events {
    pending: Vec<u8>,
}

impl Events {
    /// The events that `chunk` completes.
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<WatchEvent>> {
        self.pending.extend_from_slice(chunk);
        let mut stream = serde_json::Deserializer::from_slice(&self.pending).into_iter::<WatchEvent>();
        let mut events = Vec::new();
        let mut used = 0;
        loop {
            match stream.next() {
                Some(Ok(event)) => {
                    events.push(event);
                    used = stream.byte_offset();
                }
                Some(Err(err)) if err.is_eof() => break,
                Some(Err(err)) => return Err(err).context("a watch event that is not JSON"),
                None => {
                    used = stream.byte_offset();
                    break;
                }
            }
        }
        self.pending.drain(..used);
        if self.pending.len() > MAX_EVENT {
            bail!("a watch event longer than {} MiB", MAX_EVENT >> 20);
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::{BufRead as _, BufReader, Write as _},
        net::TcpListener,
    };

    use serde_json::json;

    use super::{
        super::pods::tests::{ID, UID, pod},
        *,
    };
    use crate::export::workload::Workload;

    #[test]
    fn events_split_anywhere_are_put_back_together() {
        let line = |kind: &str, version: u32| {
            format!("{}\n", json!({"type": kind, "object": pod(UID, version, Some(ID), json!({}))}))
        };
        let body = format!("{}{}", line("ADDED", 2), line("MODIFIED", 3));
        for cut in [1, 17, body.len() / 2, body.len() - 1] {
            let mut events = Events::default();
            let first = events.push(&body.as_bytes()[..cut]).expect("first part");
            let rest = events.push(&body.as_bytes()[cut..]).expect("second part");
            assert_eq!(first.len() + rest.len(), 2, "cut at {cut}");
            assert!(events.pending.is_empty());
        }
        let err = format!("{:#}", Events::default().push(b"{\"type\": oops}").err().expect("not JSON"));
        assert!(err.contains("not JSON"), "{err}");
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over() {
        let mut backoff = Backoff::new();
        let waits: Vec<Duration> = (0..10).map(|_| backoff.next()).collect();
        assert!(waits[0] >= FIRST_BACKOFF && waits[0] < FIRST_BACKOFF * 5 / 4, "{waits:?}");
        assert!(waits[1] >= FIRST_BACKOFF * 2, "{waits:?}");
        assert!(waits[9] >= MAX_BACKOFF && waits[9] <= MAX_BACKOFF * 5 / 4, "{waits:?}");
        backoff.reset();
        assert!(backoff.next() < FIRST_BACKOFF * 5 / 4);
    }

    /// An API server stand-in that answers its requests in order with
    /// `answers` (bodies without a length, ended by closing the
    /// connection, as a watch's), the last one held open; the request
    /// lines.
    fn script(answers: Vec<String>) -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::clone(&seen);
        std::thread::spawn(move || {
            let last = answers.len() - 1;
            let mut held = None;
            for (n, (stream, answer)) in listener.incoming().zip(answers).enumerate() {
                let mut stream = stream.expect("accept");
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut line = String::new();
                reader.read_line(&mut line).expect("request line");
                let mut header = String::new();
                while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                    header.clear();
                }
                seen.lock().expect("lock").push(line.trim().to_owned());
                let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{answer}");
                // Every answer but the last ends with its connection.
                if n == last {
                    held = Some(stream);
                }
            }
            std::thread::park();
            drop(held);
        });
        (base, requests)
    }

    fn line(kind: &str, object: serde_json::Value) -> String {
        format!("{}\n", json!({"type": kind, "object": object}))
    }

    #[tokio::test]
    async fn a_watch_adds_pods_and_410_gone_lists_again() {
        let list = |version: u32, items: Vec<serde_json::Value>| {
            json!({"kind": "PodList", "metadata": {"resourceVersion": version.to_string()}, "items": items}).to_string()
        };
        let other = "0b6c5a4e-0000-4a3b-9c8d-7e6f5a4b3c2d";
        let gone = json!({"kind": "Status", "code": 410, "message": "too old resource version: 2 (40)"});
        let (base, requests) = script(vec![
            list(2, vec![]),
            // A pod added, then the version compacted away.
            line("ADDED", pod(UID, 3, Some(ID), json!({}))) + &line("ERROR", gone),
            // The list again has it, and another: the watch goes on from it.
            list(41, vec![pod(UID, 3, Some(ID), json!({})), pod(other, 40, None, json!({}))]),
            String::new(),
        ]);
        let shared = Shared::new();
        let mut changes = shared.changes.subscribe();
        tokio::spawn(run(Api::plain(base, Some("gpu-1".into()), None), shared.clone()));
        let ids = |uid: &str| Workload { pod_uid: Some(uid.into()), ..Workload::default() };
        let known = |uid: &str| shared.pods.lock().expect("lock").find(&ids(uid)).is_some();
        tokio::time::timeout(Duration::from_secs(10), async {
            while !(known(UID) && known(other)) {
                changes.changed().await.expect("the watch runs");
            }
        })
        .await
        .expect("both pods within 10 s");
        let path = |query: &str| format!("GET /api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-1{query} HTTP/1.1");
        let watch = |version: u32| {
            path(&format!("&watch=true&resourceVersion={version}&allowWatchBookmarks=true&timeoutSeconds=290"))
        };
        // The second watch resumes from the second list's version.
        let asked = || requests.lock().expect("lock").clone();
        tokio::time::timeout(Duration::from_secs(10), async {
            while asked().len() < 4 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no second watch: {:?}", asked()));
        assert_eq!(asked(), [path(""), watch(2), path(""), watch(41)]);
        assert_eq!(shared.failing.lock().expect("lock").as_deref(), None, "410 is no failure");
    }
}
