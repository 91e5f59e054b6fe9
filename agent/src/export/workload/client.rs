//! The two requests the agent makes of the Kubernetes API: list the node's
//! pods, and watch them from a resource version. A hand-written reqwest
//! client, not kube-rs: these two GETs are all it needs, and kube-rs (with
//! k8s-openapi's generated types) would add minutes to a build that CI
//! cannot spare.
use std::{sync::Mutex, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{pods::PodList, source::ServiceAccount};

/// How long connecting, or a whole list, may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the API server keeps one watch open (`timeoutSeconds`); the
/// watch is then opened again from where it was.
pub(super) const WATCH_SECONDS: u64 = 290;

/// The API server the node's pods are asked of.
pub(super) struct Api {
    base: String,
    node: Option<String>,
    account: Option<ServiceAccount>,
    /// Built at start for `http://`; for a service account, at the first
    /// request that can read its CA (a late mount is picked up).
    client: Mutex<Option<reqwest::Client>>,
}

impl Api {
    pub(super) fn new(base: String, node: Option<String>, account: Option<ServiceAccount>) -> Result<Self> {
        let client = match &account {
            None => Some(builder().build().context("building the Kubernetes API client")?),
            Some(_) => None,
        };
        Ok(Self { base, node, account, client: Mutex::new(client) })
    }

    pub(super) fn base(&self) -> &str {
        &self.base
    }

    /// The node's pods now.
    pub(super) async fn list(&self) -> Result<PodList> {
        let response = self.get(self.url(&[])?, LIST_TIMEOUT, "listing").await?;
        let body = response.bytes().await.with_context(|| format!("reading the pod list from {}", self.base))?;
        serde_json::from_slice(&body).with_context(|| format!("the pod list from {} is not a PodList", self.base))
    }

    /// The node's pods' changes since `version`, as a response whose body
    /// is one JSON event after another, until the server ends it.
    pub(super) async fn watch(&self, version: &str) -> Result<reqwest::Response> {
        let seconds = WATCH_SECONDS.to_string();
        let query = [
            ("watch", "true"),
            ("resourceVersion", version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", seconds.as_str()),
        ];
        // The server ends the watch first; past that, the stream is dead.
        self.get(self.url(&query)?, Duration::from_secs(WATCH_SECONDS + 15), "watching").await
    }

    /// `/api/v1/pods` with this node's field selector first, then `query`.
    fn url(&self, query: &[(&str, &str)]) -> Result<reqwest::Url> {
        let mut url = reqwest::Url::parse(&format!("{}/api/v1/pods", self.base))
            .with_context(|| format!("--kubernetes {}: not a URL", self.base))?;
        {
            let mut pairs = url.query_pairs_mut();
            if let Some(node) = &self.node {
                pairs.append_pair("fieldSelector", &format!("spec.nodeName={node}"));
            }
            pairs.extend_pairs(query);
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        Ok(url)
    }

    /// A GET with the service account's token, its error saying what to do.
    async fn get(&self, url: reqwest::Url, timeout: Duration, doing: &str) -> Result<reqwest::Response> {
        let base = &self.base;
        let mut request = self.client()?.get(url).timeout(timeout);
        if let Some(account) = &self.account {
            // Marked sensitive by reqwest: never in a debug print.
            request = request.bearer_auth(account.token()?);
        }
        let response = request.send().await.with_context(|| match &self.account {
            Some(account) => {
                format!(
                    "{doing} pods at {base} (its certificate is checked against {} alone)",
                    account.ca_path().display()
                )
            }
            None => format!("{doing} pods at {base}: is the API (kubectl proxy) up?"),
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = response.bytes().await.unwrap_or_default();
        let hint = match (status.as_u16(), &self.account) {
            (401, Some(account)) => format!(
                ": the API server did not accept the token in {} (expired, or another cluster's; it is read \
                 again before every request)",
                account.token_path().display()
            ),
            (403, _) => ": the service account may not list and watch pods (agent/deploy/base/rbac.yaml \
                         binds a ClusterRole that may)"
                .to_owned(),
            _ => String::new(),
        };
        bail!("{doing} pods at {base}: {status}{hint}: {}", String::from_utf8_lossy(&body[..body.len().min(200)]));
    }

    /// The client; for a service account, built on first use from its CA
    /// and kept.
    fn client(&self) -> Result<reqwest::Client> {
        let mut client = self.client.lock().map_err(|_| anyhow::anyhow!("the API client's lock is poisoned"))?;
        if let Some(client) = client.as_ref() {
            return Ok(client.clone());
        }
        let account = self.account.as_ref().context("no Kubernetes API client")?;
        Ok(client.insert(account.client(builder())?).clone())
    }

    /// A client for plain `http://` in place of the service account's
    /// `https://` one, in tests of what is sent.
    #[cfg(test)]
    pub(super) fn plain(base: String, node: Option<String>, account: Option<ServiceAccount>) -> Self {
        crate::util::tls::install_ring();
        Self { base, node, account, client: Mutex::new(Some(reqwest::Client::new())) }
    }
}

fn builder() -> reqwest::ClientBuilder {
    crate::util::tls::install_ring();
    reqwest::Client::builder().connect_timeout(LIST_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local HTTP server answering `status` with `body` to each of `n`
    /// requests; the `Authorization` header of each.
    fn serve(n: usize, status: &'static str, body: String) -> (u16, std::thread::JoinHandle<Vec<String>>) {
        use std::io::{BufRead as _, BufReader, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for stream in listener.incoming().take(n) {
                let mut stream = stream.expect("accept");
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut auth = String::new();
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    if let Some(value) = line.strip_prefix("authorization: ") {
                        auth = value.trim().to_owned();
                    }
                    line.clear();
                }
                seen.push(auth);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
            seen
        });
        (port, server)
    }

    #[tokio::test]
    async fn the_token_is_read_again_for_every_request() {
        let dir = tempfile::tempdir().expect("temp dir");
        let account = ServiceAccount { dir: dir.path().into() };
        let (port, server) = serve(2, "200 OK", serde_json::json!({"kind": "PodList", "items": []}).to_string());
        // The https client would refuse this plain server: a plain one in
        // its place, as the token is what is tested.
        let api = Api::plain(format!("http://127.0.0.1:{port}"), None, Some(account.clone()));

        let missing = format!("{:#}", api.list().await.err().expect("no token yet"));
        assert!(missing.contains("token") && missing.contains("automountServiceAccountToken"), "{missing}");
        std::fs::write(account.token_path(), "first\n").expect("token");
        api.list().await.expect("first list");
        // The kubelet rotates the projected token by replacing the file.
        std::fs::write(account.token_path(), "second").expect("rotated token");
        api.list().await.expect("second list");
        assert_eq!(server.join().expect("server"), ["Bearer first", "Bearer second"]);
    }

    #[tokio::test]
    async fn a_refused_token_says_which_file_it_came_from() {
        let dir = tempfile::tempdir().expect("temp dir");
        let account = ServiceAccount { dir: dir.path().into() };
        std::fs::write(account.token_path(), "stale").expect("token");
        let (port, server) = serve(1, "401 Unauthorized", r#"{"kind":"Status","code":401}"#.to_owned());
        let api = Api::plain(format!("http://127.0.0.1:{port}"), None, Some(account.clone()));
        let err = format!("{:#}", api.list().await.err().expect("401"));
        assert!(err.contains("401 Unauthorized") && err.contains(&account.token_path().display().to_string()), "{err}");
        server.join().expect("server");
    }

    #[test]
    fn the_urls_select_the_node_and_resume_from_a_version() {
        let api = Api::plain("http://127.0.0.1:8001".into(), Some("gpu-1".into()), None);
        assert_eq!(
            api.url(&[]).expect("list").as_str(),
            "http://127.0.0.1:8001/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-1"
        );
        let watch = api.url(&[("watch", "true"), ("resourceVersion", "12")]).expect("watch");
        assert_eq!(watch.query(), Some("fieldSelector=spec.nodeName%3Dgpu-1&watch=true&resourceVersion=12"));
        let every = Api::plain("http://127.0.0.1:8001".into(), None, None);
        assert_eq!(every.url(&[]).expect("list").as_str(), "http://127.0.0.1:8001/api/v1/pods");
    }
}
