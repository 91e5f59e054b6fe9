//! Types shared by the kernel and user halves of stallwatch.
//!
//! Everything here is `#[repr(C)]` plain data that crosses the BPF map or
//! ring-buffer boundary. The eBPF side is deliberately generic: it does what a
//! [`SlotConfig`] tells it (where to read the request key, when to emit) and
//! knows nothing about NIXL, the demo or any other target. All meaning (which
//! lifecycle event a slot is, which return values are errors) lives in the
//! agent's probe profiles.
#![no_std]

/// Number of probe slots (attachments) one agent can drive at once.
pub const MAX_SLOTS: u32 = 1024;
/// Longest dereference chain a [`ValueSource`] can follow.
pub const MAX_DEREF: usize = 4;
/// Bytes of external id (room id, notification message) captured per event.
pub const EXT_ID_LEN: usize = 64;
/// Return-value rules a slot can carry; an event is emitted when any matches.
pub const MAX_RET_RULES: usize = 2;
/// Most slots one hit of a chain runs ([`SlotConfig::next`]): a bound on
/// what one hit costs the target, and on the filters a chain shares
/// ([`SlotConfig::filter_share`]).
pub const MAX_CHAIN: u32 = 8;
/// Function arguments a probe can read: the six integer registers of the
/// x86-64 SysV ABI and the first four stack slots (NIXL's span overload of
/// `makeXferReq` passes its handle reference as the ninth).
pub const SAVED_ARGS: usize = 10;

/// Where a [`ValueSource`] starts.
pub mod base {
    /// The source is unused.
    pub const NONE: u8 = 0;
    /// Argument `index` (0 is the first; 6 and up are read from the stack).
    pub const ARG: u8 = 1;
    /// The function's return value (return probes only).
    pub const RET: u8 = 2;
    /// The request key this same event resolved (for the external id and
    /// its guard, e.g. a string inside the object the key points at).
    pub const KEY: u8 = 3;
}

/// A value read from the probed function's context: start at `base`, then
/// for each of the first `depth` offsets replace the value with the `u64`
/// read from user memory at `value + offset`, then add `add`.
///
/// A key `{ ARG 0, depth 1, offsets [8] }` is `*(u64 *)(arg0 + 8)`.
/// A string source ends on the address of the string's first byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ValueSource {
    pub base: u8,
    pub index: u8,
    pub depth: u8,
    pub _pad: [u8; 5],
    pub offsets: [i64; MAX_DEREF],
    pub add: i64,
}

/// Comparison applied to the return value by a [`RetRule`].
pub mod cmp {
    pub const NONE: u8 = 0;
    pub const EQ: u8 = 1;
    pub const NE: u8 = 2;
    pub const LT: u8 = 3;
    pub const LE: u8 = 4;
    pub const GT: u8 = 5;
    pub const GE: u8 = 6;
}

/// Widen a raw 64-bit value as the slot's flags say: sign-extended from
/// 32 bits ([`slot_flags::RET_I32`]), zero-extended from 8 or 16
/// ([`slot_flags::RET_U8`], [`slot_flags::RET_U16`]), else as is. The
/// kernel and the agent both widen with this, so they agree by
/// construction.
#[inline(always)]
pub fn widen(flags: u32, raw: u64) -> i64 {
    if flags & slot_flags::RET_I32 != 0 {
        i64::from(raw as i32)
    } else if flags & slot_flags::RET_U8 != 0 {
        i64::from(raw as u8)
    } else if flags & slot_flags::RET_U16 != 0 {
        i64::from(raw as u16)
    } else {
        raw as i64
    }
}

/// `ret <op> value`, signed; a return that satisfies it is lifecycle event
/// `stage`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetRule {
    pub op: u8,
    /// One of [`stage`]: the event a matching return stands for.
    pub stage: u8,
    pub _pad: [u8; 6],
    pub value: i64,
}

impl RetRule {
    /// Whether `value <op> self.value` holds; false for no comparison. The
    /// kernel tests returns (and filters) with this, and the agent reads a
    /// handle's status with it, so they agree by construction.
    #[inline(always)]
    pub fn holds(&self, value: i64) -> bool {
        match self.op {
            cmp::EQ => value == self.value,
            cmp::NE => value != self.value,
            cmp::LT => value < self.value,
            cmp::LE => value <= self.value,
            cmp::GT => value > self.value,
            cmp::GE => value >= self.value,
            _ => false,
        }
    }
}

/// Lifecycle stages, in order of progress, as the kernel side records them
/// (the agent's `lifecycle::Stage` has the same numbers). The kernel only
/// needs the order and which stages end a lifecycle: it keeps the in-flight
/// table ([`INFLIGHT`](InflightEntry)) that lets a restarted agent take over.
pub mod stage {
    pub const ENQUEUED: u8 = 0;
    pub const TRANSFER_POSTED: u8 = 1;
    pub const TRANSFER_DONE: u8 = 2;
    pub const RELEASED: u8 = 3;
    pub const ABORTED: u8 = 4;
    pub const FAILED: u8 = 5;
    /// Stages at and above this end the lifecycle.
    pub const FIRST_TERMINAL: u8 = RELEASED;
    /// Live stages timed in [`InflightEntry::stage_ns`](super::InflightEntry::stage_ns).
    pub const LIVE: usize = FIRST_TERMINAL as usize;
    /// Not a lifecycle stage: the hit is a *signal*, an event the agent
    /// hands to a consumer of its own (e.g. ZMQ frames), which the kernel
    /// neither records in the in-flight table nor compares with the last
    /// event. A slot whose every hit is a signal has this as its stage.
    pub const SIGNAL: u8 = u8::MAX;
}

/// Bits of [`SlotConfig::flags`].
pub mod slot_flags {
    /// The slot is a return probe; its entry attachment only saves arguments.
    pub const RETURN: u32 = 1 << 0;
    /// The return probe reads arguments, so the entry attachment saves them.
    pub const NEEDS_ARGS: u32 = 1 << 1;
    /// Emit only when (slot, return value) differs from the last event
    /// emitted for the same (pid, key): for status-polling functions.
    pub const ONLY_ON_CHANGE: u32 = 1 << 2;
    /// The return value is a C `int`: sign-extend its low 32 bits.
    pub const RET_I32: u32 = 1 << 3;
    /// Capture a string from [`SlotConfig::ext`](super::SlotConfig::ext) into the event.
    pub const HAS_EXT: u32 = 1 << 4;
    /// Capture the string only when the byte at [`SlotConfig::guard`](super::SlotConfig::guard) is not 0
    /// (e.g. the engaged flag of a `std::optional<std::string>`).
    pub const HAS_GUARD: u32 = 1 << 5;
    /// A transport-activity slot: count the hit and its time in `HITS` and
    /// `SEEN`, emit nothing (the agent samples them as evidence).
    pub const COUNT_ONLY: u32 = 1 << 7;
    /// Capture [`EXT_ID_LEN`](super::EXT_ID_LEN) raw bytes at
    /// [`SlotConfig::ext`](super::SlotConfig::ext), not a NUL-terminated string (binary data such
    /// as a ZMQ frame); where they cannot all be read, a string is read.
    pub const EXT_BYTES: u32 = 1 << 8;
    /// Every event of the slot ends its request's lifecycle, whatever its
    /// stage: the in-flight entry goes as at a terminal stage, and the
    /// event says so ([`event_flags::ENDS`](super::event_flags::ENDS)). For
    /// a framework that releases what is done lazily, if ever (a profile's
    /// `complete_at = "transfer_done"`): its done requests must neither
    /// fill the table nor read as stalled to a restarted agent.
    pub const ENDS: u32 = 1 << 9;
    /// The slot's events need not reach the agent at once (a profile's
    /// `quiet = true`): one that only moves a request the agent knows of
    /// along, within [`SlotConfig::quiet_ns`](super::SlotConfig::quiet_ns) of its previous event, is
    /// kept in the request's in-flight entry, not sent. The agent reads
    /// the entry when the silence it knows of comes due, and the next
    /// record sent for the request carries the stage times it was not
    /// sent ([`event_flags::WITHHELD`](super::event_flags::WITHHELD)).
    pub const QUIET: u32 = 1 << 10;
    /// The capture is not read at [`SlotConfig::ext`](super::SlotConfig::ext) itself but at one
    /// element of the msgpack array there ([`SlotConfig::msgpack`](super::SlotConfig::msgpack)); a hit
    /// whose data is no such array is no event.
    pub const EXT_MSGPACK: u32 = 1 << 11;
    /// An entry slot whose rules compare the value read through
    /// [`SlotConfig::value`](super::SlotConfig::value) (a profile's `read_status`: the request's
    /// status at its release), not a return value: the first rule that
    /// holds picks the event, and a value no rule takes, or one that cannot
    /// be read, is the slot's own [`SlotConfig::stage`](super::SlotConfig::stage). One user read per
    /// hit, so a transfer that failed and was released before any stall
    /// came due is reported failed, not completed.
    pub const ENTRY_VALUE: u32 = 1 << 12;
    /// A hit is an event only when the value read through
    /// [`SlotConfig::filter`](crate::SlotConfig::filter) satisfies [`SlotConfig::filter_rule`](crate::SlotConfig::filter_rule) (a
    /// signal's `when`); one that cannot be read is none. Checked before
    /// anything else is read, so the hits a consumer has no use for (a ZMQ
    /// message closed empty after its send) cost one user read.
    pub const FILTER: u32 = 1 << 16;
    /// The capture is read at [`SlotConfig::ext`](crate::SlotConfig::ext) when the byte at
    /// [`SlotConfig::select`](crate::SlotConfig::select) is [`SlotConfig::select_byte`](crate::SlotConfig::select_byte), else at
    /// [`SlotConfig::ext_else`](crate::SlotConfig::ext_else) (a signal's `bytes_else`): data kept inline
    /// in a struct or behind a pointer in it, as its type byte says (a ZMQ
    /// frame of up to 33 bytes, or a longer one).
    pub const EXT_SELECT: u32 = 1 << 17;
    /// With [`ENTRY_VALUE`] and [`EXT_SELECT`]: the value is read only
    /// where the capture is at [`SlotConfig::ext_else`](crate::SlotConfig::ext_else) (a length behind
    /// the same pointer as the data); elsewhere it is 0, with no read
    /// through what is no pointer there (and the slot's own stage).
    pub const VALUE_IF_ELSE: u32 = 1 << 18;
    /// The value is a `u8`: keep its low 8 bits, zero-extended (a flag
    /// byte such as Mooncake's `BatchDesc::is_finished`).
    pub const RET_U8: u32 = 1 << 20;
    /// The value is a `u16`: keep its low 16 bits, zero-extended (a status
    /// code such as the one of Mooncake's `Status`).
    pub const RET_U16: u32 = 1 << 21;
    /// A return slot whose rules compare (and whose event carries) the
    /// value read through [`SlotConfig::value`](crate::SlotConfig::value), which starts at the return
    /// register, not the register itself: a C++ method returning a class by
    /// value through a hidden result pointer hands back that pointer in
    /// `rax`, its verdict lying behind it. A value that cannot be read
    /// loses the event (counted as [`counter::KEY_UNREADABLE`](super::counter::KEY_UNREADABLE)).
    pub const RET_DEREF: u32 = 1 << 22;
    /// A signal slot whose capture is a bounded walk of strings
    /// ([`SlotConfig::strings`](crate::SlotConfig::strings)): one record per chunk of every string
    /// found, in place of the one record of the hit.
    pub const EXT_STRINGS: u32 = 1 << 13;
    /// The capture is not read at [`SlotConfig::ext`](crate::SlotConfig::ext) itself but is the
    /// values of keys of the pickle there ([`SlotConfig::pickle`](crate::SlotConfig::pickle)): one
    /// event per record found (a signal slot only); a hit whose data is no
    /// such pickle is no event.
    pub const EXT_PICKLE: u32 = 1 << 14;
    /// The slot is live. The agent writes a process's slots without it,
    /// attaches every probe, then sets it on all of them: a request that
    /// began while only some probes were attached would be seen at one
    /// stage only and reported stalled. Until then the programs do nothing
    /// but save a return slot's arguments (so a call entered before arming
    /// and returning after it is read in full).
    pub const ARMED: u32 = 1 << 30;
    /// Set on every configured slot, so that an all-zero entry reads as
    /// "no slot" to the kernel side.
    pub const CONFIGURED: u32 = 1 << 31;
}

/// What one attachment does. Indexed by the attach cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotConfig {
    pub flags: u32,
    /// How many arguments the entry attachment of a [`slot_flags::NEEDS_ARGS`]
    /// return slot saves (at most [`SAVED_ARGS`]); stack slots cost a read.
    pub nargs: u32,
    pub key: ValueSource,
    pub ext: ValueSource,
    pub guard: ValueSource,
    pub rules: [RetRule; MAX_RET_RULES],
    /// The event every hit stands for, when the slot has no return rules
    /// (one of [`stage`]).
    pub stage: u8,
    pub _pad: [u8; 3],
    /// 1 + the slot the entry program runs next on the same hit, 0 for
    /// none: the slots of one function's entry share one link (the first
    /// of the chain's cookie), so a hit runs one program, which does the
    /// work of each of them in turn (at most [`MAX_CHAIN`]), each as its
    /// own slot (its own flags, counts and events).
    pub next: u32,
    /// With [`slot_flags::QUIET`]: the longest gap after a request's
    /// previous event within which an event of it is not sent. Half the
    /// agent's timeout, so an event after a silence the agent may have
    /// reported (a stall's recovery) is always sent.
    pub quiet_ns: u64,
    /// With [`slot_flags::ENTRY_VALUE`]: where the value the rules compare
    /// lies (read as a `u64`, sign-extended from 32 bits with
    /// [`slot_flags::RET_I32`], cut to 8 or 16 bits with
    /// [`slot_flags::RET_U8`] or [`slot_flags::RET_U16`]); it may start at
    /// the key. With [`slot_flags::RET_DEREF`]: where the return value the
    /// rules compare lies, from the return register.
    pub value: ValueSource,
    /// With [`slot_flags::EXT_MSGPACK`]: which element to capture.
    pub msgpack: MsgpackElement,
    /// With [`slot_flags::FILTER`]: the value a hit must satisfy
    /// `filter_rule` with (read as a `u64`, and-ed with `filter_mask`
    /// unless it is 0) to be an event.
    pub filter: ValueSource,
    pub filter_rule: RetRule,
    pub filter_mask: u64,
    /// With [`slot_flags::EXT_SELECT`]: the byte that picks where the
    /// capture is, the value that picks [`SlotConfig::ext`], and where it
    /// is otherwise.
    pub select: ValueSource,
    pub ext_else: ValueSource,
    pub select_byte: u8,
    /// With [`slot_flags::FILTER`] in a chain (see [`SlotConfig::next`]):
    /// 1 to [`MAX_CHAIN`] when another slot of the chain has the very same
    /// filter and number, so the filter is read once a hit and its
    /// verdict reused; 0: read for this slot alone.
    pub filter_share: u8,
    pub _pad_select: [u8; 6],
    /// With [`slot_flags::EXT_STRINGS`]: where the strings are.
    pub strings: StringWalk,
    /// With [`slot_flags::EXT_PICKLE`]: which values to capture.
    pub pickle: PickleCapture,
}

/// Bytes of a string one chunk record carries (the record's 64 less the
/// NUL a string read ends on).
pub const CHUNK_LEN: u64 = EXT_ID_LEN as u64 - 1;
/// Most loop turns a [`StringWalk`] may take: a bound on what one hit
/// costs the target (each turn one or two user reads, at most one record).
pub const STRINGS_STEPS: u32 = 4096;

/// A bounded walk of the strings a container holds, for a signal
/// ([`slot_flags::EXT_STRINGS`]): at the address the slot's `ext` source
/// gives, either one string (`list == 0`), or a singly linked list of nodes
/// each holding an array of strings (`list == 1`: a libstdc++
/// `unordered_map<string, vector<string>>` is one: its first node pointer
/// at +16, a node's next at +0 and its vector's begin and end at +40 and +48,
/// 32-byte `std::string`s). A string is read as a `std::string` is laid
/// out: its data pointer at +0 and its length at `length`. Every string is
/// sent in chunks of [`CHUNK_LEN`] bytes, one record each, with
/// [`chunk::pack`] in the record's `ret`; at most `nodes` nodes, `items`
/// strings a node and `chunks` chunks a string.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StringWalk {
    /// The first node's pointer, from the container.
    pub first: i64,
    /// A node's next-node pointer, from the node.
    pub next: i64,
    /// A node's array of strings: its begin and end pointers.
    pub begin: i64,
    pub end: i64,
    /// A string's length, from the string.
    pub length: i64,
    /// Bytes from one string of an array to the next.
    pub stride: u32,
    pub nodes: u16,
    pub items: u16,
    pub chunks: u16,
    pub list: u8,
    /// The strings are bytes, not text: each chunk is read whole, NULs
    /// and all ([`event_flags::RAW`]), where a text chunk ends at its
    /// first NUL.
    pub raw: u8,
    pub _pad: [u8; 4],
}

/// What a chunk record of a [`StringWalk`] says in its `ret`: the string's
/// full length, its number among the strings of the hit (from 0), the
/// chunk's number in it, and whether it is the string's last chunk sent
/// (the string ended, or the walk's `chunks` were spent).
pub mod chunk {
    #[inline(always)]
    pub fn pack(len: u64, item: u32, index: u32, last: bool) -> i64 {
        let len = if len > u32::MAX as u64 { u32::MAX as u64 } else { len };
        (len | (u64::from(index & 0xff) << 32) | (u64::from(item & 0xffff) << 40) | (u64::from(last) << 63)) as i64
    }

    /// `(len, item, index, last)`.
    pub fn unpack(ret: i64) -> (u32, u16, u8, bool) {
        let ret = ret as u64;
        (ret as u32, (ret >> 40) as u16, (ret >> 32) as u8, ret >> 63 != 0)
    }
}

/// Longest tag a [`MsgpackElement`] matches.
pub const MSGPACK_TAG_LEN: usize = 32;
/// Most msgpack headers the kernel reads to find one element: a bound on
/// what a capture costs the target (each header is one user read).
pub const MSGPACK_STEPS: u32 = 512;

/// Bytes of a msgpack header [`msgpack`] decodes from: the type byte and
/// up to eight of length or value.
pub const MSGPACK_HEAD: usize = 9;

/// Decoding msgpack headers, for the kernel's walk to an element
/// ([`MsgpackElement`]) and the agent's reading of what it captured. Pure
/// functions of the header's bytes, so both halves agree by construction.
pub mod msgpack {
    use super::MSGPACK_HEAD;

    /// One element's header: how many bytes the element takes with its
    /// payload (not its children), and how many elements nested in it
    /// follow (an array's items, a map's keys and values). `None` for the
    /// byte msgpack never uses (0xc1).
    #[inline(always)]
    pub fn element(head: &[u8; MSGPACK_HEAD]) -> Option<(u64, u64)> {
        let u8_ = u64::from(head[1]);
        let be16 = u64::from(u16::from_be_bytes([head[1], head[2]]));
        let be32 = u64::from(u32::from_be_bytes([head[1], head[2], head[3], head[4]]));
        Some(match head[0] {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (1, 0),
            b @ 0x80..=0x8f => (1, 2 * u64::from(b & 0x0f)),
            b @ 0x90..=0x9f => (1, u64::from(b & 0x0f)),
            b @ 0xa0..=0xbf => (1 + u64::from(b & 0x1f), 0),
            0xc4 | 0xd9 => (2 + u8_, 0),
            0xc5 | 0xda => (3 + be16, 0),
            0xc6 | 0xdb => (5 + be32, 0),
            0xc7 => (3 + u8_, 0),
            0xc8 => (4 + be16, 0),
            0xc9 => (6 + be32, 0),
            0xcc | 0xd0 => (2, 0),
            0xcd | 0xd1 => (3, 0),
            0xca | 0xce | 0xd2 => (5, 0),
            0xcb | 0xcf | 0xd3 => (9, 0),
            0xd4 => (3, 0),
            0xd5 => (4, 0),
            0xd6 => (6, 0),
            0xd7 => (10, 0),
            0xd8 => (18, 0),
            0xdc => (3, be16),
            0xdd => (5, be32),
            0xde => (3, 2 * be16),
            0xdf => (5, 2 * be32),
            _ => return None,
        })
    }

    /// An array's header: its length and the header's size.
    #[inline(always)]
    pub fn array(head: &[u8; MSGPACK_HEAD]) -> Option<(u64, u64)> {
        match element(head)? {
            (size, len) if matches!(head[0], 0x90..=0x9f | 0xdc | 0xdd) => Some((len, size)),
            _ => None,
        }
    }

    /// A string's header: its length and the header's size.
    #[inline(always)]
    pub fn str(head: &[u8; MSGPACK_HEAD]) -> Option<(u64, u64)> {
        let (size, _) = element(head)?;
        let header = match head[0] {
            0xa0..=0xbf => 1,
            0xd9 => 2,
            0xda => 3,
            0xdb => 5,
            _ => return None,
        };
        Some((size - header, header))
    }

    /// An integer element (what a capture of one holds), as u64; `None`
    /// for any other type or a negative number.
    pub fn uint(bytes: &[u8]) -> Option<u64> {
        let be = |n: usize| -> Option<u64> {
            let body = bytes.get(1..1 + n)?;
            Some(body.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
        };
        match *bytes.first()? {
            b @ 0x00..=0x7f => Some(u64::from(b)),
            0xcc => be(1),
            0xcd => be(2),
            0xce => be(4),
            0xcf => be(8),
            0xd0..=0xd3 => {
                let n = 1 << (bytes[0] - 0xd0);
                let value = be(n)?;
                // Sign bit of an n-byte integer.
                (value >> (8 * n - 1) == 0).then_some(value)
            }
            _ => None,
        }
    }
}

/// Element `element` of a msgpack array whose element 0 is the string
/// `tag` (how msgspec encodes a tagged `array_like` struct, the messages of
/// SGLang's scheduler among them): the kernel skips the elements before it,
/// nested arrays and maps included, and captures from its first byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsgpackElement {
    pub element: u32,
    /// 0 to [`MSGPACK_TAG_LEN`]: how many bytes of `tag` must match (0:
    /// any array).
    pub tag_len: u32,
    pub tag: [u8; MSGPACK_TAG_LEN],
}

/// Longest tag or key a [`PickleCapture`] matches.
pub const PICKLE_NAME_LEN: usize = 32;
/// Tags a [`PickleCapture`] can match (one event says which).
pub const PICKLE_TAGS: usize = 2;
/// Keys a [`PickleCapture`] can capture into one record.
pub const PICKLE_KEYS: usize = 2;
/// Most pickle opcodes the kernel reads in one frame: a bound on what a
/// capture costs the target (each opcode is one user read, a string of the
/// length of a key or tag one more). A `TokenizedGenerateReqInput` of
/// sglang 0.5.23 has its `bootstrap_room` at opcode ~200, whatever its
/// prompt's length (the token ids are one `BINBYTES`).
pub const PICKLE_STEPS: u32 = 2048;
/// Opcodes from the start within which a tag must be seen: past them, a
/// frame whose tag did not match costs nothing more. The element class of
/// a sglang 0.5.23 `BatchTokenizedGenerateReqInput` is its 31st.
pub const PICKLE_TAG_STEPS: u32 = 64;
/// Most records (events) one frame yields: the elements of a batch past
/// this many are not read.
pub const PICKLE_RECORDS: usize = 8;
/// Bytes of a pickle opcode [`pickle::op`] decodes from: the opcode and up
/// to eight of argument.
pub const PICKLE_HEAD: usize = 9;
/// With two keys, the first key's value is given these many bytes of the
/// record (an integer's opcode: at most 10 for a 64-bit `LONG1`), the
/// second the rest (a string of up to 46 bytes with its opcode).
pub const PICKLE_FIRST_WIDTH: usize = 16;

/// The values of up to [`PICKLE_KEYS`] dict keys in a pickle (protocol 2
/// to 5, as Python's pickler writes a `dict` or a msgspec struct's state:
/// the key as a string, or a memo reference to its first occurrence, then
/// its value), in a pickle that names one of `tags` (a string among its
/// first [`PICKLE_TAG_STEPS`] opcodes: a class's name). A record holds one
/// value of each key, the raw bytes from the value's opcode on (the first
/// of two keys in its first [`PICKLE_FIRST_WIDTH`] bytes, the second in the
/// rest; one key: all of it); a record is emitted when it has every key,
/// when a key it has comes again (a batch's next element), and at the end
/// of the walk. With `items`: the value of the (one) key is a list, and
/// each string in it is a record of its own.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PickleCapture {
    pub tags: [[u8; PICKLE_NAME_LEN]; PICKLE_TAGS],
    /// 0: no such tag.
    pub tag_lens: [u8; PICKLE_TAGS],
    pub key_lens: [u8; PICKLE_KEYS],
    /// 1: `items`.
    pub items: u8,
    pub _pad: [u8; 3],
    pub keys: [[u8; PICKLE_NAME_LEN]; PICKLE_KEYS],
}

/// Decoding pickle opcodes, for the kernel's walk ([`PickleCapture`]) and
/// the agent's reading of what it captured. Pure functions of the
/// opcode's bytes, so both halves agree by construction.
pub mod pickle {
    use super::PICKLE_HEAD;

    pub const PROTO: u8 = 0x80;
    pub const MEMOIZE: u8 = 0x94;
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE: u8 = b'X';
    pub const STOP: u8 = b'.';
    pub const MARK: u8 = b'(';
    pub const EMPTY_LIST: u8 = b']';
    pub const APPEND: u8 = b'a';
    pub const APPENDS: u8 = b'e';
    pub const SETITEMS: u8 = b'u';

    /// What one opcode is, as far as a walk cares.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// A text string of `len` bytes after a `header` of that many.
        Str {
            len: u64,
            header: u64,
        },
        Memoize,
        /// A memo reference (`BINGET`, `LONG_BINGET`).
        Get(u64),
        /// A memo store at an explicit index (`BINPUT`, `LONG_BINPUT`).
        Put(u64),
        /// `MARK`: the start of a container's items (a dict's, a list's,
        /// a tuple's of more than three).
        Mark,
        /// An opcode that takes the items back to the last `MARK` (`APPENDS`,
        /// `SETITEMS`, `TUPLE`, `LIST`, `DICT`, `OBJ`, `POP_MARK`,
        /// `ADDITEMS`, `FROZENSET`): the container is done. A walk counts
        /// marks open to know where it is (a request's own fields, or a
        /// batch's list of them).
        PopMark,
        Stop,
        Other,
    }

    /// One opcode: its size with its argument and payload, and its kind.
    /// `None` for the newline-terminated opcodes of protocols 0 and 1 (no
    /// protocol 2+ pickler writes them) and bytes that are no opcode.
    #[inline(always)]
    pub fn op(head: &[u8; PICKLE_HEAD]) -> Option<(u64, Kind)> {
        let u8_ = u64::from(head[1]);
        let le32 = u64::from(u32::from_le_bytes([head[1], head[2], head[3], head[4]]));
        let le64 = u64::from_le_bytes([head[1], head[2], head[3], head[4], head[5], head[6], head[7], head[8]]);
        Some(match head[0] {
            SHORT_BINUNICODE => (2 + u8_, Kind::Str { len: u8_, header: 2 }),
            BINUNICODE => (5u64.checked_add(le32)?, Kind::Str { len: le32, header: 5 }),
            MEMOIZE => (1, Kind::Memoize),
            BINGET => (2, Kind::Get(u8_)),
            LONG_BINGET => (5, Kind::Get(le32)),
            BINPUT => (2, Kind::Put(u8_)),
            LONG_BINPUT => (5, Kind::Put(le32)),
            STOP => (1, Kind::Stop),
            MARK => (1, Kind::Mark),
            // APPENDS SETITEMS TUPLE LIST DICT OBJ POP_MARK ADDITEMS FROZENSET
            APPENDS | SETITEMS | b't' | b'l' | b'd' | b'o' | b'1' | 0x90 | 0x91 => (1, Kind::PopMark),
            // POP DUP NONE APPEND BUILD EMPTY_DICT EMPTY_LIST REDUCE
            // SETITEM EMPTY_TUPLE BINPERSID, and protocol 2+'s
            // argument-less ones.
            b'0'
            | b'2'
            | b'N'
            | b'a'
            | b'b'
            | b'}'
            | b']'
            | b'R'
            | b's'
            | b')'
            | b'Q'
            | 0x81
            | 0x85..=0x89
            | 0x8f
            | 0x92
            | 0x93
            | 0x97
            | 0x98 => (1, Kind::Other),
            PROTO | 0x82 | b'K' => (2, Kind::Other),
            b'U' | b'C' | 0x8a => (2 + u8_, Kind::Other),
            0x83 | b'M' => (3, Kind::Other),
            0x84 | b'J' => (5, Kind::Other),
            b'G' | 0x95 => (9, Kind::Other),
            0x8b | b'T' | b'B' => (5u64.checked_add(le32)?, Kind::Other),
            0x8d | 0x8e | 0x96 => (9u64.checked_add(le64)?, Kind::Other),
            _ => return None,
        })
    }

    /// An integer value (what a capture of one holds: `BININT1`,
    /// `BININT2`, `BININT`, `LONG1`), as u64; `None` for any other opcode,
    /// a negative number or one past 64 bits.
    pub fn uint(bytes: &[u8]) -> Option<u64> {
        let le = |body: &[u8]| body.iter().rev().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
        match *bytes.first()? {
            b'K' => Some(u64::from(*bytes.get(1)?)),
            b'M' => Some(le(bytes.get(1..3)?)),
            b'J' => {
                let value = i32::from_le_bytes(bytes.get(1..5)?.try_into().ok()?);
                u64::try_from(value).ok()
            }
            0x8a => {
                let n = usize::from(*bytes.get(1)?);
                let body = bytes.get(2..2 + n)?;
                // Two's complement, little-endian: the last byte's top bit
                // is the sign. A u64 takes up to 8 bytes, 9 with a 0 sign byte.
                match body.last() {
                    None => Some(0),
                    Some(last) if last & 0x80 != 0 => None,
                    Some(_) => {
                        let significant = body.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
                        (significant <= 8).then(|| le(&body[..significant]))
                    }
                }
            }
            _ => None,
        }
    }

    /// A text string value (`SHORT_BINUNICODE`, `BINUNICODE`): its bytes,
    /// as many as `bytes` holds (`bytes` is a capture, cut at its end), and
    /// its whole length.
    pub fn str(bytes: &[u8]) -> Option<(&[u8], u64)> {
        let (len, header) = match *bytes.first()? {
            SHORT_BINUNICODE => (u64::from(*bytes.get(1)?), 2),
            BINUNICODE => (u64::from(u32::from_le_bytes(bytes.get(1..5)?.try_into().ok()?)), 5),
            _ => return None,
        };
        let body = bytes.get(header..)?;
        let kept = body.len().min(usize::try_from(len).ok()?);
        Some((&body[..kept], len))
    }
}

/// Bits of [`Event::flags`].
pub mod event_flags {
    /// `ext` holds a NUL-terminated string.
    pub const HAS_EXT: u32 = 1 << 0;
    /// With `HAS_EXT`: `ext` holds [`EXT_ID_LEN`](super::EXT_ID_LEN) raw
    /// bytes ([`slot_flags::EXT_BYTES`](super::slot_flags::EXT_BYTES)), not a string.
    pub const EXT_BYTES: u32 = 1 << 1;
    /// The event ends the lifecycle at its stage (its slot has
    /// [`slot_flags::ENDS`](super::slot_flags::ENDS)).
    pub const ENDS: u32 = 1 << 2;
    /// [`Event::ext`](super::Event::ext) holds the times of the request's stages whose
    /// events were not sent ([`slot_flags::QUIET`](super::slot_flags::QUIET)),
    /// 0 for the others: the agent takes them as events seen then. Never
    /// with `HAS_EXT`: a record that carries the external id leaves them to
    /// the next.
    pub const WITHHELD: u32 = 1 << 3;
    /// `ext` holds one chunk of a string a [`StringWalk`](crate::StringWalk) found, `ret`
    /// says which ([`chunk::unpack`](super::chunk::unpack)).
    pub const CHUNK: u32 = 1 << 4;
    /// With `CHUNK`: the chunk is raw bytes ([`StringWalk::raw`](crate::StringWalk::raw)),
    /// as many as its place in the string says, NULs included.
    pub const RAW: u32 = 1 << 5;
    /// Set when return rule `n` matched: `RULE_MATCHED << n`.
    pub const RULE_MATCHED: u32 = 1 << 8;
    /// A pickle record ([`slot_flags::EXT_PICKLE`](super::slot_flags::EXT_PICKLE))
    /// of a pickle that matched tag `n`: `PICKLE_TAG << n`.
    pub const PICKLE_TAG: u32 = 1 << 16;
}

/// One probe hit that passed its slot's filters, as written to the ring
/// buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
    pub ts_ns: u64,
    pub key: u64,
    /// Return value (sign-extended per [`slot_flags::RET_I32`]); 0 at entry.
    pub ret: i64,
    /// Thread group id (the pid userspace sees).
    pub pid: u32,
    pub tid: u32,
    pub slot: u32,
    pub flags: u32,
    /// The lifecycle event this is (one of [`stage`]): events describe
    /// themselves, so a restarted agent can read what the previous one's
    /// probes wrote without knowing their slots.
    pub stage: u8,
    pub _pad: [u8; 7],
    /// The external id ([`event_flags::HAS_EXT`]), or with
    /// [`event_flags::WITHHELD`] the withheld stage times: the first
    /// [`stage::LIVE`] native-endian `u64`s, when each live stage whose
    /// event was not sent was first seen (0: sent, or not seen). Sharing
    /// the field keeps every record the size it was: a record's size is
    /// much of what it costs.
    pub ext: [u8; EXT_ID_LEN],
}

/// Arguments saved by a return slot's entry attachment, keyed by
/// [`SavedArgsKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SavedArgs {
    pub args: [u64; SAVED_ARGS],
    /// The stack pointer at the call's entry, 0 once its return took them:
    /// the entry is reused by the thread's next call, not deleted. A return
    /// takes them only if its stack pointer is this one past the return
    /// address, so a return filtered out leaves them behind without an
    /// outer call of a recursion (or any call but theirs) ever reading them.
    pub frame: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SavedArgsKey {
    pub pid_tgid: u64,
    pub slot: u32,
    pub _pad: u32,
}

/// Key of the in-flight table, and of the last-emitted map behind
/// [`slot_flags::ONLY_ON_CHANGE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RequestKey {
    pub key: u64,
    pub pid: u32,
    pub _pad: u32,
}

/// The event that ended a [`RequestKey`]'s lifecycle, when an
/// [`slot_flags::ONLY_ON_CHANGE`] slot emitted it (a status poll answering
/// an error): the in-flight entry that would hold it is gone, and a poll of
/// the ended request answering the same must still be suppressed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LastEmitted {
    pub ret: i64,
    pub slot: u32,
    pub _pad: u32,
}

/// What the kernel knows of one request in flight: the `INFLIGHT` map's
/// value, keyed by [`RequestKey`]. The eBPF programs keep it on every
/// lifecycle event and delete it when the lifecycle ends, so the table
/// outlives the agent (it is pinned in bpffs) and an agent restarted during
/// a stall takes over every request the previous one was following.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InflightEntry {
    pub first_ns: u64,
    pub last_ns: u64,
    /// When each live stage was first seen; 0 for never.
    pub stage_ns: [u64; stage::LIVE],
    /// The return value and slot of the last event emitted for the
    /// request ([`NOT_EMITTED`] in `last_slot` for none yet), which an
    /// [`slot_flags::ONLY_ON_CHANGE`] slot compares against: kept here, in
    /// the entry every event updates anyway, it costs no map operation of
    /// its own, and a released (reused) handle starts afresh with its entry.
    pub last_ret: i64,
    pub last_slot: u32,
    /// The furthest stage.
    pub stage: u8,
    /// `ext` holds a NUL-terminated string.
    pub has_ext: u8,
    /// 1: the lifecycle ended (at `stage`, terminal or one its slot ends
    /// at, see [`slot_flags::ENDS`]). Only while an agent's stall alert for
    /// the request is out (see `ALERTED`): the entry is kept so the next
    /// agent can report the recovery.
    pub ended: u8,
    /// What the agent was not sent of this lifecycle (see [`withheld`]).
    pub withheld: u8,
    pub ext: [u8; EXT_ID_LEN],
}

/// Bits of [`InflightEntry::withheld`].
pub mod withheld {
    /// Bit `n` (below [`stage::LIVE`](super::stage::LIVE)): live stage
    /// `n`'s first time, in `stage_ns`, was not sent; the next record sent
    /// for the request without an external id carries it, which clears
    /// the bits.
    pub const STAGES: u8 = (1 << super::stage::LIVE) - 1;
    /// The lifecycle's first event was lost (the ring buffer was full):
    /// the agent does not know of the request, so nothing of it is
    /// withheld until a record of it is sent.
    pub const UNKNOWN: u8 = 1 << 7;
}

/// [`InflightEntry::last_slot`] of a request whose events were all lost
/// (the ring buffer was full): no slot has this number.
pub const NOT_EMITTED: u32 = u32::MAX;

/// Version of the layout of everything the kernel side keeps pinned in
/// bpffs ([`InflightEntry`], [`SlotConfig`], [`Event`], the map sizes).
/// Bump it on any change: an agent never reads state pinned by an agent of
/// another layout, it discards it. 2: `COUNTERS` gained `EXT_UNREADABLE`.
/// 3: `SAVED` is an LRU hash. 4: [`InflightEntry`] holds the last event
/// emitted; `LAST` only the ends of lifecycles an `ONLY_ON_CHANGE` slot
/// emitted; [`SavedArgs`] are reused, marked `live`. 5: [`InflightEntry`]
/// says `ended` (a lifecycle can end at a live stage, [`slot_flags::ENDS`]).
/// 6: [`InflightEntry::withheld`], [`event_flags::WITHHELD`], [`SlotConfig::quiet_ns`]
/// ([`slot_flags::QUIET`]), `COUNTERS` gained `WITHHELD`. 7: [`SavedArgs`]
/// carry their call's `frame` in place of `live`. 8: [`SlotConfig::value`]
/// ([`slot_flags::ENTRY_VALUE`]) and [`SlotConfig::msgpack`]
/// ([`slot_flags::EXT_MSGPACK`]). 9: `CONTEXT` ([`HeldContext`]), what the
/// agent knew of each request it made itself (an SGLang room's destinations,
/// answers and transfer handles); [`SlotConfig`] grew (`filter`, `select`,
/// `ext_else`, [`SlotConfig::strings`],
/// [`SlotConfig::pickle`]) with new [`slot_flags`]. 10: [`SlotConfig::filter_mask`].
/// 11: [`SlotConfig::next`] (slots chained on one link: a follower has no
/// link pinned of its own) and [`SlotConfig::filter_share`].
pub const STATE_LAYOUT: u32 = 11;

/// How many bytes of a request's context [`HeldContext`] holds.
pub const CONTEXT_BYTES: usize = 1016;

/// A value of the pinned `CONTEXT` map, keyed by [`RequestKey`]: what the
/// agent knew of a request it made itself beyond what [`InflightEntry`]
/// holds (an SGLang room's destinations, answers and transfer handles),
/// serialised by the framework that made it, for the next agent. Written
/// and read by the agent only; the eBPF programs never touch it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldContext {
    /// How many of `bytes` are the context.
    pub len: u16,
    pub _pad: [u8; 6],
    pub bytes: [u8; CONTEXT_BYTES],
}

/// Indices of the per-CPU `COUNTERS` array: what the kernel side could not do.
/// Every one is reported by the agent; none is silent. The first four each
/// count one lifecycle event the agent never sees (a hit counts in at most
/// one of them); the others are not losses of events.
pub mod counter {
    /// The ring buffer was full: an event was lost.
    pub const RINGBUF_FULL: u32 = 0;
    /// The request key (or, at a [`slot_flags::RET_DEREF`](super::slot_flags::RET_DEREF)
    /// return, the value behind the return register) could not be read
    /// from user memory: an event was lost.
    pub const KEY_UNREADABLE: u32 = 1;
    /// A return that would have been an event found no arguments saved by
    /// its entry attachment: an event was lost.
    pub const ARGS_MISSING: u32 = 2;
    /// A hit on a cookie with no slot configured.
    pub const NO_SLOT: u32 = 3;
    /// Events suppressed by `ONLY_ON_CHANGE` (expected, not an error).
    pub const UNCHANGED: u32 = 4;
    /// Exec notifications lost (the EXECS ring buffer was full); discovery
    /// falls back to its periodic scan of /proc.
    pub const EXEC_LOST: u32 = 5;
    /// The in-flight table was full: a request the agent follows will not
    /// survive an agent restart.
    pub const STATE_FULL: u32 = 6;
    /// The external id could not be read: the event was delivered without it.
    pub const EXT_UNREADABLE: u32 = 7;
    /// Events kept in their request's in-flight entry, not sent
    /// ([`slot_flags::QUIET`](super::slot_flags::QUIET)): not lost.
    pub const WITHHELD: u32 = 8;
    pub const COUNT: u32 = 9;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] integer aggregates with explicit
    // padding fields, so every bit pattern is valid and none is uninit.
    unsafe impl aya::Pod for super::SlotConfig {}
    unsafe impl aya::Pod for super::Event {}
    unsafe impl aya::Pod for super::SavedArgs {}
    unsafe impl aya::Pod for super::SavedArgsKey {}
    unsafe impl aya::Pod for super::RequestKey {}
    unsafe impl aya::Pod for super::LastEmitted {}
    unsafe impl aya::Pod for super::InflightEntry {}
    unsafe impl aya::Pod for super::HeldContext {}
}
