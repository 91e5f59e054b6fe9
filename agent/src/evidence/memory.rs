//! One read of a watched process's memory from the agent, for a framework
//! that needs a table the target keeps to itself (Mooncake's segment ids,
//! opened before the agent came): `process_vm_readv(2)`, no ptrace stop,
//! the target never notices. [`status`](super::status) batches its reads
//! of many requests instead; this is the single read, made seldom.
use std::io;

/// `buf.len()` bytes at `addr` in `pid`'s memory, whole or an error
/// (`EFAULT` where part of the range is not mapped readable).
pub fn read(pid: u32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: the local iovec covers `buf`, borrowed mutably until the call
    // returns; the remote range is only read by the kernel, in the other
    // process.
    let got = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    match usize::try_from(got) {
        Ok(n) if n == buf.len() => Ok(()),
        Ok(_) => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_refuses_an_unmapped_address() {
        let here = *b"segment table";
        let mut buf = [0u8; 13];
        read(std::process::id(), here.as_ptr() as u64, &mut buf).expect("our own memory");
        assert_eq!(&buf, &here);
        let err = read(std::process::id(), 8, &mut buf).expect_err("page zero");
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    }
}
