//! Alert lines leave the event loop through a bounded queue, written to
//! stdout by a thread of their own.
//!
//! A stdout nobody drains (a stalled log shipper, a paused terminal) blocks
//! the write that finds its pipe full. Written on the event loop, that
//! froze everything the loop does: the ring-buffer reads (so events were
//! lost), the timers, `/metrics` and `stallwatch inflight`. Here the loop
//! only hands a line over; when the queue is full the *oldest* waiting line
//! gives way, counted ([`LineQueue::dropped`], the summary, the
//! `stallwatch_alert_lines_dropped_total` metric): a human line is dropped,
//! never a detection (the engine, spans, metrics and the kernel's tables
//! already have it).
//!
//! A write that fails for another reason than a reader gone (a full disk
//! under a redirected stdout, an I/O error) loses that line only, counted
//! ([`LineQueue::failed`]): the agent goes on detecting, and its summary
//! goes to stderr if stdout does not take it ([`LineQueue::finish`]).
use std::{
    collections::VecDeque,
    io::{self, Write},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
    time::{Duration, Instant},
};

/// Lines held while stdout does not drain (about 0.5 MB of alert lines).
pub const CAPACITY: usize = 1024;

/// How long the stop waits for stdout to take the last lines (the
/// summary among them) before it gives up on them.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

#[derive(Default)]
struct State {
    lines: VecDeque<Vec<u8>>,
    /// A line is out of the queue and being written.
    writing: bool,
    /// The reader went away (EPIPE); nothing more is written.
    closed: bool,
    /// The writer is asked to stop once the queue is empty.
    finished: bool,
    dropped: u64,
    /// Lines whose write failed (other than for a closed pipe).
    failed: u64,
    /// Why the last of those failed.
    error: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a line is queued or the writer is asked to stop.
    queued: Condvar,
    /// Signalled when the writer has written everything queued.
    idle: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A writer thread that panicked leaves the state usable.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A [`Write`] whose every flushed line goes into the bounded queue; a
/// write never blocks on the real output. A flush returns `BrokenPipe`
/// once the writer found the reader gone, as a direct write would.
pub struct LineQueue {
    shared: Arc<Shared>,
    /// The line being built, queued at the next flush.
    pending: Vec<u8>,
    capacity: usize,
}

impl LineQueue {
    /// Start the writer thread on `out`.
    pub fn start(out: impl Write + Send + 'static) -> io::Result<Self> {
        Self::with_capacity(out, CAPACITY)
    }

    pub fn with_capacity(mut out: impl Write + Send + 'static, capacity: usize) -> io::Result<Self> {
        let shared =
            Arc::new(Shared { state: Mutex::new(State::default()), queued: Condvar::new(), idle: Condvar::new() });
        let writer = shared.clone();
        thread::Builder::new().name("stallwatch-stdout".into()).spawn(move || {
            loop {
                let line = {
                    let mut state = writer.lock();
                    loop {
                        if let Some(line) = state.lines.pop_front() {
                            state.writing = true;
                            break line;
                        }
                        state.writing = false;
                        writer.idle.notify_all();
                        if state.finished || state.closed {
                            return;
                        }
                        state = writer.queued.wait(state).unwrap_or_else(std::sync::PoisonError::into_inner);
                    }
                };
                let written = out.write_all(&line).and_then(|()| out.flush());
                match written {
                    Ok(()) => {}
                    Err(err) if err.kind() == io::ErrorKind::BrokenPipe => {
                        let mut state = writer.lock();
                        state.closed = true;
                        state.lines.clear();
                        state.writing = false;
                        writer.idle.notify_all();
                        return;
                    }
                    Err(err) => {
                        let mut state = writer.lock();
                        state.failed += 1;
                        state.error = Some(err.to_string());
                    }
                }
            }
        })?;
        Ok(Self { shared, pending: Vec::new(), capacity: capacity.max(1) })
    }

    /// Lines dropped so far because stdout did not drain.
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }

    /// Lines whose write failed so far (not for a closed pipe), and why the
    /// last one did.
    pub fn failed(&self) -> (u64, Option<String>) {
        let state = self.shared.lock();
        (state.failed, state.error.clone())
    }

    /// From now on no line gives way: the stop's last reports and summary
    /// are all kept (as many as requests were in flight), so the summary's
    /// count of dropped lines is the whole count.
    pub fn keep_every_line(&mut self) {
        self.capacity = usize::MAX;
    }

    /// Wait until every queued line is written or failed, at most
    /// `within`; whether they were. Then the writer stops.
    pub fn finish(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut state = self.shared.lock();
        state.finished = true;
        self.shared.queued.notify_all();
        while !state.closed && (state.writing || !state.lines.is_empty()) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self.shared.idle.wait_timeout(state, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
        !state.closed || state.lines.is_empty()
    }

    /// Whether the writer found stdout's reader gone (EPIPE): the agent
    /// stops, as a pipeline's writer does. Seen here as soon as the writer
    /// saw it, not at the next line the agent has to write.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Lines not yet written: those queued, and the one being written (a
    /// write that never returns loses it too).
    pub fn waiting(&self) -> usize {
        let state = self.shared.lock();
        state.lines.len() + usize::from(state.writing)
    }
}

#[cfg(test)]
impl LineQueue {
    /// Lines queued, not counting the one being written.
    fn queued(&self) -> usize {
        self.shared.lock().lines.len()
    }
}

impl Write for LineQueue {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut state = self.shared.lock();
        if state.closed {
            self.pending.clear();
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        if self.pending.is_empty() {
            return Ok(());
        }
        if state.lines.len() >= self.capacity {
            state.lines.pop_front();
            state.dropped += 1;
        }
        state.lines.push_back(std::mem::take(&mut self.pending));
        self.shared.queued.notify_one();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    /// A writer that blocks until told to go on, as a pipe nobody drains.
    struct Gate {
        go: mpsc::Receiver<()>,
        out: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Gate {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let _ = self.go.recv();
            self.out.lock().expect("out").extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_blocked_output_never_blocks_the_writer_and_the_oldest_lines_give_way() {
        let (go, gate) = mpsc::channel();
        let out = Arc::new(Mutex::new(Vec::new()));
        let mut queue = LineQueue::with_capacity(Gate { go: gate, out: out.clone() }, 3).expect("queue");
        writeln!(queue, "line 0").and_then(|()| queue.flush()).expect("queued");
        // The writer took it and is stuck writing it.
        wait(|| queue.queued() == 0);
        let started = Instant::now();
        for n in 1..10 {
            writeln!(queue, "line {n}").and_then(|()| queue.flush()).expect("queued");
        }
        assert!(started.elapsed() < Duration::from_secs(1), "writes never wait for the output");
        // One line taken by the blocked writer, three held; six dropped.
        wait(|| queue.queued() == 3);
        assert_eq!(queue.waiting(), 4, "the three queued and the one being written");
        assert_eq!(queue.dropped(), 6);
        assert!(!queue.finish(Duration::from_millis(50)), "the output still does not drain");
        for _ in 0..4 {
            go.send(()).expect("go");
        }
        assert!(queue.finish(Duration::from_secs(5)));
        let written = String::from_utf8(out.lock().expect("out").clone()).expect("utf-8");
        assert_eq!(written, "line 0\nline 7\nline 8\nline 9\n", "the newest kept, in order");
    }

    #[test]
    fn a_reader_gone_is_a_broken_pipe_at_the_next_flush() {
        struct Gone;
        impl Write for Gone {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut queue = LineQueue::start(Gone).expect("queue");
        writeln!(queue, "first").and_then(|()| queue.flush()).expect("queued");
        wait(|| queue.flush().is_err());
        let err = writeln!(queue, "second").and_then(|()| queue.flush()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        assert!(queue.finish(Duration::from_secs(1)));
    }

    #[test]
    fn a_failing_output_loses_only_the_lines_it_fails_and_counts_them() {
        /// Fails every other line, as a disk filling and freeing would.
        struct Full {
            n: usize,
            out: Arc<Mutex<Vec<u8>>>,
        }
        impl Write for Full {
            fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
                self.n += 1;
                if self.n.is_multiple_of(2) {
                    return Err(io::Error::from_raw_os_error(libc::ENOSPC));
                }
                self.out.lock().expect("out").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let out = Arc::new(Mutex::new(Vec::new()));
        let mut queue = LineQueue::start(Full { n: 0, out: out.clone() }).expect("queue");
        for n in 0..6 {
            writeln!(queue, "line {n}").and_then(|()| queue.flush()).expect("a failing disk is no error to the agent");
        }
        assert!(queue.finish(Duration::from_secs(5)));
        assert!(!queue.is_closed(), "the agent goes on");
        let (failed, error) = queue.failed();
        assert_eq!(failed, 3);
        assert!(error.expect("why").contains("No space left on device"));
        let written = String::from_utf8(out.lock().expect("out").clone()).expect("utf-8");
        assert_eq!(written, "line 0\nline 2\nline 4\n");
    }

    #[test]
    fn once_stopping_no_line_gives_way() {
        let (go, gate) = mpsc::channel();
        let out = Arc::new(Mutex::new(Vec::new()));
        let mut queue = LineQueue::with_capacity(Gate { go: gate, out: out.clone() }, 2).expect("queue");
        writeln!(queue, "line 0").and_then(|()| queue.flush()).expect("queued");
        wait(|| queue.queued() == 0);
        for n in 1..4 {
            writeln!(queue, "line {n}").and_then(|()| queue.flush()).expect("queued");
        }
        assert_eq!(queue.dropped(), 1, "line 1 gave way to line 3");
        queue.keep_every_line();
        writeln!(queue, "summary").and_then(|()| queue.flush()).expect("queued");
        assert_eq!(queue.dropped(), 1, "the summary pushed nothing out: its count is the whole count");
        for _ in 0..4 {
            go.send(()).expect("go");
        }
        assert!(queue.finish(Duration::from_secs(5)));
        let written = String::from_utf8(out.lock().expect("out").clone()).expect("utf-8");
        assert_eq!(written, "line 0\nline 2\nline 3\nsummary\n");
    }

    fn wait(mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "timed out");
            thread::sleep(Duration::from_millis(5));
        }
    }
}
