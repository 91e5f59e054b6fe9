"""What tests/sglang/prefill.py and decode.py share: SGLang 0.5.23's ZMQ
frames (python/sglang/srt/disaggregation/nixl/conn.py and common/conn.py),
its KVPoll states, and the JSON-lines protocol both processes speak on
stdout. See prefill.py for the flow these reproduce."""

import json
import os
import signal
import struct
import sys
import threading

try:
    import zmq
except ImportError as e:  # a venv made before pyzmq joined the requirements
    raise SystemExit(f"{e}: pyzmq is missing from this Python; rebuild the test venv with "
                     "`cargo run --release -p xtask -- setup --python`") from e

# SGLang's first frame of every decode -> prefill bootstrap message.
GUARD = b"NixlMsgGuard"
ABORT_TAG = b"ABORT"
KV_STATUS_TAG = b"KV_STATUS"
PR_SET_PDEATHSIG = 1
SHARDS = 4  # SGLANG_DISAGGREGATION_QUEUE_SIZE, default 4


class KVPoll:
    """sglang.srt.disaggregation.base.conn.KVPoll."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


# ---------------------------------------------------------------------------
# decode -> prefill (the prefill's PULL socket)


def registration_frames(ip, port, agent_name, metadata, kv_ptrs, aux_ptrs, page_size):
    """The per-peer registration (room "None"), sent once per decode rank:
    build_receiver_registration_message, its first 13 frames (the later ones
    carry staging, state and DCP layouts this target does not use)."""
    return [
        GUARD,
        b"None",
        ip.encode("ascii"),
        str(port).encode("ascii"),
        agent_name.encode("ascii"),
        metadata,
        b"".join(struct.pack("Q", p) for p in kv_ptrs),
        b"".join(struct.pack("Q", p) for p in aux_ptrs),
        b"",  # state data pointers
        b"0",  # gpu id
        b"1",  # decode attention TP size
        b"0",  # decode attention TP rank
        str(page_size).encode("ascii"),  # kv item length
    ]


def transfer_info_frames(room, ip, port, agent_name, kv_indices, aux_index, required):
    """A room's destination (build_receiver_metadata_message): the room as
    ASCII, the decode's pages as int32 bytes, its aux slot."""
    return [
        GUARD,
        str(room).encode("ascii"),
        ip.encode("ascii"),
        str(port).encode("ascii"),
        agent_name.encode("ascii"),
        kv_indices.astype("int32").tobytes(),
        str(aux_index).encode("ascii"),
        str(required).encode("ascii"),
        b"",  # state indices
        b"0",  # decode prefix length
        b"0",  # is_dummy
    ]


def abort_frames(room, ip, port, generation):
    """AbortNotification.to_zmq."""
    return [ABORT_TAG, str(room).encode("ascii"), ip.encode("ascii"),
            str(port).encode("ascii"), str(generation).encode("ascii")]


# ---------------------------------------------------------------------------
# prefill -> decode (the decode's PULL socket)


def kv_status_frames(room, status, reason=""):
    """_encode_kv_status_message with NIXL's tag and reason frame."""
    return [KV_STATUS_TAG, str(room).encode("ascii"), str(int(status)).encode("ascii"),
            b"0", reason.encode("utf-8")]


def bind_pull(ctx, residue):
    """A PULL socket on 127.0.0.1 whose port is `residue` modulo SHARDS: the
    prefill picks a room's transfer worker by the sum of its destination
    ports, so the port decides which worker serves a decode. (The kernel
    hands out even ports to bind(0), so the port is picked here.)"""
    import random

    sock = ctx.socket(zmq.PULL)
    for _ in range(200):
        port = random.randrange(20000, 60000)
        if residue is not None:
            port += (residue - port) % SHARDS
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return sock, port
        except zmq.ZMQError:
            continue
    sock.close(linger=0)
    raise RuntimeError(f"no free port with residue {residue} modulo {SHARDS}")


def connect_push(ctx, ip, port):
    """CommonKVManager._connect: a PUSH socket that never reconnects."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(f"tcp://{ip}:{port}")
    return sock


# ---------------------------------------------------------------------------
# JSON lines on stdout; fd 1 itself goes to stderr, so that NIXL's logger and
# any C-level printf can never corrupt the protocol.
_proto = None
_proto_lock = threading.Lock()


class Stop(Exception):
    """Ends a run: stdin EOF, "quit", a signal, the deadline."""

    def __init__(self, reason, code=0):
        super().__init__(reason)
        self.reason = reason
        self.code = code


def take_stdout():
    global _proto
    fd = os.dup(1)
    os.dup2(2, 1)
    _proto = os.fdopen(fd, "w", buffering=1)


def emit(event, **fields):
    rec = {"event": event}
    rec.update(fields)
    try:
        with _proto_lock:
            _proto.write(json.dumps(rec, separators=(",", ":")) + "\n")
            _proto.flush()
    except (BrokenPipeError, OSError, ValueError):
        raise Stop("stdout-closed")


def log(who, msg):
    try:
        sys.stderr.write(f"[{who} {os.getpid()}] {msg}\n")
        sys.stderr.flush()
    except Exception:
        pass


def die_with_parent(parent_pid):
    """PR_SET_PDEATHSIG=SIGKILL: a child never outlives its prefill."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


# The NIXL driver's non-blocking line reader, for the control pipes here too.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "nixl"))
from driver import LineReader  # noqa: E402,F401  (re-exported: wire.LineReader)


def page_pattern(room, page):
    """The byte a room's page carries (never 0, so a page that landed is
    told apart from an empty one)."""
    return 1 + (room * 31 + page * 7) % 255
