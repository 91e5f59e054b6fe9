//! The agent's side: the unix socket, its file, and the connections.
//!
//! The event loop owns the engine, so the only work done there is taking
//! the snapshot ([`QueryServer::answer`]: a copy of every tracked request,
//! O(in flight)). Reading the query, sorting, serializing (on a blocking
//! thread) and writing the answer happen on per-connection tasks, so a slow
//! or stuck reader holds its own memory and nothing else.
use std::{
    collections::HashMap,
    io::ErrorKind,
    os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};
use tracing::{debug, info, warn};

use super::wire::{self, QueryKind, Snapshot};
use crate::{
    evidence::transport::Tracker,
    export::workload::Directory,
    frameworks::signals::Signals,
    lifecycle::{Engine, RequestSnapshot},
    util::{
        clock::Clock,
        connections::{Admitted, Connections},
        trusted_dir::TrustedDir,
    },
};

/// Connections open at once. Past it the oldest one that has not sent its
/// query yet is closed to make room ([`Connections`]), so idle clients,
/// however many, never keep a query out; a new one is told "busy" only
/// when every place is answering a query.
pub const MAX_CONNECTIONS: usize = 4;
/// How long a client may take to send its query.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest query line read.
const MAX_QUERY: u64 = 4096;
/// How long a client may take to read its answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// A query waiting for the event loop's snapshot.
pub struct Pending {
    reply: oneshot::Sender<Snapshot>,
}

/// The listening socket, and the queue of queries it forwards to the loop.
pub struct QueryServer {
    socket: SocketFile,
    queries: mpsc::Receiver<Pending>,
    /// Watched processes' names and profiles.
    names: HashMap<u32, (String, String)>,
    clock: Clock,
    /// The watched processes' workloads, named on every row.
    workloads: Option<Directory>,
}

impl QueryServer {
    /// Serve `place` from tasks on the current runtime; the socket is
    /// 0600. A socket file nobody listens on (left by an agent that died)
    /// is replaced; one an agent answers on is an error.
    pub fn bind(place: SocketPlace, clock: Clock) -> Result<Self> {
        let (listener, socket) = bind_socket(&place)?;
        let shown = place.shown.display();
        let listener = UnixListener::from_std(listener)
            .with_context(|| format!("registering the query socket {shown} with the reactor"))?;
        let (tx, queries) = mpsc::channel(MAX_CONNECTIONS);
        tokio::spawn(accept(listener, tx));
        info!(socket = %shown, "serving `stallwatch inflight`");
        Ok(Self { socket, queries, names: HashMap::new(), clock, workloads: None })
    }

    /// Rows and processes name their workload (pod, container) when known.
    pub fn with_workloads(mut self, workloads: Directory) -> Self {
        self.workloads = Some(workloads);
        self
    }

    pub fn path(&self) -> &Path {
        &self.socket.path
    }

    /// Name a watched process (the answers list every named process).
    pub fn name_process(&mut self, pid: u32, name: &str, profile: &str) {
        self.names.insert(pid, (name.to_owned(), profile.to_owned()));
    }

    /// The process is no longer watched.
    pub fn forget_process(&mut self, pid: u32) {
        self.names.remove(&pid);
    }

    /// The next query to answer; never resolves once the accept task is gone.
    pub async fn next(&mut self) -> Pending {
        match self.queries.recv().await {
            Some(pending) => pending,
            None => std::future::pending().await,
        }
    }

    /// Answer with a copy of the engine's tracked requests as of `now_ns`,
    /// the transport evidence of their processes, and what the signals'
    /// trackers say of them (an SGLang room's `waiting_on` ...).
    pub fn answer(&self, pending: Pending, engine: &Engine, transport: &Tracker, signals: &Signals, now_ns: u64) {
        let started = Instant::now();
        let requests: Vec<RequestSnapshot> = engine.inflight().collect();
        let fields = requests
            .iter()
            .filter_map(|request| {
                let fields: Vec<_> =
                    signals.context(request).fields.into_iter().map(|field| (field.name, field.value)).collect();
                (!fields.is_empty()).then_some(((request.pid, request.key), fields))
            })
            .collect();
        let snapshot = Snapshot {
            agent_pid: std::process::id(),
            at: self.clock.rfc3339(now_ns),
            now_ns,
            timeout_ns: engine.config().timeout_ns,
            processes: self.names.iter().map(|(pid, (name, profile))| (*pid, name.clone(), profile.clone())).collect(),
            workloads: self
                .workloads
                .iter()
                .flat_map(|workloads| self.names.keys().filter_map(|&pid| Some((pid, workloads.get(pid)?))))
                .filter(|(_, workload)| !workload.is_empty())
                .collect(),
            requests,
            fields,
            transport: self.names.keys().filter_map(|&pid| Some((pid, transport.process(pid)?.clone()))).collect(),
        };
        let requests = snapshot.requests.len();
        // The client may have gone away meanwhile; nothing to do then.
        let _ = pending.reply.send(snapshot);
        debug!(
            requests,
            loop_us = started.elapsed().as_micros() as u64,
            "inflight query: snapshot taken on the event loop"
        );
    }
}

async fn accept(listener: UnixListener, queries: mpsc::Sender<Pending>) {
    let connections = Connections::new(MAX_CONNECTIONS);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                debug!("query socket: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(place) = connections.admit() else {
            // Non-blocking: a short line into an empty socket buffer.
            let _ = stream.try_write(&wire::encode_error(&format!(
                "busy: {MAX_CONNECTIONS} queries are being answered, try again"
            )));
            continue;
        };
        let queries = queries.clone();
        tokio::spawn(async move {
            if let Err(err) = serve(stream, place, queries).await {
                debug!("query socket: {err:#}");
            }
        });
    }
}

/// One connection: its query read (unless it is closed first to make room
/// for a newer one), answered, closed.
async fn serve(stream: UnixStream, mut place: Admitted, queries: mpsc::Sender<Pending>) -> Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = Vec::new();
    let mut query = BufReader::new(read.take(MAX_QUERY));
    let read = tokio::select! {
        read = tokio::time::timeout(QUERY_TIMEOUT, query.read_until(b'\n', &mut line)) => read,
        () = place.evicted() => {
            // Non-blocking, as the "busy" answer: a short line into an
            // empty socket buffer.
            let refusal = "closed: no query came, and a newer client needed the connection";
            let _ = write.as_ref().try_write(&wire::encode_error(refusal));
            return Ok(());
        }
    };
    place.busy();
    let answer = match read {
        Err(_) => wire::encode_error(&format!("no query within {QUERY_TIMEOUT:?}")),
        Ok(Err(err)) => return Err(err).context("reading the query"),
        Ok(Ok(_)) => match wire::decode_query(&line) {
            Err(refusal) => wire::encode_error(&refusal),
            Ok(query) => match query.query {
                QueryKind::Inflight => {
                    let (reply, snapshot) = oneshot::channel();
                    queries.send(Pending { reply }).await.context("the agent is shutting down")?;
                    let snapshot = snapshot.await.context("the agent is shutting down")?;
                    let started = Instant::now();
                    let answer = tokio::task::spawn_blocking(move || wire::encode(&snapshot.into_answer()))
                        .await
                        .context("encoding the answer")?;
                    debug!(
                        bytes = answer.len(),
                        encode_us = started.elapsed().as_micros() as u64,
                        "inflight query: answer encoded"
                    );
                    answer
                }
            },
        },
    };
    tokio::time::timeout(WRITE_TIMEOUT, write.write_all(&answer))
        .await
        .context("the client did not read its answer in time")?
        .context("writing the answer")?;
    write.shutdown().await.context("closing the connection")?;
    Ok(())
}

/// The socket file this agent made; removed when dropped, unless something
/// else has replaced it meanwhile.
struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|meta| meta.dev() == self.dev && meta.ino() == self.ino);
        if ours {
            if let Err(err) = std::fs::remove_file(&self.path) {
                warn!("removing the query socket {}: {err}", self.path.display());
            }
        }
    }
}

/// Where the socket goes, its directory checked: created (0700) if
/// missing, and refused if another user could put their own socket there
/// ([`TrustedDir`]). Checked before anything is loaded; bound at the end
/// of the start-up.
pub struct SocketPlace {
    dir: TrustedDir,
    /// The socket's path below the checked directory.
    path: PathBuf,
    /// As given, for messages.
    shown: PathBuf,
}

impl SocketPlace {
    pub fn check(path: &Path) -> Result<Self> {
        let Some(name) = path.file_name() else { bail!("--socket {} does not name a file", path.display()) };
        let dir = socket_dir(path);
        let dir = TrustedDir::create(dir).with_context(|| format!("the query socket's directory {}", dir.display()))?;
        // Checked here, before anything is attached, not at the bind at
        // the end of the start-up: the socket and its staging name (the
        // longest pid) must both fit a unix socket address.
        let longest = [dir.path().join(name), dir.path().join(staging_name(u32::MAX))]
            .map(|p| p.as_os_str().len())
            .into_iter()
            .max();
        let longest = longest.unwrap_or_default();
        if longest > MAX_SOCKET_PATH {
            bail!(
                "--socket {}: the socket's path would be {longest} bytes, and unix socket paths are limited to \
                 {MAX_SOCKET_PATH}: pick a shorter --socket (a shorter directory or name)",
                path.display()
            );
        }
        Ok(Self { path: dir.path().join(name), dir, shown: path.to_owned() })
    }
}

/// Longest path a unix socket can be bound at (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The private name a socket is bound under before it is moved into place.
fn staging_name(pid: u32) -> String {
    format!(".stallwatch-{pid}.tmp")
}

fn bind_socket(place: &SocketPlace) -> Result<(std::os::unix::net::UnixListener, SocketFile)> {
    let SocketPlace { dir, path, shown } = place;
    let shown = shown.display();
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            bail!("{shown} exists and is not a socket: remove it, or pass another path with --socket")
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => bail!(
                "another stallwatch agent is serving {shown}: stop it, or give this one its own socket with --socket PATH"
            ),
            Err(err) if err.kind() == ErrorKind::ConnectionRefused => {
                info!(socket = %shown, "replacing a stale query socket (its agent is gone)");
            }
            Err(err) => return Err(err).with_context(|| format!("checking whether an agent is serving {shown}")),
        },
        Err(err) if err.kind() == ErrorKind::NotFound => {}
        Err(err) => return Err(err).with_context(|| format!("checking {shown}")),
    }
    // Bind under a private name, make it root-only, then move it into place:
    // the socket is never reachable at `path` with a wider mode, and a stale
    // file there is replaced in one step.
    let staging = dir.path().join(staging_name(std::process::id()));
    match std::fs::remove_file(&staging) {
        Ok(()) => {}
        Err(err) if err.kind() == ErrorKind::NotFound => {}
        Err(err) => return Err(err).with_context(|| format!("removing {}", staging.display())),
    }
    let listener = std::os::unix::net::UnixListener::bind(&staging).with_context(|| {
        format!(
            "binding the query socket at {} (unix socket paths are limited to 107 bytes; pick a shorter --socket)",
            staging.display()
        )
    })?;
    let placed = std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} root-only", staging.display()))
        .and_then(|()| std::fs::rename(&staging, path).with_context(|| format!("moving the query socket to {shown}")))
        .and_then(|()| std::fs::symlink_metadata(path).with_context(|| format!("reading {shown}")));
    let meta = match placed {
        Ok(meta) => meta,
        Err(err) => {
            let _ = std::fs::remove_file(&staging);
            return Err(err);
        }
    };
    listener.set_nonblocking(true).context("making the query socket non-blocking")?;
    Ok((listener, SocketFile { path: path.to_owned(), dev: meta.dev(), ino: meta.ino() }))
}

/// The directory the socket `path` is in.
pub fn socket_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read as _, Write as _},
        sync::atomic::{AtomicUsize, Ordering},
    };

    use super::*;
    use crate::lifecycle::{EngineConfig, Observation, Stage};

    /// A fresh directory under the system temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "stallwatch-query-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp dir");
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn bind(path: &Path) -> Result<QueryServer> {
        QueryServer::bind(SocketPlace::check(path)?, Clock::new())
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    fn engine() -> Engine {
        let mut engine = Engine::new(EngineConfig { timeout_ns: 1_000_000_000, max_tracked: 100, tick_ns: 1_000_000 });
        let mut reports = Vec::new();
        for (key, stage, ts_ns) in [
            (1, Stage::Enqueued, 3_000_000_000),
            (2, Stage::TransferPosted, 1_000_000_000),
            (3, Stage::Enqueued, 2_000_000_000),
        ] {
            engine.observe(Observation { pid: 42, key, stage, ts_ns, external_id: None, ends: None }, &mut reports);
        }
        engine.advance(3_500_000_000, &mut reports);
        engine
    }

    /// Send `query` to the socket of `server` from a plain thread (closing
    /// its writing side after it), serving it from `engine` meanwhile; the
    /// raw answer.
    fn ask(rt: &tokio::runtime::Runtime, server: &mut QueryServer, engine: &Engine, query: &'static [u8]) -> Vec<u8> {
        let path = server.path().to_owned();
        let client = std::thread::spawn(move || {
            let mut stream = std::os::unix::net::UnixStream::connect(&path).expect("connect");
            stream.write_all(query).expect("write");
            stream.shutdown(std::net::Shutdown::Write).expect("shutdown");
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).expect("read");
            answer
        });
        let transport = Tracker::new(1_000_000_000);
        rt.block_on(async {
            while !client.is_finished() {
                tokio::select! {
                    pending = server.next() => server.answer(pending, engine, &transport, &Signals::new(1_000_000_000), 4_000_000_000),
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            }
        });
        client.join().expect("client thread")
    }

    #[test]
    fn a_socket_path_too_long_to_bind_is_refused_before_anything_is_attached() {
        let dir = TempDir::new();
        let long = dir.0.join("s".repeat(120));
        let err = format!("{:#}", SocketPlace::check(&long).err().expect("too long"));
        assert!(
            err.contains("unix socket paths are limited to 107") && err.contains("pick a shorter --socket"),
            "{err}"
        );
        assert!(SocketPlace::check(&dir.0.join("ok.sock")).is_ok());
    }

    #[test]
    fn the_socket_is_root_only_in_a_private_directory_and_removed_on_drop() {
        let tmp = TempDir::new();
        let path = tmp.0.join("run/stallwatch/agent.sock");
        let rt = runtime();
        let _guard = rt.enter();
        let server = bind(&path).expect("bind");
        let meta = std::fs::symlink_metadata(&path).expect("socket exists");
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o777, 0o600);
        let dir = std::fs::metadata(tmp.0.join("run/stallwatch")).expect("dir");
        assert_eq!(dir.mode() & 0o777, 0o700);
        assert_eq!(std::fs::read_dir(tmp.0.join("run/stallwatch")).expect("dir").count(), 1, "no staging file left");
        drop(server);
        assert!(!path.exists(), "removed on exit");
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let tmp = TempDir::new();
        let path = tmp.0.join("agent.sock");
        // A socket file whose listener is gone: what a killed agent leaves.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
        let rt = runtime();
        let _guard = rt.enter();
        let first = bind(&path).expect("stale socket replaced");
        let err = bind(&path).err().expect("live socket refused");
        let message = format!("{err:#}");
        assert!(
            message.contains("another stallwatch agent is serving") && message.contains(&*path.to_string_lossy()),
            "{message}"
        );
        assert!(path.exists(), "the live agent's socket is untouched");
        drop(first);
        assert!(!path.exists());
    }

    #[test]
    fn a_file_that_is_not_a_socket_is_left_alone() {
        let tmp = TempDir::new();
        let path = tmp.0.join("agent.sock");
        std::fs::write(&path, "precious").expect("file");
        let rt = runtime();
        let _guard = rt.enter();
        let err = bind(&path).err().expect("refused");
        assert!(format!("{err:#}").contains("exists and is not a socket"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&path).expect("still there"), "precious");
    }

    #[test]
    fn a_socket_replaced_by_someone_else_is_not_removed() {
        let tmp = TempDir::new();
        let path = tmp.0.join("agent.sock");
        let rt = runtime();
        let _guard = rt.enter();
        let server = bind(&path).expect("bind");
        std::fs::remove_file(&path).expect("remove");
        std::fs::write(&path, "someone else's").expect("replace");
        drop(server);
        assert!(path.exists());
    }

    #[test]
    fn an_inflight_query_is_answered_from_the_engine_oldest_first() {
        let tmp = TempDir::new();
        let rt = runtime();
        let _guard = rt.enter();
        let mut server = bind(&tmp.0.join("agent.sock")).expect("bind");
        server.name_process(42, "demo-prefill", "demo");
        let engine = engine();
        let answer = ask(&rt, &mut server, &engine, b"{\"query\":\"inflight\"}\n");
        let answer = wire::decode_inflight(&answer).expect("an answer");
        let rows: Vec<(u64, Stage, u64, u64, Option<&str>)> = answer
            .requests
            .iter()
            .map(|r| (r.key, r.stage, r.age_ms, r.silent_ms, r.class.map(|c| c.as_str())))
            .collect();
        assert_eq!(
            rows,
            [
                (2, Stage::TransferPosted, 3000, 3000, Some("transfer_hung")),
                (3, Stage::Enqueued, 2000, 2000, Some("waiting_for_peer")),
                (1, Stage::Enqueued, 1000, 1000, None),
            ]
        );
        assert_eq!(answer.timeout_ms, 1000);
        assert_eq!(answer.agent_pid, std::process::id());
        assert_eq!(answer.processes.len(), 1);
        assert_eq!((answer.processes[0].in_flight, answer.processes[0].stalled), (3, 2));
    }

    #[test]
    fn a_bad_query_gets_a_refusal_without_touching_the_engine() {
        let tmp = TempDir::new();
        let rt = runtime();
        let _guard = rt.enter();
        let mut server = bind(&tmp.0.join("agent.sock")).expect("bind");
        let engine = engine();
        let answer = ask(&rt, &mut server, &engine, b"{\"query\":\"secrets\"}\n");
        match wire::decode_inflight(&answer) {
            Err(wire::AnswerError::Refused(why)) => assert!(why.contains("unknown variant `secrets`"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A query without its newline (the client closed its side) is read too.
        let answer = ask(&rt, &mut server, &engine, b"{\"query\":\"inflight\"}");
        assert_eq!(wire::decode_inflight(&answer).expect("answer").requests.len(), 3);
    }

    #[test]
    fn idle_connections_past_the_limit_never_keep_a_query_out() {
        let tmp = TempDir::new();
        let rt = runtime();
        let _guard = rt.enter();
        let mut server = bind(&tmp.0.join("agent.sock")).expect("bind");
        let engine = engine();
        // Four times the limit, connected and sending nothing.
        let mut idle: Vec<std::os::unix::net::UnixStream> = (0..4 * MAX_CONNECTIONS)
            .map(|_| std::os::unix::net::UnixStream::connect(server.path()).expect("connect"))
            .collect();
        for _ in 0..3 {
            let answer = ask(&rt, &mut server, &engine, b"{\"query\":\"inflight\"}\n");
            assert_eq!(wire::decode_inflight(&answer).expect("an answer, not busy").requests.len(), 3);
        }
        // The oldest idle one was closed to make room, and told why.
        let mut told = Vec::new();
        idle.remove(0).read_to_end(&mut told).expect("read");
        match wire::decode_inflight(&told) {
            Err(wire::AnswerError::Refused(why)) => assert!(why.contains("a newer client needed"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
