"""A FUSE filesystem with one file that stops answering on command.

    frozen_fs.py MOUNTPOINT SOURCE

Mounts (as root, through mount(2) on /dev/fuse: no libfuse, no
fusermount) a read-only filesystem at MOUNTPOINT holding one file, named
as SOURCE's basename, with SOURCE's bytes. It prints `{"event": "mounted"}`
once the kernel has initialised it; then a line `freeze` on stdin makes it
stop answering reads (each is left waiting, as on a server that hangs) and
prints `{"event": "frozen"}`. Every open drops the file's page cache (no
FOPEN_KEEP_CACHE), so a reader that opens the file after the freeze waits
on the server, whatever the page cache held. At end of stdin it unmounts
lazily and exits.

The tests use it as a watched process's library whose reads never end:
the hardest thing a tenant's files can do to the agent that reads them.
Speaks the kernel's FUSE protocol (include/uapi/linux/fuse.h) directly:
only the requests a lookup, a stat, an open, reads and an mmap make.
"""
import ctypes
import json
import os
import stat
import struct
import sys
import threading

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR = 1, 2, 3
FUSE_OPEN, FUSE_READ, FUSE_STATFS, FUSE_RELEASE = 14, 15, 17, 18
FUSE_FLUSH, FUSE_INIT, FUSE_OPENDIR, FUSE_RELEASEDIR = 25, 26, 27, 29
FUSE_INTERRUPT, FUSE_DESTROY, FUSE_BATCH_FORGET = 36, 38, 42
NO_REPLY = {FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT}

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ROOT, FILE = 1, 2


def attr(ino, size, mode):
    # ino size blocks atime mtime ctime (ns x3) mode nlink uid gid rdev blksize flags
    return struct.pack("<QQQQQQIIIIIIIIII", ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode,
                       1 if ino == FILE else 2, 0, 0, 0, 4096, 0)


class Server:
    def __init__(self, fd, name, data):
        self.fd, self.name, self.data = fd, name.encode(), data
        self.frozen = threading.Event()
        self.mounted = threading.Event()

    def reply(self, unique, error=0, body=b""):
        os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)

    def attr_of(self, ino):
        if ino == ROOT:
            return attr(ROOT, 0, stat.S_IFDIR | 0o755)
        return attr(FILE, len(self.data), stat.S_IFREG | 0o755)

    def serve(self):
        while True:
            try:
                request = os.read(self.fd, 1 << 20 | 4096)
            except OSError:  # unmounted
                return
            _, opcode, unique, node, *_ = IN_HEADER.unpack_from(request)
            body = request[IN_HEADER.size:]
            if opcode in NO_REPLY:
                continue
            if opcode == FUSE_INIT:
                major, minor, readahead, flags = struct.unpack_from("<IIII", body)
                # major minor max_readahead flags max_background congestion_threshold
                # max_write time_gran max_pages map_alignment flags2, then unused
                out = struct.pack("<IIIIHHIIHHI", 7, 31, readahead, 0, 16, 12, 1 << 20, 1, 256, 0, 0)
                self.reply(unique, body=out + bytes(64 - len(out)))
                self.mounted.set()
            elif opcode == FUSE_LOOKUP:
                if node == ROOT and body.rstrip(b"\0") == self.name:
                    # nodeid generation entry_valid attr_valid (ns x2), attr
                    self.reply(unique, body=struct.pack("<QQQQII", FILE, 0, 0, 0, 0, 0) + self.attr_of(FILE))
                else:
                    self.reply(unique, error=2)  # ENOENT
            elif opcode == FUSE_GETATTR:
                self.reply(unique, body=struct.pack("<QII", 0, 0, 0) + self.attr_of(node))
            elif opcode in (FUSE_OPEN, FUSE_OPENDIR):
                self.reply(unique, body=struct.pack("<QII", 0, 0, 0))  # fh, no FOPEN_KEEP_CACHE
            elif opcode == FUSE_READ:
                if self.frozen.is_set():
                    continue  # never answered
                _, offset, size = struct.unpack_from("<QQI", body)
                self.reply(unique, body=self.data[offset:offset + size])
            elif opcode in (FUSE_RELEASE, FUSE_RELEASEDIR, FUSE_FLUSH):
                self.reply(unique)
            elif opcode == FUSE_STATFS:
                self.reply(unique, body=struct.pack("<QQQQQIIII", 0, 0, 0, 0, 0, 4096, 255, 4096, 0) + bytes(24))
            elif opcode == FUSE_DESTROY:
                self.reply(unique)
                return
            else:
                self.reply(unique, error=38)  # ENOSYS


def main():
    mountpoint, source = sys.argv[1], sys.argv[2]
    with open(source, "rb") as f:
        data = f.read()
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"frozen_fs", mountpoint.encode(), b"fuse", 0x2 | 0x4, options) != 0:  # MS_NOSUID|MS_NODEV
        raise OSError(ctypes.get_errno(), f"mount {mountpoint}")
    server = Server(fd, os.path.basename(source), data)
    threading.Thread(target=server.serve, daemon=True).start()
    # The kernel sends INIT at the first access.
    os.stat(mountpoint)
    server.mounted.wait(10)
    print(json.dumps({"event": "mounted", "path": os.path.join(mountpoint, os.path.basename(source))}), flush=True)
    for line in sys.stdin:
        if line.strip() == "freeze":
            server.frozen.set()
            print(json.dumps({"event": "frozen"}), flush=True)
    libc.umount2(mountpoint.encode(), 2)  # MNT_DETACH


if __name__ == "__main__":
    main()
