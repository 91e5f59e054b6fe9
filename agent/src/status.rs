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
//! lost or is not read yet; see [`crate::state::KernelState::holds`]), and
//! checked again after the read: a release that raced the read voids it.
//! What cannot be read (the process is gone, the address is unmapped, the
//! agent lacks the right to read it) or reads a value no rule takes is
//! counted by reason and warned about at most once per period, and says
//! nothing: the stall is then classified by what the probes saw.
use std::io;

use anyhow::Result;
use tracing::{debug, warn};

use crate::{
    lifecycle::{Silent, Stage},
    probes::{RetType, StatusSpec},
};

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
}

impl StatusReads {
    pub fn total(&self) -> u64 {
        self.answered + self.unrecognised + self.not_held + self.process_gone + self.unreadable
    }
}

/// Reads `[status]` for requests whose stall is due.
pub struct StatusReader {
    spec: StatusSpec,
    reads: StatusReads,
    /// `unrecognised + unreadable` when the last warning went out.
    warned: u64,
    /// What the latest of those was.
    last_problem: Option<String>,
}

impl StatusReader {
    pub fn new(spec: StatusSpec) -> Self {
        Self { spec, reads: StatusReads::default(), warned: 0, last_problem: None }
    }

    pub fn reads(&self) -> StatusReads {
        self.reads
    }

    /// The stage the target's memory shows for `silent`, if it can tell.
    /// `holds` asks the kernel whether it still holds the lifecycle live.
    pub fn read(&mut self, silent: &Silent, holds: impl Fn() -> Result<bool>) -> Option<Stage> {
        let (pid, key) = (silent.pid, silent.key);
        match holds() {
            Ok(true) => {}
            Ok(false) => {
                debug!(pid, key = format_args!("{key:#x}"), "status not read: the request ended or its key began another");
                self.reads.not_held += 1;
                return None;
            }
            Err(err) => return self.unreadable(format!("asking the kernel whether it holds pid {pid} key {key:#x}: {err:#}")),
        }
        let value = match read_value(pid, key, &self.spec) {
            Ok(value) => value,
            Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
                self.reads.process_gone += 1;
                return None;
            }
            Err(err) => {
                return self.unreadable(format!("reading the status of pid {pid} key {key:#x} (profile {}, line {}): {err}", self.spec.origin, self.spec.line));
            }
        };
        // The read raced a release: the memory may have been freed mid-read.
        if !matches!(holds(), Ok(true)) {
            self.reads.not_held += 1;
            return None;
        }
        match self.spec.stage_of(value) {
            Some(stage) => {
                self.reads.answered += 1;
                debug!(pid, key = format_args!("{key:#x}"), value, %stage, "status read");
                Some(stage)
            }
            None => {
                self.reads.unrecognised += 1;
                self.last_problem = Some(format!(
                    "pid {pid} key {key:#x}: status {value}, which no `values` rule of the [status] of profile {}, line {} takes",
                    self.spec.origin,
                    self.spec.line
                ));
                None
            }
        }
    }

    fn unreadable(&mut self, problem: String) -> Option<Stage> {
        self.reads.unreadable += 1;
        self.last_problem = Some(problem);
        None
    }

    /// One warning for the reads that failed or said nothing since the
    /// last one (a wrong layout would fail every read: one line a period,
    /// not one per request).
    pub fn warn(&mut self) {
        let problems = self.reads.unrecognised + self.reads.unreadable;
        if problems > self.warned {
            warn!(
                new = problems - self.warned,
                unreadable = self.reads.unreadable,
                unrecognised = self.reads.unrecognised,
                latest = self.last_problem.as_deref().unwrap_or_default(),
                "request states the target's memory did not tell (those stalls are classified by the probes alone)"
            );
            self.warned = problems;
        }
    }
}

/// The value `spec` says lies at `key`'s request in `pid`, sign-extended.
fn read_value(pid: u32, key: u64, spec: &StatusSpec) -> io::Result<i64> {
    let mut addr = key;
    for &offset in &spec.at.deref {
        let mut word = [0; 8];
        read_memory(pid, addr.wrapping_add_signed(offset), &mut word)?;
        addr = u64::from_ne_bytes(word);
    }
    addr = addr.wrapping_add_signed(spec.at.add);
    Ok(match spec.value {
        RetType::I32 => {
            let mut bytes = [0; 4];
            read_memory(pid, addr, &mut bytes)?;
            i64::from(i32::from_ne_bytes(bytes))
        }
        RetType::I64 => {
            let mut bytes = [0; 8];
            read_memory(pid, addr, &mut bytes)?;
            i64::from_ne_bytes(bytes)
        }
    })
}

/// Fill `buf` from `pid`'s memory at `addr` (`process_vm_readv(2)`: no
/// ptrace stop, the target never notices). A short read is EFAULT.
fn read_memory(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: one local iovec over `buf`, which we own mutably; the remote
    // address is only read by the kernel, in the other process.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    match usize::try_from(n) {
        Ok(n) if n == buf.len() => Ok(()),
        Ok(_) => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::probes::Profile;

    /// A `[status]` over this very process's memory, the real syscall.
    fn reader(at: &str, ty: &str) -> StatusReader {
        let text = format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = {{ from = \"arg0\" }}\n\n\
             [status]\nat = {at}\ntype = \"{ty}\"\nvalues = [\n  {{ when = \"== 1\", event = \"transfer_posted\" }},\n  \
             {{ when = \"== 0\", event = \"transfer_done\" }},\n  {{ when = \"< 0\", event = \"failed\" }},\n]\n"
        );
        StatusReader::new(Profile::parse(&text, "test").expect("profile").status.expect("[status]"))
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
        assert_eq!(direct.read(&silent(key), || Ok(true)), Some(Stage::TransferPosted));
        handle.status = 0;
        assert_eq!(direct.read(&silent(key), || Ok(true)), Some(Stage::TransferDone));
        let mut through = reader("{ from = \"key\", deref = [16] }", "i64");
        assert_eq!(through.read(&silent(key), || Ok(true)), Some(Stage::Failed));
        handle.status = 7;
        assert_eq!(direct.read(&silent(key), || Ok(true)), None, "no rule takes 7");
        assert_eq!(direct.reads(), StatusReads { answered: 2, unrecognised: 1, ..StatusReads::default() });
        std::hint::black_box(&handle);
    }

    #[test]
    fn a_request_the_kernel_no_longer_holds_is_not_read_and_a_raced_read_is_void() {
        let handle = Handle { _pad: 0, status: 0, _more: 0, inner: std::ptr::null() };
        let key = (&raw const handle) as u64;
        let mut status = reader("{ from = \"key\", add = 8 }", "i32");
        assert_eq!(status.read(&silent(key), || Ok(false)), None);
        // Held before the read, released during it.
        let asked = Cell::new(0);
        let released_meanwhile = || {
            asked.set(asked.get() + 1);
            Ok(asked.get() == 1)
        };
        assert_eq!(status.read(&silent(key), released_meanwhile), None);
        assert_eq!((asked.get(), status.reads().not_held, status.reads().answered), (2, 2, 0));
    }

    #[test]
    fn unreadable_memory_and_gone_processes_are_counted_never_a_panic() {
        let mut status = reader("{ from = \"key\", add = 8 }", "i32");
        // Page 0 is never mapped; a pointer chain through it fails too.
        assert_eq!(status.read(&silent(16), || Ok(true)), None);
        let mut through = reader("{ from = \"key\", deref = [0], add = 8 }", "i32");
        assert_eq!(through.read(&silent(16), || Ok(true)), None);
        assert_eq!(status.read(&silent(16), || Err(anyhow::anyhow!("bpf(2) failed"))), None);
        // No such process: pids are below 2^22.
        let gone = Silent { pid: 1 << 30, ..silent(16) };
        assert_eq!(status.read(&gone, || Ok(true)), None);
        assert_eq!(status.reads(), StatusReads { unreadable: 2, process_gone: 1, ..StatusReads::default() });
        assert_eq!(through.reads().unreadable, 1);
        assert!(status.last_problem.as_deref().is_some_and(|p| p.contains("bpf(2) failed")), "{:?}", status.last_problem);
    }
}
