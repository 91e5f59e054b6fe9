//! The client's side: `stallwatch inflight`.
use std::{
    io::{ErrorKind, Read as _, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};

use super::{
    server,
    wire::{self, Inflight, Query, QueryKind},
};
use crate::{export::workload::Workload, util::text, util::trusted_dir::TrustedDir};

/// How long the agent may go without sending anything.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// Ask the agent serving `path` for every request in flight: the parsed
/// answer, and the line as it came (for `--json`). A socket in a directory
/// another user could change is not asked: it may not be the agent's.
pub fn inflight(path: &Path, timeout: Duration) -> Result<(Inflight, Vec<u8>)> {
    let shown = path.display();
    let dir = server::socket_dir(path);
    // Missing: connecting says so.
    TrustedDir::open(dir)
        .with_context(|| format!("not asking {shown}: the query socket's directory {}", dir.display()))?;
    let mut stream = UnixStream::connect(path).map_err(|err| connect_error(path, err))?;
    stream.set_read_timeout(Some(timeout)).context("setting the socket's read timeout")?;
    stream.set_write_timeout(Some(timeout)).context("setting the socket's write timeout")?;
    let sent = stream.write_all(&wire::encode(&Query { version: wire::VERSION, query: QueryKind::Inflight }));
    // A busy agent answers and closes before reading the query: its
    // answer, not the broken pipe, says why.
    if let Err(err) = sent {
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        if answer.is_empty() {
            return Err(anyhow!(err).context(format!("sending the query to the agent at {shown}")));
        }
        return decode(&answer, &shown.to_string()).map(|inflight| (inflight, answer));
    }
    let mut answer = Vec::new();
    if let Err(err) = stream.read_to_end(&mut answer) {
        return Err(match err.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                anyhow!("the agent at {shown} sent nothing for {timeout:?}: is it stuck? (its stderr may say why)")
            }
            _ => anyhow!(err).context(format!("reading the answer from the agent at {shown}")),
        });
    }
    if answer.is_empty() {
        return Err(anyhow!("the agent at {shown} closed the connection without answering (is it shutting down?)"));
    }
    let inflight = decode(&answer, &shown.to_string())?;
    Ok((inflight, answer))
}

fn decode(answer: &[u8], shown: &str) -> Result<Inflight> {
    wire::decode_inflight(answer).map_err(|err| match err {
        wire::AnswerError::Garbled(_) => {
            anyhow!("{err} from {shown} ({} bytes); is the agent there a different stallwatch build?", answer.len())
        }
        _ => anyhow!("{err} (agent at {shown})"),
    })
}

fn connect_error(path: &Path, err: std::io::Error) -> anyhow::Error {
    let shown = path.display();
    match err.kind() {
        ErrorKind::NotFound => anyhow!(
            "no stallwatch agent at {shown} (no such socket): `stallwatch run` must be running on this host; \
             if it was started with --socket, pass the same path here"
        ),
        ErrorKind::ConnectionRefused => anyhow!(
            "no stallwatch agent is listening on {shown} (the socket is left over from an agent that is gone): \
             `stallwatch run` must be running; if it was started with --socket, pass the same path here"
        ),
        ErrorKind::PermissionDenied => anyhow!(
            "permission denied on {shown}: the agent's socket is root-only, run `stallwatch inflight` as root (e.g. with sudo)"
        ),
        _ => anyhow!(err).context(format!("connecting to the agent at {shown}")),
    }
}

/// `stallwatch inflight`: print the answer as a table, or as it came with
/// `json`. A reader that goes away (`| head`) is not an error.
pub fn print(inflight: &Inflight, raw: &[u8], json: bool, out: impl Write) -> Result<()> {
    let written = if json { write_raw(raw, out) } else { write_table(inflight, out) };
    match written {
        Err(err) if err.kind() == ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

fn write_raw(raw: &[u8], mut out: impl Write) -> std::io::Result<()> {
    out.write_all(raw)?;
    if raw.last() != Some(&b'\n') {
        out.write_all(b"\n")?;
    }
    out.flush()
}

const HEADER: [&str; 9] = ["PID", "PROCESS", "WORKLOAD", "KEY", "EXTERNAL_ID", "STAGE", "AGE", "SILENT", "CLASS"];

/// The human form: one row per request, oldest first, then a summary line
/// per watched process.
pub fn write_table(inflight: &Inflight, mut out: impl Write) -> std::io::Result<()> {
    let rows: Vec<[String; 9]> = inflight
        .requests
        .iter()
        .map(|r| {
            [
                r.pid.to_string(),
                text::value(&r.process).into_owned(),
                workload_cell(r.workload.as_ref()),
                format!("{:#x}", r.key),
                r.external_id.as_deref().map_or_else(|| "-".to_owned(), |ext| text::value(ext).into_owned()),
                if r.inferred.contains(&r.stage) { format!("{} (inferred)", r.stage) } else { r.stage.to_string() },
                duration(r.age_ms),
                duration(r.silent_ms),
                {
                    // Where it stands, as its alert says: "[waiting_on=worker behind=17]".
                    let context = r.context.iter().map(|(name, value)| format!(" {name}={value}")).collect::<String>();
                    let context = if context.is_empty() { context } else { format!(" [{}]", &context[1..]) };
                    let cell = match (&r.class, &r.transport) {
                        (Some(class), Some(transport)) => {
                            format!("{class}{context} ({}: {})", transport.verdict, transport.summary)
                        }
                        (Some(class), None) => format!("{class}{context}"),
                        (None, _) => format!("-{context}"),
                    };
                    text::escaped(&cell).into_owned()
                },
            ]
        })
        .collect();
    if !rows.is_empty() {
        let mut widths = HEADER.map(str::len);
        for row in &rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        write_row(&mut out, &HEADER, &widths)?;
        for row in &rows {
            write_row(&mut out, row, &widths)?;
        }
    }
    let stalled = inflight.requests.iter().filter(|r| r.class.is_some()).count();
    writeln!(
        out,
        "{} in flight, {} stalled (timeout {}), as of {}",
        plural(inflight.requests.len() as u64, "request"),
        stalled,
        duration(inflight.timeout_ms),
        inflight.at
    )?;
    if inflight.processes.is_empty() {
        writeln!(out, "the agent watches no process")?;
    }
    for p in &inflight.processes {
        write!(out, "pid {} ({}, profile {}", p.pid, text::value(&p.process), text::value(&p.profile))?;
        if p.workload.is_some() {
            write!(out, ", {}", workload_cell(p.workload.as_ref()))?;
        }
        write!(out, "): {} in flight, {} stalled", p.in_flight, p.stalled)?;
        match &p.transport {
            Some(t) => writeln!(
                out,
                "; transport: {} posts (last {}), {} completions (last {}), {} progress calls (last {}; {})",
                t.post.total,
                ago(t.post.last_ago_ms),
                t.completion.total,
                ago(t.completion.last_ago_ms),
                t.progress.total,
                ago(t.progress.last_ago_ms),
                t.progress_attached_ms.map_or_else(
                    || "probe off until a request nears its stall".to_owned(),
                    |ms| format!("probe on for {}", duration(ms))
                )
            )?,
            None => writeln!(out)?,
        }
    }
    out.flush()
}

/// `namespace/pod/container`, `container 0123456789ab` (no Kubernetes),
/// or `-`.
fn workload_cell(workload: Option<&Workload>) -> String {
    match workload.map(ToString::to_string).filter(|shown| !shown.is_empty()) {
        Some(shown) => text::escaped(&shown).into_owned(),
        None => "-".to_owned(),
    }
}

fn write_row<S: AsRef<str>>(out: &mut impl Write, cells: &[S; 9], widths: &[usize; 9]) -> std::io::Result<()> {
    let mut line = String::with_capacity(widths.iter().sum::<usize>() + 16);
    for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
        let cell = cell.as_ref();
        if i + 1 == cells.len() {
            line.push_str(cell);
        } else {
            line.push_str(cell);
            line.extend(std::iter::repeat_n(' ', width.saturating_sub(cell.chars().count()) + 2));
        }
    }
    writeln!(out, "{line}")
}

fn ago(ms: Option<u64>) -> String {
    ms.map_or_else(|| "never".to_owned(), |ms| format!("{} ago", duration(ms)))
}

fn plural(n: u64, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

/// 850ms, 12.3s, 4m05s, 2h03m, 3d04h.
fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{s}.{}s", ms % 1000 / 100),
        60_000..3_600_000 => format!("{}m{:02}s", s / 60, s % 60),
        3_600_000..86_400_000 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use std::{os::unix::net::UnixListener, thread};

    use super::*;
    use crate::lifecycle::{Stage, StallClass};
    use crate::query::wire::{InflightRequest, Process, RequestTransport};

    /// A socket path in a fresh root-only directory (one the client
    /// trusts), removed with the guard.
    fn socket_path() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("agent.sock");
        (dir, path)
    }

    /// A one-shot fake agent that answers `answer` to whatever it is asked.
    fn fake_agent(answer: &'static [u8]) -> (tempfile::TempDir, std::path::PathBuf, thread::JoinHandle<Vec<u8>>) {
        let (dir, path) = socket_path();
        let listener = UnixListener::bind(&path).expect("bind");
        let server = thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut query = [0; 256];
            let n = stream.read(&mut query).expect("read");
            stream.write_all(answer).expect("write");
            query[..n].to_vec()
        });
        (dir, path, server)
    }

    fn pod() -> Workload {
        Workload {
            namespace: Some("llm".to_owned()),
            pod: Some("prefill-0".to_owned()),
            container: Some("sglang".to_owned()),
            ..Workload::default()
        }
    }

    fn answer() -> Inflight {
        Inflight {
            version: 1,
            agent_pid: 1,
            at: "2025-01-01T00:00:00.000Z".to_owned(),
            timeout_ms: 60_000,
            processes: vec![Process {
                pid: 42,
                process: "demo-prefill".to_owned(),
                profile: "demo".to_owned(),
                workload: Some(pod()),
                in_flight: 2,
                stalled: 1,
                transport: None,
            }],
            requests: vec![
                InflightRequest {
                    pid: 42,
                    process: "demo-prefill".to_owned(),
                    profile: "demo".to_owned(),
                    workload: Some(pod()),
                    key: 0x10000000000,
                    external_id: Some("room-1099511627776".to_owned()),
                    stage: Stage::TransferPosted,
                    inferred: Vec::new(),
                    age_ms: 125_000,
                    silent_ms: 61_000,
                    class: Some(StallClass::TransferHung),
                    transport: Some(RequestTransport {
                        verdict: "peer_unresponsive".to_owned(),
                        summary: "last post 61.0s ago, last completion never, 900 progress calls in the last 30.0s, none completed".to_owned(),
                    }),
                    context: [("handle", "0x7f00"), ("transfer", "2")].map(|(k, v)| (k.to_owned(), v.to_owned())).into(),
                },
                InflightRequest {
                    pid: 42,
                    process: "demo-prefill".to_owned(),
                    profile: "demo".to_owned(),
                    workload: Some(Workload { container_id: Some("ab".repeat(32)), ..Workload::default() }),
                    key: 7,
                    external_id: None,
                    stage: Stage::TransferDone,
                    inferred: vec![Stage::TransferDone],
                    age_ms: 3,
                    silent_ms: 3,
                    class: None,
                    transport: None,
                    context: Default::default(),
                },
            ],
        }
    }

    #[test]
    fn the_client_sends_one_query_line_and_reads_the_answer() {
        let line = wire::encode(&answer());
        let leaked: &'static [u8] = Box::leak(line.into_boxed_slice());
        let (_dir, path, server) = fake_agent(leaked);
        let (inflight, raw) = inflight(&path, Duration::from_secs(5)).expect("answered");
        assert_eq!(inflight, answer());
        assert_eq!(raw, leaked);
        let query = server.join().expect("server");
        assert_eq!(query, b"{\"version\":1,\"query\":\"inflight\"}\n");
    }

    #[test]
    fn a_garbled_answer_is_named_as_such() {
        let (_dir, path, server) = fake_agent(b"HTTP/1.1 200 OK\r\n\r\nhello");
        let err = inflight(&path, Duration::from_secs(5)).expect_err("garbled");
        let message = format!("{err:#}");
        assert!(message.contains("garbled answer") && message.contains(&*path.to_string_lossy()), "{message}");
        let _ = server.join();
    }

    #[test]
    fn a_refusal_is_passed_on() {
        let (_dir, path, server) = fake_agent(b"{\"version\":1,\"error\":\"busy: try again\"}\n");
        let err = inflight(&path, Duration::from_secs(5)).expect_err("refused");
        assert!(format!("{err:#}").contains("the agent refused the query: busy: try again"), "{err:#}");
        let _ = server.join();
    }

    #[test]
    fn an_empty_answer_and_a_silent_agent_are_named() {
        let (_dir, path, server) = fake_agent(b"");
        let err = inflight(&path, Duration::from_secs(5)).expect_err("empty");
        assert!(format!("{err:#}").contains("closed the connection without answering"), "{err:#}");
        let _ = server.join();

        let (_dir, path) = socket_path();
        let listener = UnixListener::bind(&path).expect("bind");
        let err = inflight(&path, Duration::from_millis(200)).expect_err("silent");
        assert!(format!("{err:#}").contains("sent nothing for 200ms"), "{err:#}");
        drop(listener);
    }

    #[test]
    fn a_socket_in_a_directory_others_can_change_is_not_asked() {
        use std::os::unix::fs::PermissionsExt as _;
        let (dir, path) = socket_path();
        let listener = UnixListener::bind(&path).expect("bind");
        listener.set_nonblocking(true).expect("non-blocking");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        let err = inflight(&path, Duration::from_secs(1)).expect_err("refused");
        let message = format!("{err:#}");
        assert!(message.starts_with(&format!("not asking {}", path.display())), "{message}");
        assert!(message.contains("(mode 1777) is writable by its group or by anyone"), "{message}");
        assert!(listener.accept().is_err_and(|err| err.kind() == ErrorKind::WouldBlock), "it connected");
    }

    #[test]
    fn no_agent_says_which_socket_and_what_to_run() {
        let (_dir, path) = socket_path();
        let err = inflight(&path, Duration::from_secs(1)).expect_err("missing");
        let message = format!("{err:#}");
        assert!(
            message.contains(&*path.to_string_lossy()) && message.contains("`stallwatch run` must be running"),
            "{message}"
        );

        drop(UnixListener::bind(&path).expect("bind"));
        let err = inflight(&path, Duration::from_secs(1)).expect_err("stale");
        assert!(format!("{err:#}").contains("left over from an agent that is gone"), "{err:#}");
    }

    #[test]
    fn the_table_lines_up_oldest_first_with_a_summary() {
        let mut out = Vec::new();
        write_table(&answer(), &mut out).expect("write");
        let text = String::from_utf8(out).expect("UTF-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "PID  PROCESS       WORKLOAD                KEY            EXTERNAL_ID         STAGE                     AGE    SILENT  CLASS",
                "42   demo-prefill  llm/prefill-0/sglang    0x10000000000  room-1099511627776  transfer_posted           2m05s  1m01s   transfer_hung [handle=0x7f00 transfer=2] (peer_unresponsive: last post 61.0s ago, last completion never, 900 progress calls in the last 30.0s, none completed)",
                "42   demo-prefill  container abababababab  0x7            -                   transfer_done (inferred)  3ms    3ms     -",
                "2 requests in flight, 1 stalled (timeout 1m00s), as of 2025-01-01T00:00:00.000Z",
                "pid 42 (demo-prefill, profile demo, llm/prefill-0/sglang): 2 in flight, 1 stalled",
            ]
        );
    }

    #[test]
    fn nothing_in_flight_is_one_line_per_fact() {
        let mut empty = answer();
        empty.requests.clear();
        empty.processes[0].in_flight = 0;
        empty.processes[0].stalled = 0;
        let mut out = Vec::new();
        write_table(&empty, &mut out).expect("write");
        let text = String::from_utf8(out).expect("UTF-8");
        assert_eq!(
            text,
            "0 requests in flight, 0 stalled (timeout 1m00s), as of 2025-01-01T00:00:00.000Z\npid 42 (demo-prefill, profile demo, llm/prefill-0/sglang): 0 in flight, 0 stalled\n"
        );
    }

    #[test]
    fn durations_read_at_a_glance() {
        let cases = [
            (0, "0ms"),
            (999, "999ms"),
            (1_000, "1.0s"),
            (12_340, "12.3s"),
            (59_999, "59.9s"),
            (60_000, "1m00s"),
            (3_599_000, "59m59s"),
            (3_600_000, "1h00m"),
            (90_061_000, "1d01h"),
        ];
        for (ms, text) in cases {
            assert_eq!(duration(ms), text, "{ms}");
        }
    }

    #[test]
    fn json_is_the_answer_as_it_came() {
        let mut out = Vec::new();
        print(&answer(), b"{\"x\":1}", true, &mut out).expect("print");
        assert_eq!(out, b"{\"x\":1}\n");
    }
}
