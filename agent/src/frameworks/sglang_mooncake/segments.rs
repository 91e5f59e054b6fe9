//! The segments a process's Mooncake engine opened, read from the engine's
//! own table in the process's memory.
//!
//! A batch names its decode only by a segment id, which `openSegment`
//! handed out once per session, at the session's first transfer. An agent
//! started after that (a DaemonSet restarted under a long-running server)
//! saw none of them, and rooms of several decodes interleaved on one
//! worker leave a batch's room ambiguous. The engine keeps the answer:
//! `TransferMetadata::segment_id_to_desc_map_`, an
//! `std::unordered_map<SegmentID, std::shared_ptr<SegmentDesc>>` whose
//! descriptors start with the segment's name (the session `"ip:port"`).
//! The `mooncake_submit` signal hands over the engine's `TransferMetadata*`
//! (`this->impl_->metadata_`, read in the kernel at the submit), and the
//! framework reads the table once, at the first batch to a segment it does
//! not know.
//!
//! Offsets are those of the profile's `[layout]` build (engine.so
//! 0dded685e9e28bcea5c6936d879ad41c30f59f01, libstdc++'s `_Hashtable`), read
//! off its disassembly and checked on the real engine (docs/frameworks/
//! sglang-mooncake.md): `getSegmentDescByID` walks the list from
//! `metadata+0xe0` when the count at `+0xe8` is 0 and compares each node's
//! key at `+8`; `selectTransport` reads the descriptor's second string (the
//! protocol) at `+0x20`, its first (the name) is at `+0`. A process of
//! another build never gets the submit signal (`layout = true`), so these
//! are never read there.
use std::io;

/// `_M_before_begin._M_nxt` of the table: its first node.
const FIRST_NODE_AT: u64 = 0xe0;
/// `_M_element_count`.
const COUNT_AT: u64 = 0xe8;
/// A node: next +0, key (the segment id) +8, the descriptor pointer +16.
const NODE_LEN: usize = 24;
/// A `std::string`: data pointer +0, length +8.
const STRING_LEN: usize = 16;

/// Most segments read: a process opens one per decode rank it sends to.
pub const MOST: u64 = 4096;
/// Longest name read (a session is `"ip:port"`).
const NAME_MOST: u64 = 255;

/// Every (segment id, name) in the table of the engine whose
/// `TransferMetadata` is at `metadata`, read through `read(addr, buf)`;
/// an error says which read failed or what did not look like the table.
pub fn read(
    metadata: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Vec<(u64, Box<str>)>, String> {
    let mut word = |addr: u64, what: &str| -> Result<u64, String> {
        let mut buf = [0u8; 8];
        read(addr, &mut buf).map_err(|err| format!("{what} at {addr:#x}: {err}"))?;
        Ok(u64::from_le_bytes(buf))
    };
    let count = word(metadata + COUNT_AT, "the segment count")?;
    if count > MOST {
        return Err(format!("{count} segments at {metadata:#x} (more than {MOST}): not the table this build has"));
    }
    let mut node = word(metadata + FIRST_NODE_AT, "the first segment")?;
    let mut segments = Vec::with_capacity(count as usize);
    while node != 0 {
        if segments.len() as u64 == count {
            return Err(format!("more segments listed than the {count} counted: the table changed while read"));
        }
        let mut fields = [0u8; NODE_LEN];
        read(node, &mut fields).map_err(|err| format!("a segment at {node:#x}: {err}"))?;
        let field = |n: usize| u64::from_le_bytes(fields[n * 8..n * 8 + 8].try_into().expect("8 bytes"));
        let (next, id, desc) = (field(0), field(1), field(2));
        let mut string = [0u8; STRING_LEN];
        read(desc, &mut string).map_err(|err| format!("segment {id}'s descriptor at {desc:#x}: {err}"))?;
        let data = u64::from_le_bytes(string[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(string[8..].try_into().expect("8 bytes"));
        if len == 0 || len > NAME_MOST {
            return Err(format!("segment {id}'s name is {len} bytes long: not a name"));
        }
        let mut name = vec![0u8; len as usize];
        read(data, &mut name).map_err(|err| format!("segment {id}'s name at {data:#x}: {err}"))?;
        let name = String::from_utf8(name).map_err(|_| format!("segment {id}'s name is not UTF-8"))?;
        segments.push((id, name.into_boxed_str()));
        node = next;
    }
    Ok(segments)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// A process image: bytes at addresses.
    #[derive(Default)]
    struct Image(BTreeMap<u64, Vec<u8>>);

    impl Image {
        fn put(&mut self, addr: u64, bytes: &[u8]) {
            self.0.insert(addr, bytes.to_vec());
        }

        fn words(&mut self, addr: u64, words: &[u64]) {
            self.put(addr, &words.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<_>>());
        }

        fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
            let (&at, bytes) = self.0.range(..=addr).next_back().ok_or(io::Error::from_raw_os_error(libc::EFAULT))?;
            let from = (addr - at) as usize;
            let bytes = bytes.get(from..from + buf.len()).ok_or(io::Error::from_raw_os_error(libc::EFAULT))?;
            buf.copy_from_slice(bytes);
            Ok(())
        }
    }

    /// A table of `segments` at 0x1000 (nodes at 0x2000 + 0x100 n).
    fn table(segments: &[(u64, &str)], count: u64) -> Image {
        let mut image = Image::default();
        image.words(0x1000 + FIRST_NODE_AT, &[if segments.is_empty() { 0 } else { 0x2000 }, count]);
        for (n, (id, name)) in segments.iter().enumerate() {
            let node = 0x2000 + 0x100 * n as u64;
            let next = if n + 1 == segments.len() { 0 } else { node + 0x100 };
            image.words(node, &[next, *id, node + 0x40]);
            image.words(node + 0x40, &[node + 0x80, name.len() as u64]);
            image.put(node + 0x80, name.as_bytes());
        }
        image
    }

    #[test]
    fn every_segment_is_read_with_its_name() {
        let segments = [(2, "127.0.0.1:16395"), (1, "127.0.0.1:15394"), (0, "127.0.0.1:16193")];
        let image = table(&segments, 3);
        let read = read(0x1000, |addr, buf| image.read(addr, buf)).expect("the table");
        let want: Vec<(u64, Box<str>)> = segments.iter().map(|&(id, name)| (id, name.into())).collect();
        assert_eq!(read, want);
        assert_eq!(super::read(0x1000, |addr, buf| table(&[], 0).read(addr, buf)), Ok(vec![]));
    }

    #[test]
    fn what_is_not_the_table_is_an_error_that_says_what() {
        let image = table(&[(1, "127.0.0.1:1")], 1);
        let err = read(0x1000, |addr, buf| {
            if addr == 0x2000 { Err(io::Error::from_raw_os_error(libc::EPERM)) } else { image.read(addr, buf) }
        });
        assert!(err.as_ref().is_err_and(|e| e.starts_with("a segment at 0x2000")), "{err:?}");
        let err = read(0x1000, |addr, buf| table(&[(1, "a"), (2, "b")], 1).read(addr, buf));
        assert!(err.as_ref().is_err_and(|e| e.contains("more segments listed than the 1 counted")), "{err:?}");
        let err = read(0x1000, |addr, buf| table(&[], MOST + 1).read(addr, buf));
        assert!(err.as_ref().is_err_and(|e| e.contains("not the table")), "{err:?}");
        let err = read(0x1000, |addr, buf| table(&[(1, "")], 1).read(addr, buf));
        assert!(err.as_ref().is_err_and(|e| e.contains("0 bytes long")), "{err:?}");
        let err = read(0x1000, |_, _| Err(io::Error::from_raw_os_error(libc::ESRCH)));
        assert!(err.as_ref().is_err_and(|e| e.starts_with("the segment count at 0x10e8")), "{err:?}");
    }
}
