//! A tiny stand-in for the prefill side of a disaggregated LLM server.
//!
//! Each request goes through four exported functions, the lifecycle points
//! stallwatch's built-in `demo` profile probes:
//! `prefill_enqueue(req)` -> `kv_transfer_post(id, bytes)` ->
//! `kv_transfer_poll(id)` (1 = in progress, 0 = done, < 0 = error, called in
//! a loop) -> `prefill_release(id)`. Healthy requests flow at `--rate`; on
//! request, the program also pins requests at each stall point, exactly the
//! zero-log stalls the agent exists to catch:
//! - `--waiting-for-peer N`: enqueued, never posted;
//! - `--transfer-hung N`: posted, then polled forever, always in progress;
//! - `--release-lost N`: done, never released;
//! - `--recover N`: hung for `--recover-after`, then done and released.
//!
//! `--stuck-in-poll N` starts N threads that enter `kv_transfer_poll` and
//! never return from it, so a test can kill the process with calls in
//! flight inside a return-probed function.
//!
//! It prints JSON lines on stdout: `ready` (with its pid), one `injected`
//! per pinned request (with its key), `stuck` once its `--stuck-in-poll`
//! threads are in, `exec` before it replaces itself (`--exec-after`), and
//! `done` at the end.
//!
//! Build it with frame pointers (`-C force-frame-pointers=yes`, as xtask
//! does) so every probed function starts with `push %rbp`, which the kernel
//! emulates instead of single-stepping.
use std::{
    ffi::OsString,
    hint::black_box,
    io::{BufRead as _, Write as _},
    os::unix::ffi::OsStrExt as _,
    sync::atomic::{AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use clap::Parser;

#[derive(Parser)]
#[command(about = "A demo prefill server with injectable silent stalls")]
struct Args {
    /// Healthy requests per second.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Stop after this many healthy requests (0: run until --duration).
    #[arg(long, default_value_t = 0)]
    requests: u64,
    /// Run this long, then exit (pinned requests are held until then).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Pin this many requests as enqueued, never posted.
    #[arg(long, default_value_t = 0)]
    waiting_for_peer: u64,
    /// Pin this many requests as posted, polled, never done.
    #[arg(long, default_value_t = 0)]
    transfer_hung: u64,
    /// Pin this many requests as done, never released.
    #[arg(long, default_value_t = 0)]
    release_lost: u64,
    /// Hang this many requests for --recover-after, then finish them.
    #[arg(long, default_value_t = 0)]
    recover: u64,
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    recover_after: Duration,
    /// Inject the pinned requests this long after start.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    inject_after: Duration,
    /// Fail this many requests (poll returns -3), then release them.
    #[arg(long, default_value_t = 0)]
    fail: u64,
    /// Abort this many requests after posting them.
    #[arg(long, default_value_t = 0)]
    abort: u64,
    /// Poll each request's final status (done, or the error) this many
    /// more times before releasing it, and keep polling the pinned
    /// `--release-lost` ones (they answer done), as a server re-checking a
    /// finished handle does: the same answer again is not an event.
    #[arg(long, default_value_t = 0)]
    repoll: u32,
    /// The room string of the pinned requests, as raw bytes (at most 23;
    /// default `room-<id>`), so tests can give them whatever a target's
    /// memory may hold: line breaks, terminal escapes, invalid UTF-8.
    #[arg(long, value_name = "BYTES")]
    pinned_room: Option<OsString>,
    /// Wait for a line on stdin before starting (so an agent can attach).
    #[arg(long)]
    wait_for_go: bool,
    /// Exec the program given after `--` (with its arguments) this long
    /// after start, pinned requests still held: a process replacing its
    /// image (`--exec-after 2s -- /bin/sleep 30`).
    #[arg(long, value_parser = humantime::parse_duration, requires = "exec")]
    exec_after: Option<Duration>,
    /// What `--exec-after` execs.
    #[arg(last = true)]
    exec: Vec<String>,
    /// After `go`, start this many threads that each enter
    /// `kv_transfer_poll` and never return from it, then print `stuck`:
    /// calls that die unfinished when the process is killed, so their
    /// return probe never runs.
    #[arg(long, default_value_t = 0)]
    stuck_in_poll: u64,
    /// Right after injecting, run this many requests whose done status
    /// poll first polls the first `--transfer-hung` transfer from inside
    /// (a library calling itself back), which answers "in progress": two
    /// calls of one return-probed function in flight on one thread. Each
    /// prints `nested` with its key.
    #[arg(long, default_value_t = 0, requires = "transfer_hung")]
    nested_polls: u64,
    /// Benchmark mode for `cargo bench --bench uprobe`: for every line
    /// `enqueue`, `post`, `poll` or `request` (a whole healthy request) on
    /// stdin, optionally followed by a count, time this many calls of it
    /// (or the count) and print the mean.
    #[arg(long)]
    bench_calls: Option<u64>,
}

/// What `prefill_enqueue` receives: the layout the demo profile reads
/// (`id` at offset 0, the room string at offset 8).
#[repr(C)]
pub struct Request {
    pub id: u64,
    pub room: [u8; 24],
}

impl Request {
    fn new(id: u64) -> Self {
        Self::with_room(id, format!("room-{id}").as_bytes())
    }

    fn with_room(id: u64, text: &[u8]) -> Self {
        let mut room = [0; 24];
        let n = text.len().min(room.len() - 1);
        room[..n].copy_from_slice(&text[..n]);
        Self { id, room }
    }

    /// The room as a JSON string (invalid UTF-8 replaced).
    fn room_json(&self) -> String {
        let len = self.room.iter().position(|&b| b == 0).unwrap_or(self.room.len());
        let mut json = String::from("\"");
        for c in String::from_utf8_lossy(&self.room[..len]).chars() {
            match c {
                '"' | '\\' => json.extend(['\\', c]),
                c if c.is_control() => json.push_str(&format!("\\u{:04x}", u32::from(c))),
                c => json.push(c),
            }
        }
        json.push('"');
        json
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn prefill_enqueue(req: *const Request) {
    // Each lifecycle function touches a different marker, so the linker
    // cannot fold identical bodies into one address (which would make one
    // probe fire for all of them).
    black_box((req, b'E'));
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kv_transfer_post(id: u64, bytes: u64) -> i32 {
    black_box((id, bytes));
    0
}

/// The transfer's status, as a KV-transfer library reports it. Asked for
/// [`STUCK`], it never returns (`--stuck-in-poll`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kv_transfer_poll(id: u64, status: i32) -> i32 {
    black_box(id);
    if status == STUCK {
        stuck();
    }
    if status == NESTED {
        kv_transfer_poll(NESTED_INNER.load(Ordering::Relaxed), IN_PROGRESS);
        return black_box(DONE);
    }
    black_box(status)
}

/// The transfer a [`NESTED`] poll polls from inside (`--nested-polls`).
static NESTED_INNER: AtomicU64 = AtomicU64::new(0);

/// Threads inside `kv_transfer_poll` for good.
static STUCK_THREADS: AtomicU64 = AtomicU64::new(0);

#[cold]
#[inline(never)]
fn stuck() -> ! {
    STUCK_THREADS.fetch_add(1, Ordering::Release);
    loop {
        thread::park();
    }
}

/// Start `n` threads stuck inside `kv_transfer_poll` and say `stuck` once
/// every one is in.
fn stick_threads(n: u64) {
    for i in 0..n {
        // Small stacks: thousands of threads that only park.
        let spawned =
            thread::Builder::new().stack_size(64 << 10).spawn(move || kv_transfer_poll(STUCK_BASE + i, STUCK));
        if let Err(err) = spawned {
            eprintln!("demo-prefill: starting stuck thread {i}: {err}");
            std::process::exit(1);
        }
    }
    while STUCK_THREADS.load(Ordering::Acquire) < n {
        thread::sleep(Duration::from_millis(1));
    }
    say(&format!("{{\"event\":\"stuck\",\"threads\":{n}}}"));
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn prefill_release(id: u64) {
    black_box((id, b'R'));
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn prefill_abort(id: u64) {
    black_box((id, b'A'));
}

const IN_PROGRESS: i32 = 1;
const DONE: i32 = 0;
const ERR_BACKEND: i32 = -3;
/// A status no transfer has: the poll blocks forever.
const STUCK: i32 = i32::MIN;
/// Another one: the poll polls [`NESTED_INNER`], then answers done.
const NESTED: i32 = i32::MIN + 1;
/// Polls a healthy transfer answers "in progress" before it is done.
const POLLS_PER_TRANSFER: u32 = 3;
/// Pinned requests get their ids from here up, apart from healthy ones.
const PINNED_BASE: u64 = 1 << 40;
/// The ids stuck threads poll, apart from both.
const STUCK_BASE: u64 = 1 << 41;
/// The ids of `--nested-polls` requests, apart from all three.
const NESTED_BASE: u64 = 1 << 42;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout must not stop the demo: it only loses the narration.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// How a request that is not pinned ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    Released,
    Failed,
    Aborted,
}

fn run_request(id: u64, end: End, repoll: u32) {
    let req = Request::new(id);
    prefill_enqueue(&req);
    kv_transfer_post(id, 4096);
    if end == End::Aborted {
        prefill_abort(id);
        return;
    }
    for _ in 0..POLLS_PER_TRANSFER {
        kv_transfer_poll(id, IN_PROGRESS);
    }
    let status = if end == End::Failed { ERR_BACKEND } else { DONE };
    for _ in 0..=repoll {
        kv_transfer_poll(id, status);
    }
    prefill_release(id);
}

#[derive(Clone, Copy)]
enum Pin {
    WaitingForPeer,
    TransferHung,
    ReleaseLost,
    Recover,
}

impl Pin {
    fn name(self) -> &'static str {
        match self {
            Self::WaitingForPeer => "waiting_for_peer",
            Self::TransferHung => "transfer_hung",
            Self::ReleaseLost => "release_lost",
            Self::Recover => "recover",
        }
    }
}

struct Pinned {
    id: u64,
    pin: Pin,
    req: Request,
}

fn main() {
    let args = Args::parse();
    say(&format!("{{\"event\":\"ready\",\"pid\":{}}}", std::process::id()));
    if args.wait_for_go {
        let mut line = String::new();
        // EOF counts as "go" too.
        let _ = std::io::stdin().lock().read_line(&mut line);
    }
    if let Some(calls) = args.bench_calls {
        bench(calls);
        return;
    }
    if args.stuck_in_poll > 0 {
        stick_threads(args.stuck_in_poll);
    }
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / args.rate.max(1) as f64);
    let mut pinned: Vec<Pinned> = Vec::new();
    let mut injected = false;
    let mut healthy = 0u64;
    let mut failed = 0u64;
    let mut aborted = 0u64;
    let mut next = start;
    let mut last_poll = start;
    while start.elapsed() < args.duration {
        if args.exec_after.is_some_and(|after| start.elapsed() >= after) {
            exec(&args.exec);
        }
        if !injected && start.elapsed() >= args.inject_after {
            injected = true;
            pinned = inject(&args);
        }
        let started = healthy + failed + aborted;
        if args.requests == 0 || started < args.requests {
            let end = if failed < args.fail {
                failed += 1;
                End::Failed
            } else if aborted < args.abort {
                aborted += 1;
                End::Aborted
            } else {
                healthy += 1;
                End::Released
            };
            run_request(started + 1, end, args.repoll);
        } else if args.requests > 0 && pinned.is_empty() && injected {
            break;
        }
        // A hung transfer is still polled, as a real prefill loop does:
        // "in progress" answers are not life.
        if last_poll.elapsed() >= Duration::from_millis(10) {
            last_poll = Instant::now();
            pinned.retain(|p| tend(p, start.elapsed(), args.inject_after + args.recover_after, args.repoll > 0));
        }
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
    say(&format!("{{\"event\":\"done\",\"healthy\":{healthy},\"failed\":{failed},\"aborted\":{aborted}}}"));
    // Pinned requests stay pinned: the process exits with them in flight.
    black_box(&pinned);
}

/// Replace this program with `argv`, held requests and all; returns only
/// on failure, by exiting.
fn exec(argv: &[String]) {
    use std::os::unix::process::CommandExt as _;
    say(&format!("{{\"event\":\"exec\",\"program\":{:?}}}", argv.join(" ")));
    let Some((program, rest)) = argv.split_first() else {
        return;
    };
    let err = std::process::Command::new(program).args(rest).exec();
    eprintln!("demo-prefill: exec {program}: {err}");
    std::process::exit(1);
}

fn bench(calls: u64) {
    let req = Request::new(7);
    // Whole requests get fresh ids, as a server's would.
    let mut next_id = 1;
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let mut words = line.split_whitespace();
        let function = words.next().unwrap_or_default();
        let calls = words.next().and_then(|n| n.parse().ok()).unwrap_or(calls);
        let start = Instant::now();
        for _ in 0..calls {
            match function {
                "enqueue" => prefill_enqueue(&req),
                // The same request each time: an event for a request held.
                "post" => {
                    kv_transfer_post(7, 4096);
                }
                "poll" => {
                    kv_transfer_poll(7, IN_PROGRESS);
                }
                "request" => {
                    run_request(next_id, End::Released, 0);
                    next_id += 1;
                }
                _ => break,
            }
        }
        let ns = start.elapsed().as_nanos() as f64 / calls.max(1) as f64;
        say(&format!("{{\"event\":\"bench\",\"fn\":\"{function}\",\"calls\":{calls},\"ns_per_call\":{ns:.1}}}"));
    }
}

fn inject(args: &Args) -> Vec<Pinned> {
    let plan = [
        (Pin::WaitingForPeer, args.waiting_for_peer),
        (Pin::TransferHung, args.transfer_hung),
        (Pin::ReleaseLost, args.release_lost),
        (Pin::Recover, args.recover),
    ];
    let mut pinned = Vec::new();
    for (pin, count) in plan {
        for _ in 0..count {
            let id = PINNED_BASE + pinned.len() as u64;
            let req = match &args.pinned_room {
                Some(room) => Request::with_room(id, room.as_bytes()),
                None => Request::new(id),
            };
            prefill_enqueue(&req);
            match pin {
                Pin::WaitingForPeer => {}
                Pin::TransferHung | Pin::Recover => {
                    kv_transfer_post(id, 1 << 20);
                    kv_transfer_poll(id, IN_PROGRESS);
                }
                Pin::ReleaseLost => {
                    kv_transfer_post(id, 1 << 20);
                    kv_transfer_poll(id, DONE);
                }
            }
            say(&format!(
                "{{\"event\":\"injected\",\"stall\":\"{}\",\"key\":{id},\"room\":{}}}",
                pin.name(),
                req.room_json()
            ));
            pinned.push(Pinned { id, pin, req });
        }
    }
    if let Some(hung) = pinned.iter().find(|p| matches!(p.pin, Pin::TransferHung)) {
        NESTED_INNER.store(hung.id, Ordering::Relaxed);
        for id in (NESTED_BASE..).take(args.nested_polls as usize) {
            prefill_enqueue(&Request::new(id));
            kv_transfer_post(id, 4096);
            kv_transfer_poll(id, NESTED);
            prefill_release(id);
            say(&format!("{{\"event\":\"nested\",\"key\":{id},\"inner\":{}}}", hung.id));
        }
    }
    pinned
}

/// Poll a pinned request; returns whether it stays pinned.
fn tend(p: &Pinned, elapsed: Duration, recover_at: Duration, repoll: bool) -> bool {
    black_box(&p.req);
    match p.pin {
        Pin::TransferHung => {
            kv_transfer_poll(p.id, IN_PROGRESS);
            true
        }
        Pin::Recover if elapsed >= recover_at => {
            kv_transfer_poll(p.id, DONE);
            prefill_release(p.id);
            say(&format!("{{\"event\":\"recovered\",\"key\":{}}}", p.id));
            false
        }
        Pin::Recover => {
            kv_transfer_poll(p.id, IN_PROGRESS);
            true
        }
        Pin::ReleaseLost if repoll => {
            kv_transfer_poll(p.id, DONE);
            true
        }
        Pin::WaitingForPeer | Pin::ReleaseLost => true,
    }
}
