//! Reading a request's state from the target's memory (a profile's
//! `[status]`), for a request whose stall is due.
//!
//! Some targets keep each request's state where it can be read: NIXL's
//! transfer handle holds the status its hot `getXferStatus` poll returns.
//! Reading it once, when a request has been silent for the timeout, costs
//! the target nothing, where a probe on the poll costs it on every call.
//! So the engine asks ([`crate::lifecycle::Engine::advance_reading`]) and
//! this module answers with `process_vm_readv(2)`, never on the event path.
//!
//! The memory at a key is the request's own only while the request lives:
//! a released handle is freed, and the allocator hands its address to the
//! next request. So a read is taken only while the kernel's in-flight table
//! holds the lifecycle live (its probes saw no end, even one whose event was
//! lost or is not read yet; see [`crate::kernel::state::KernelState::is_live`]), and
//! checked again after the read: a release that raced the read voids it.
//! What cannot be read (the process is gone, the address is unmapped, the
//! agent lacks the right to read it) or reads a value no rule takes is
//! counted by reason and warned about at most once per period, and says
//! nothing: the stall is then classified by what the probes saw.
use std::io;

use anyhow::Result;
use tracing::{debug, warn};

use crate::{
    lifecycle::{Silent, StageRead},
    profile::{CompleteAt, StatusSpec},
    util::warned::Warned,
};

/// Most requests whose stall is due read per tick (10 ms by default): a
/// read costs the event loop about a microsecond (two lookups in the
/// kernel's table and a share of a batched `process_vm_readv(2)`; the
/// `engine` bench's (4)), so a mass stall of 100 000 is reported over a
/// second of ticks of about 2 ms each instead of in one tick of 170 ms;
/// the rest wait their turn, oldest due first.
pub const READS_PER_TICK: usize = 1000;

/// How the reads went, by outcome: each read counts once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusReads {
    /// The value read picked a stage.
    pub answered: u64,
    /// A value no rule takes (a layout that differs from the profile's?).
    pub unrecognised: u64,
    /// Not read, or the read voided: the kernel no longer holds the
    /// lifecycle live (it ended, or the key began another).
    pub not_held: u64,
    /// The process was gone.
    pub process_gone: u64,
    /// The memory could not be read (unmapped, no permission), or the
    /// kernel's table could not be asked.
    pub unreadable: u64,
    /// Not read: the process maps a build of the library whose layout the
    /// profile does not know (its `[layout]`).
    pub off: u64,
}

impl StatusReads {
    pub fn total(&self) -> u64 {
        self.answered + self.unrecognised + self.not_held + self.process_gone + self.unreadable + self.off
    }
}

/// The reads of several profiles' readers, one count.
impl std::iter::Sum for StatusReads {
    fn sum<I: Iterator<Item = Self>>(reads: I) -> Self {
        reads.fold(Self::default(), |sum, r| Self {
            answered: sum.answered + r.answered,
            unrecognised: sum.unrecognised + r.unrecognised,
            not_held: sum.not_held + r.not_held,
            process_gone: sum.process_gone + r.process_gone,
            unreadable: sum.unreadable + r.unreadable,
            off: sum.off + r.off,
        })
    }
}

/// Reads `[status]` for requests whose stall is due.
pub struct StatusReader {
    spec: StatusSpec,
    /// The profile's `complete_at`: a stage read there ends the lifecycle.
    complete_at: CompleteAt,
    reads: StatusReads,
    /// The `unrecognised + unreadable` the last warning covered.
    warned: Warned,
    /// What the latest of those was.
    last_problem: Option<String>,
    /// Processes whose memory is not read: they map a library build whose
    /// layout the profile does not know.
    off: std::collections::HashSet<u32>,
}

impl StatusReader {
    pub fn new(spec: StatusSpec, complete_at: CompleteAt) -> Self {
        Self {
            spec,
            complete_at,
            reads: StatusReads::default(),
            warned: Warned::default(),
            last_problem: None,
            off: std::collections::HashSet::new(),
        }
    }

    /// Read nothing of `pid` until [`Self::forget`]: its library's build
    /// is not one the `[status]` offsets were checked against, and what
    /// lies there could read as any stage.
    pub fn turn_off(&mut self, pid: u32) {
        self.off.insert(pid);
    }

    /// `pid` is gone (or exec'd): a new process of the pid is judged anew.
    pub fn forget(&mut self, pid: u32) {
        self.off.remove(&pid);
    }

    pub fn reads(&self) -> StatusReads {
        self.reads
    }

    /// The stage the target's memory shows for each of `silents`, if it
    /// can tell, and whether that ends the lifecycle (the profile completes
    /// there), pushed onto `answers` in order. `holds` asks the kernel
    /// whether it still holds a request's lifecycle live. The requests of
    /// one process are read together, a `process_vm_readv(2)` call for up
    /// to [`IOV_MAX`] of them per step of the `[status]` pointer chain.
    pub fn read(
        &mut self,
        silents: &[Silent],
        holds: impl Fn(&Silent) -> Result<bool>,
        answers: &mut Vec<Option<StageRead>>,
    ) {
        let start = answers.len();
        answers.resize(start + silents.len(), None);
        let mut held = Vec::with_capacity(silents.len());
        for (n, silent) in silents.iter().enumerate() {
            let (pid, key) = (silent.pid, silent.key);
            if self.off.contains(&pid) {
                self.reads.off += 1;
                continue;
            }
            match holds(silent) {
                Ok(true) => held.push(n),
                Ok(false) => {
                    debug!(
                        pid,
                        key = format_args!("{key:#x}"),
                        "status not read: the request ended or its key began another"
                    );
                    self.reads.not_held += 1;
                }
                Err(err) => {
                    self.unreadable(format!("asking the kernel whether it holds pid {pid} key {key:#x}: {err:#}"));
                }
            }
        }
        held.sort_by_key(|&n| silents[n].pid);
        for process in held.chunk_by(|&a, &b| silents[a].pid == silents[b].pid) {
            let pid = silents[process[0]].pid;
            let keys: Vec<u64> = process.iter().map(|&n| silents[n].key).collect();
            let (values, calls) = read_values(pid, &keys, &self.spec);
            debug!(pid, requests = keys.len(), calls, "status read in batches");
            for (&n, value) in process.iter().zip(values) {
                answers[start + n] = self.judge(&silents[n], value, &holds);
            }
        }
    }

    /// What the value read for `silent` says, once the kernel says the
    /// read did not race a release (the memory may have been freed mid-read).
    fn judge(
        &mut self,
        silent: &Silent,
        value: io::Result<i64>,
        holds: impl Fn(&Silent) -> Result<bool>,
    ) -> Option<StageRead> {
        let (pid, key) = (silent.pid, silent.key);
        let value = match value {
            Ok(value) => value,
            Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
                self.reads.process_gone += 1;
                return None;
            }
            Err(err) => {
                return self.unreadable(format!(
                    "reading the status of pid {pid} key {key:#x} (profile {}, line {}): {err}",
                    self.spec.origin, self.spec.line
                ));
            }
        };
        if !matches!(holds(silent), Ok(true)) {
            self.reads.not_held += 1;
            return None;
        }
        match self.spec.stage_of(value) {
            Some(stage) => {
                self.reads.answered += 1;
                debug!(pid, key = format_args!("{key:#x}"), value, %stage, "status read");
                Some(StageRead { stage, ends: self.complete_at.ends_at(stage) })
            }
            None => {
                self.reads.unrecognised += 1;
                self.last_problem = Some(format!(
                    "pid {pid} key {key:#x}: status {value}, which no `values` rule of the [status] of profile {}, line {} takes",
                    self.spec.origin, self.spec.line
                ));
                None
            }
        }
    }

    fn unreadable(&mut self, problem: String) -> Option<StageRead> {
        self.reads.unreadable += 1;
        self.last_problem = Some(problem);
        None
    }

    /// One warning for the reads that failed or said nothing since the
    /// last one (a wrong layout would fail every read: one line a period,
    /// not one per request).
    pub fn warn(&mut self) {
        if let Some(new) = self.warned.news(self.reads.unrecognised + self.reads.unreadable) {
            warn!(
                new,
                unreadable = self.reads.unreadable,
                unrecognised = self.reads.unrecognised,
                latest = self.last_problem.as_deref().unwrap_or_default(),
                "request states the target's memory did not tell (those stalls are classified by the probes alone)"
            );
        }
    }
}

/// Most iovecs one `process_vm_readv(2)` call takes (`UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// The value `spec` says lies at each of `keys`' requests in `pid`,
/// sign-extended, and how many `process_vm_readv(2)` calls that took.
fn read_values(pid: u32, keys: &[u64], spec: &StatusSpec) -> (Vec<io::Result<i64>>, usize) {
    let mut calls = 0;
    let mut addrs: Vec<io::Result<u64>> = keys.iter().map(|&key| Ok(key)).collect();
    for &offset in &spec.at.deref {
        let at = addrs.into_iter().map(|addr| addr.map(|addr| addr.wrapping_add_signed(offset))).collect();
        addrs = read_words(pid, at, 8, &mut calls);
    }
    let at = addrs.into_iter().map(|addr| addr.map(|addr| addr.wrapping_add_signed(spec.at.add))).collect();
    // As the kernel widens a value read at a probe: the first `width`
    // bytes, in the low bytes of the word, sign- or zero-extended.
    let flags = spec.value.flag();
    let values = read_words(pid, at, spec.value.width(), &mut calls)
        .into_iter()
        .map(|word| word.map(|word| stallwatch_common::widen(flags, word)))
        .collect();
    (values, calls)
}

/// The first `width` bytes (at most 8) at each address of `pid`'s memory,
/// in the low-addressed bytes of a word: as few `process_vm_readv(2)`
/// calls (no ptrace stop, the target never notices) as iovecs allow, one
/// iovec per address. An address already failed stays failed. The kernel
/// stops a call at the first element it cannot read whole: that one is
/// EFAULT and the call goes on after it; an error of the process (gone,
/// no permission) is every remaining address's.
fn read_words(pid: u32, addrs: Vec<io::Result<u64>>, width: usize, calls: &mut usize) -> Vec<io::Result<u64>> {
    let width = width.min(8);
    let wanted: Vec<usize> = (0..addrs.len()).filter(|&n| addrs[n].is_ok()).collect();
    let mut words = vec![0u64; addrs.len()];
    let mut results: Vec<io::Result<u64>> = addrs;
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return results.into_iter().map(|result| result.and(Err(io::Error::from_raw_os_error(libc::ESRCH)))).collect();
    };
    let mut next = 0;
    while next < wanted.len() {
        let chunk = &wanted[next..(next + IOV_MAX).min(wanted.len())];
        let base = words.as_mut_ptr();
        let local: Vec<libc::iovec> =
            chunk.iter().map(|&n| libc::iovec { iov_base: base.wrapping_add(n).cast(), iov_len: width }).collect();
        let remote: Vec<libc::iovec> = chunk
            .iter()
            .map(|&n| libc::iovec {
                iov_base: *results[n].as_ref().unwrap_or(&0) as usize as *mut libc::c_void,
                iov_len: width,
            })
            .collect();
        *calls += 1;
        // SAFETY: each local iovec covers `width` <= 8 bytes of its own
        // element of `words`, which lives, unmoved, until the call returns;
        // the remote addresses are only read by the kernel, in the other
        // process.
        let got = unsafe {
            libc::process_vm_readv(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0)
        };
        let done = match usize::try_from(got) {
            Ok(bytes) => (bytes / width).min(chunk.len()),
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::EFAULT) {
                    let code = err.raw_os_error().unwrap_or(libc::EIO);
                    for &n in &wanted[next..] {
                        results[n] = Err(io::Error::from_raw_os_error(code));
                    }
                    break;
                }
                0
            }
        };
        for &n in &chunk[..done] {
            results[n] = Ok(words[n]);
        }
        if let Some(&failed) = chunk.get(done) {
            results[failed] = Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        next += (done + 1).min(chunk.len());
    }
    results
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::{lifecycle::Stage, profile::Profile};

    /// A `[status]` over this very process's memory, the real syscall.
    fn reader(at: &str, ty: &str) -> StatusReader {
        let text = format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = {{ from = \"arg0\" }}\n\n\
             [status]\nat = {at}\ntype = \"{ty}\"\nvalues = [\n  {{ when = \"== 1\", event = \"transfer_posted\" }},\n  \
             {{ when = \"== 0\", event = \"transfer_done\" }},\n  {{ when = \"< 0\", event = \"failed\" }},\n]\n"
        );
        StatusReader::new(
            Profile::parse(&text, "test").expect("profile").status.expect("[status]"),
            CompleteAt::Released,
        )
    }

    /// One request read alone.
    impl StatusReader {
        fn read_one(&mut self, silent: &Silent, holds: impl Fn() -> Result<bool>) -> Option<StageRead> {
            let mut answers = Vec::new();
            self.read(std::slice::from_ref(silent), |_| holds(), &mut answers);
            assert_eq!(answers.len(), 1);
            answers[0]
        }
    }

    fn silent(key: u64) -> Silent {
        Silent { pid: std::process::id(), key, stage: Stage::TransferPosted, first_ns: 1, last_ns: 2 }
    }

    #[repr(C)]
    struct Handle {
        _pad: u64,
        status: i32,
        _more: i32,
        inner: *const i64,
    }

    #[test]
    fn the_status_is_read_at_its_offset_through_pointers_while_the_kernel_holds_it() {
        let deep = -10i64;
        let mut handle = Handle { _pad: 0, status: 1, _more: 0, inner: &raw const deep };
        let key = (&raw const handle) as u64;
        let mut direct = reader("{ from = \"key\", add = 8 }", "i32");
        assert_eq!(
            direct.read_one(&silent(key), || Ok(true)),
            Some(StageRead { stage: Stage::TransferPosted, ends: false })
        );
        handle.status = 0;
        assert_eq!(
            direct.read_one(&silent(key), || Ok(true)),
            Some(StageRead { stage: Stage::TransferDone, ends: false })
        );
        let mut through = reader("{ from = \"key\", deref = [16] }", "i64");
        assert_eq!(through.read_one(&silent(key), || Ok(true)), Some(StageRead { stage: Stage::Failed, ends: false }));
        handle.status = 7;
        assert_eq!(direct.read_one(&silent(key), || Ok(true)), None, "no rule takes 7");
        assert_eq!(direct.reads(), StatusReads { answered: 2, unrecognised: 1, ..StatusReads::default() });
        std::hint::black_box(&handle);
    }

    #[test]
    fn a_request_the_kernel_no_longer_holds_is_not_read_and_a_raced_read_is_void() {
        let handle = Handle { _pad: 0, status: 0, _more: 0, inner: std::ptr::null() };
        let key = (&raw const handle) as u64;
        let mut status = reader("{ from = \"key\", add = 8 }", "i32");
        assert_eq!(status.read_one(&silent(key), || Ok(false)), None);
        // Held before the read, released during it.
        let asked = Cell::new(0);
        let released_meanwhile = || {
            asked.set(asked.get() + 1);
            Ok(asked.get() == 1)
        };
        assert_eq!(status.read_one(&silent(key), released_meanwhile), None);
        assert_eq!((asked.get(), status.reads().not_held, status.reads().answered), (2, 2, 0));
    }

    #[test]
    fn unreadable_memory_and_gone_processes_are_counted_never_a_panic() {
        let mut status = reader("{ from = \"key\", add = 8 }", "i32");
        // Page 0 is never mapped; a pointer chain through it fails too.
        assert_eq!(status.read_one(&silent(16), || Ok(true)), None);
        let mut through = reader("{ from = \"key\", deref = [0], add = 8 }", "i32");
        assert_eq!(through.read_one(&silent(16), || Ok(true)), None);
        assert_eq!(status.read_one(&silent(16), || Err(anyhow::anyhow!("bpf(2) failed"))), None);
        // No such process: pids are below 2^22.
        let gone = Silent { pid: 1 << 30, ..silent(16) };
        assert_eq!(status.read_one(&gone, || Ok(true)), None);
        assert_eq!(status.reads(), StatusReads { unreadable: 2, process_gone: 1, ..StatusReads::default() });
        assert_eq!(through.reads().unreadable, 1);
        assert!(
            status.last_problem.as_deref().is_some_and(|p| p.contains("bpf(2) failed")),
            "{:?}",
            status.last_problem
        );
    }

    #[test]
    fn many_requests_of_a_process_are_read_in_few_calls_and_a_bad_one_spoils_no_other() {
        let statuses: Vec<Handle> =
            (0..2500).map(|n| Handle { _pad: 0, status: n % 3 - 1, _more: 0, inner: std::ptr::null() }).collect();
        let mut keys: Vec<u64> = statuses.iter().map(|handle| (&raw const *handle) as u64).collect();
        let spec = reader("{ from = \"key\", add = 8 }", "i32").spec;
        let pid = std::process::id();
        let (values, calls) = read_values(pid, &keys, &spec);
        assert_eq!(calls, 3, "2500 reads, {IOV_MAX} a call");
        assert!(values.iter().enumerate().all(|(n, value)| value.as_ref().ok() == Some(&i64::from(n as i32 % 3 - 1))));
        // Page 0 in the middle of a call: it fails alone, the call goes on after it.
        keys[700] = 16;
        let (values, calls) = read_values(pid, &keys, &spec);
        assert_eq!(calls, 1 + (2500 - 701usize).div_ceil(IOV_MAX), "one call up to it, then on from the next");
        assert_eq!(values[700].as_ref().map_err(io::Error::raw_os_error).err(), Some(Some(libc::EFAULT)));
        assert!(
            values
                .iter()
                .enumerate()
                .filter(|(n, _)| *n != 700)
                .all(|(n, value)| value.as_ref().ok() == Some(&i64::from(n as i32 % 3 - 1)))
        );
        // Through a pointer: a call per step of the chain.
        let deep: Vec<i64> = (0..1500).collect();
        let handles: Vec<Handle> = deep.iter().map(|d| Handle { _pad: 0, status: 0, _more: 0, inner: d }).collect();
        let keys: Vec<u64> = handles.iter().map(|handle| (&raw const *handle) as u64).collect();
        let spec = reader("{ from = \"key\", deref = [16] }", "i64").spec;
        let (values, calls) = read_values(pid, &keys, &spec);
        assert_eq!(calls, 4);
        assert!(values.iter().zip(&deep).all(|(value, d)| value.as_ref().ok() == Some(d)));
        // A process that is gone: every read says so.
        let (values, _) = read_values(1 << 30, &keys[..3], &spec);
        assert!(values.iter().all(|value| value.as_ref().err().and_then(io::Error::raw_os_error) == Some(libc::ESRCH)));
        std::hint::black_box((&statuses, &handles));
    }

    #[test]
    fn a_batch_answers_each_request_in_order_with_processes_mixed() {
        // The third is not held: were it read, 5 would count as unrecognised.
        let handles: Vec<Handle> =
            [-1, 0, 5, 1].map(|status| Handle { _pad: 0, status, _more: 0, inner: std::ptr::null() }).into();
        let mut silents: Vec<Silent> = handles.iter().map(|handle| silent((&raw const *handle) as u64)).collect();
        // A gone process's request between two of ours, one not held.
        silents.insert(1, Silent { pid: 1 << 30, ..silents[0] });
        let unheld = silents[3].key;
        let mut status = reader("{ from = \"key\", add = 8 }", "i32");
        let read = |stage| Some(StageRead { stage, ends: false });
        let mut answers = vec![read(Stage::Enqueued)];
        status.read(&silents, |silent| Ok(silent.key != unheld || silent.pid != std::process::id()), &mut answers);
        let expected = [
            read(Stage::Enqueued),
            read(Stage::Failed),
            None,
            read(Stage::TransferDone),
            None,
            read(Stage::TransferPosted),
        ];
        assert_eq!(answers, expected, "the answer before the batch kept, then one per request in order");
        assert_eq!(status.reads(), StatusReads { answered: 3, not_held: 1, process_gone: 1, ..StatusReads::default() });
        std::hint::black_box(&handles);
    }
}
