#!/usr/bin/env python3
"""What receiving one scheduler request costs the receiving thread, as
SGLang's scheduler receives it (io_struct.sock_recv, pickle or msgpack IPC):
a PUSH thread sends --count TokenizedGenerateReqInput of --tokens token ids
(SGLang 0.5.23's own class and sock_send) to a PULL socket; the main thread
times its sock_recv calls. `cargo bench -p stallwatch --bench recv` runs it
unwatched, with empty programs and with `stallwatch run --pid PID --profile
sglang`, side by side: the difference is what the agent's probes on the
frame cost. SGLANG_USE_PICKLE_IPC picks the IPC (SGLang's default: pickle).
Request n's bootstrap_room is 2**62 + n, so a watcher's rooms say which
requests it missed.

--place page-end (msgpack only) sends nothing: each request's frame, SGLang's
own msgpack encoding of it, is put in memory so that it ends `bytes_after`
bytes (n % 40) before a page that was never touched (an anonymous mapping's
second page, not yet faulted in), as libzmq's receive buffer sometimes puts
a frame, and closed with libzmq's own zmq_msg_close as pyzmq closes a frame
it received: a zmq_msg_t made by zmq_msg_init_data (a long frame, its
content_t pointing at the frame) with a metadata pointer, as libzmq's
engines give every frame they receive (a stand-in whose reference count
never reaches 0). What a uprobe on zmq_msg_close reads of it is what it
reads of a received request; only where the frame lies is chosen. A reader
that reads past the frame's end into the next page (a kernel probe cannot
fault a page in) fails on exactly those frames whose reads cross into it.

JSON lines: {"event":"ready","pid"} then waits for a line on stdin, then
{"event":"result","tokens","ipc","per_request_us","count","sent","received",
"frame_bytes","room_at"} (and "placed": [[room, bytes_after], ...] with
--place page-end).
"""
import argparse, ctypes, json, mmap, os, sys, threading, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=100)
p.add_argument("--count", type=int, default=3000)
p.add_argument("--nixl", default="cu13")
p.add_argument("--place", choices=["none", "page-end"], default="none")
args = p.parse_args()
common.select_nixl(args.nixl)  # libnixl.so mapped, as in a prefill (the profile attaches to it)
import zmq  # noqa: E402
from array import array  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    TokenizedGenerateReqInput, msgpack_encode, sock_recv, sock_send)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

ROOM0 = 1 << 62
ipc = "pickle" if os.environ.get("SGLANG_USE_PICKLE_IPC", "1") not in ("0", "false") else "msgpack"
if args.place != "none" and ipc != "msgpack":
    sys.exit("--place page-end lays out msgpack frames: run it with SGLANG_USE_PICKLE_IPC=0")

ctx = zmq.Context()
name = f"ipc:///tmp/stallwatch-recv-cost-{os.getpid()}"
pull = ctx.socket(zmq.PULL)
pull.bind(name)


def request(room):
    return TokenizedGenerateReqInput(
        rid=os.urandom(16).hex(), input_text=None, input_ids=array("i", range(args.tokens)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=1),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
        stream=False, bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=room)


reqs = [request(ROOM0 + n) for n in range(args.count)]
# Where a msgpack frame's room is (the `sglang` profile's walk ends there):
# its `cf` + 8 bytes, found in the frame of request 0.
first = msgpack_encode(reqs[0])
room_at = first.find(b"\xcf" + ROOM0.to_bytes(8, "big"))


def libzmq():
    """pyzmq's own libzmq, as mapped (the one the profile attaches to)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libzmq" in os.path.basename(path):
                return ctypes.CDLL(path)
    sys.exit("no libzmq mapped")


def placed():
    """Each request's frame ending n % 40 bytes before a page never touched;
    closed as a received frame is. Seconds spent in the closes."""
    lib = libzmq()
    lib.zmq_msg_init_data.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                      ctypes.c_void_p]
    lib.zmq_msg_close.argtypes = [ctypes.c_void_p]
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(lambda data, hint: None)
    # libzmq's metadata_t begins with its reference count (an atomic u32):
    # close drops one and deletes it at 0, which this one never reaches.
    metadata = (ctypes.c_uint32 * 16)()
    metadata[0] = 1 << 30
    page = mmap.PAGESIZE
    kept, layout, spent = [], [], 0.0
    for n, r in enumerate(reqs):
        frame = msgpack_encode(r)
        after = n % 40
        at = page - len(frame) - after
        # Two pages: the frame written into the first, the second never
        # touched (no page behind it until something faults it in).
        region = mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region[at:at + len(frame)] = frame
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        msg = (ctypes.c_uint64 * 8)()
        if lib.zmq_msg_init_data(ctypes.addressof(msg), base + at, len(frame), free, None) != 0:
            sys.exit("zmq_msg_init_data failed")
        msg[0] = ctypes.addressof(metadata)
        t = time.perf_counter()
        lib.zmq_msg_close(ctypes.addressof(msg))
        spent += time.perf_counter() - t
        kept.append(region)  # unmapped at exit, not before the watcher read it
        layout.append([ROOM0 + n, after])
    return spent, layout


print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
sys.stdin.readline()
result = {"event": "result", "tokens": args.tokens, "ipc": ipc, "count": args.count,
          "frame_bytes": len(first), "room_at": room_at}
if args.place == "page-end":
    spent, layout = placed()
    result.update(sent=0, received=args.count, placed=layout)
else:
    go = threading.Event()
    sent = [0]

    def pusher():
        push = ctx.socket(zmq.PUSH)
        push.connect(name)
        go.wait()
        for r in reqs:
            sock_send(push, r)
            sent[0] += 1

    thread = threading.Thread(target=pusher, daemon=True)
    thread.start()
    spent = 0.0
    received = 0
    go.set()
    for _ in range(args.count):
        pull.poll()
        t = time.perf_counter()
        sock_recv(pull)
        spent += time.perf_counter() - t
        received += 1
    thread.join()
    result.update(sent=sent[0], received=received)
result["per_request_us"] = round(spent / args.count * 1e6, 2)
print(json.dumps(result), flush=True)
os.unlink(name[len("ipc://"):])
