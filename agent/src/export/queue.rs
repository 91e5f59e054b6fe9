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
    /// Why the last write failed, other than a closed pipe.
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
                if let Err(err) = written {
                    let mut state = writer.lock();
                    if err.kind() != io::ErrorKind::BrokenPipe {
                        state.error = Some(err.to_string());
                    }
                    state.closed = true;
                    state.lines.clear();
                    state.writing = false;
                    writer.idle.notify_all();
                    return;
                }
            }
        })?;
        Ok(Self { shared, pending: Vec::new(), capacity: capacity.max(1) })
    }

    /// Lines dropped so far because stdout did not drain.
    pub fn dropped(&self) -> u64 {
        self.shared.lock().dropped
    }

    /// Wait until every queued line is written, at most `within`; whether
    /// they were. Then the writer stops.
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
        let state = self.shared.lock();
        state.closed && state.error.is_none()
    }

    /// Lines still waiting for stdout.
    pub fn waiting(&self) -> usize {
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
            return Err(match &state.error {
                Some(error) => io::Error::other(format!("writing to stdout: {error}")),
                None => io::ErrorKind::BrokenPipe.into(),
            });
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
        wait(|| queue.waiting() == 0);
        let started = Instant::now();
        for n in 1..10 {
            writeln!(queue, "line {n}").and_then(|()| queue.flush()).expect("queued");
        }
        assert!(started.elapsed() < Duration::from_secs(1), "writes never wait for the output");
        // One line taken by the blocked writer, three held; six dropped.
        wait(|| queue.waiting() == 3);
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

    fn wait(mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "timed out");
            thread::sleep(Duration::from_millis(5));
        }
    }
}
