#!/usr/bin/env python3
"""SGLang's real disaggregation code as a test target: an SGLang prefill
server running SGLang's own NixlKVBootstrapServer, NixlKVManager (PREFILL)
and NixlKVSender, imported unchanged from the sglang 0.5.23 wheel (PyPI),
with real NIXL over UCX on loopback and real pyzmq, on CPU. It starts the
decode ranks as separate processes (decode.py: NixlKVManager (DECODE) and
NixlKVReceiver), each with its own pid. Every process but this one is
forked from a fork server that imported torch and SGLang once for all
(forks.py), not a fresh interpreter that imports them again.

Processes (--processes). `sglang` (what the tests run): the classes in the
processes sglang 0.5.23's launcher puts them in (entrypoints/engine.py
Engine._launch_subprocesses; launcher.py says how and what it supplies):
this main process runs the bootstrap server, the tokenizer side of the
scheduler IPC and the router; one scheduler process per prefill TP rank
(--prefill-tp), started and retitled `sglang::scheduler` /
`sglang::scheduler_TP<rank>` as SGLang does, runs that rank's KV manager,
transfer workers, senders and the scheduler loop below; a detokenizer
process takes the outputs. `one` (the class default, PROCESSES; the
Mooncake target's): everything in this process, the scheduler loop on its
main thread. Below, "the scheduler" is the scheduler process's main thread
in the first, this process's in the second.

Checked on: sglang 0.5.23, torch 2.14.1 (CUDA 13 build, no GPU), CPython
3.11.7, nixl / nixl-cu12 / nixl-cu13 1.5.1, pyzmq 27.3.0 (bundled libzmq),
UCX as bundled in the nixl wheels. libnixl.so (site-packages/
.nixl_cuXX.mesonpy.libs/libnixl.so, 1 669 529 bytes) `readelf -n` build id:
  nixl_cu12: c60ac851fdd67a4d9738b5b2f53bd4849505f241
  nixl_cu13: c60ac851fdd67a4d9738b5b2f53bd4849505f241
The two files differ in one byte only, the RPATH ($ORIGIN/../nixl_cu12.libs vs
nixl_cu13.libs): the same code, so the same offsets. libplugin_UCX.so
(68f2cc1f7a4efc9085638ab6b93a9a3659cd568f) and _bindings (469e083b1e99...)
are identical too. pyzmq's libzmq: pyzmq.libs/libzmq-2f02442c.so.5.2.5,
build id 2af6ae57aa635caeff02fbae7118ffff36d0349e.

NIXL build selection (--nixl): SGLang does `from nixl._api import ...`; the
`nixl` meta package has no switch and picks nixl_cu13 here (from
torch.version.cuda). common.select_nixl imports the chosen nixl_cuXX and
aliases its submodules as nixl, nixl._bindings, nixl._utils, nixl.logging,
nixl._api in sys.modules (what the meta package's __init__ does), before
SGLang is imported; `--nixl auto` lets the meta package choose. SGLang's code
is not touched. One build per process (both register the same pybind11
types); decodes run the same build as the prefill.

What SGLang's code does here (sglang/srt/disaggregation/{nixl,common,base}/
conn.py, prefill.py, decode.py, utils.py of the wheel)
-------------------------------------------------------------------------
- Bootstrap server (aiohttp, in this process, as the prefill launcher runs
  it): the prefill manager PUTs its rank (ip, ZMQ PULL port) to /route; each
  decode GETs /route (parallel info once, then per rank). HTTP carries no
  room.
- Prefill manager: nixl_agent(uuid4, backends=[], num_threads=8, sync STRICT)
  + create_backend("UCX", {"num_threads": "8"}); registers KV and aux (DRAM
  here); a bootstrap thread on the ZMQ PULL socket; 4 transfer workers
  (SGLANG_DISAGGREGATION_QUEUE_SIZE), a room's chunks go to worker
  sum(dst ports of the room's decode ranks) % 4.
- Decode -> prefill frames (ZMQ PUSH to the prefill's PULL, every frame bytes):
  registration once per decode rank [b"NixlMsgGuard", b"None", ip, port,
  agent name, agent metadata, kv ptrs (u64), aux ptrs, state ptrs, gpu id,
  tp size, tp rank, kv item len, state item lens, state dims, staging base,
  staging size, num slots, mem kinds ("DRAM,DRAM,..."), kv item lens (u64),
  state layer ids, kv layer ids (u32), dcp size, dcp rank, state data lens]
  (25 frames); the prefill's bootstrap thread then calls add_remote_agent and
  prep_xfer_dlist for the peer (and once the local src dlist);
  per room [b"NixlMsgGuard", room, ip, port, agent name, kv page indices
  (int32), aux index, required_dst_info_num, state indices, decode prefix
  len, is_dummy] (11 frames); ABORT: [b"ABORT", room, ip, port(, generation)].
- Prefill -> decode (PUSH to the decode rank's PULL port): [b"KV_STATUS",
  room, status (KVPoll: 0 Failed, 1 Bootstrapping, 2 WaitingForInput,
  3 Transferring, 4 Success), prefill unique rank, reason (utf-8, empty on
  success)].
- Per chunk and destination rank, the worker calls make_prepped_xfer
  ("WRITE", src dlist, src indices, dst dlist, dst indices) -> NIXL
  makeXferReq, then transfer -> postXferReq; on the last chunk, per rank, the
  aux transfer: get_xfer_descs x2 + initialize_xfer -> createXferReq, then
  postXferReq. No notification message on any of them. Then it polls all
  the chunk's handles (check_xfer_state -> getXferStatus, sleep(0) between
  rounds) unbounded while none failed; on the last chunk's success
  conclude_transfer sends KV_STATUS Success. Handles are released by
  garbage collection (nixl_xfer_handle.__del__ -> releaseXferReq).

What this target supplies instead of a server
---------------------------------------------
- ServerArgs(device="cpu", tp_size, disaggregation_mode, transfer backend
  "nixl", bootstrap port, model_path = a config.json-only tiny Llama dir,
  skip_tokenizer_init) published with runtime_context.publish(role=
  "scheduler", ranks=SpawnRanks(world_rank=tp rank, gpu_id=0)), as
  run_scheduler_process does.
- KVArgs filled as PrefillBootstrapQueue._init_kv_manager /
  DecodePreallocQueue do, pointing at numpy buffers in host memory
  (kv_data_mem_kinds DRAM): --layers layers, MHA (K and V per layer) or MLA
  (one buffer per layer), --page-bytes bytes per page and buffer; two aux
  (metadata) buffers; no state buffers (no mamba/SWA/DSA).
- The router (this process): gives each request a bootstrap room, tells its
  decode instance's ranks (stdin JSON line) and hands it to the "tokenizer",
  a thread that sends it to the scheduler over SGLang's own IPC
  (io_struct.sock_send of a TokenizedGenerateReqInput, ipc:// PUSH -> PULL);
  the scheduler loop receives it with io_struct.sock_recv and creates the
  sender from its bootstrap_room (PrefillBootstrapQueue.add). With --batch N
  the tokenizer sends N at a time as one BatchTokenizedGenerateReqInput
  (TokenizerManager._send_batch_request), which the scheduler takes one by
  one (handle_batch_generate_request).
- The prefill scheduler loop (main thread), as event_loop_normal_disagg_prefill
  drives the queues: bootstrap queue (NixlKVSender(mgr, addr, room), poll ->
  WaitingForInput -> sender.init(num_pages, aux_index); Failed ->
  failure_exception), "forward" (writes the room's pages, then per chunk
  sender.send(page indices)), inflight queue (poll -> Success: clear();
  Failed: failure_exception()); every request that ends is streamed to
  the "detokenizer" (a thread draining an ipc:// PULL socket) as
  SchedulerOutputStreamer.stream_output does: a BatchTokenIDOutput of the
  one request (FINISH_LENGTH(0) once transferred, FINISH_ABORT with the
  failure's reason otherwise) sent by SGLang's own SenderWrapper.send_output
  (sock_send), the fields a finished prefill request fills set as the
  output streamer sets them for one request without logprobs. No model,
  no forward pass, no tokenizer.
- Decode scheduler loop (decode.py): prealloc and transfer queues as
  DecodePreallocQueue / DecodeTransferQueue drive receivers.
Nothing on the transfer path is stubbed or wrapped.

Decode shapes (--decode-shape)
  tp1    --decodes TP1 decode instances, MHA model (prefill MHA).
  tp2    one TP2 decode instance, MLA model: 2 processes, required_dst_info_num
         = 2, every room goes to both ranks (MLA KV is replicated: each rank
         gets the full KV and the aux).
  mixed  MLA model: --decodes TP1 instances plus one TP2 instance.
The prefill is TP1. A decode instance's room goes to all its ranks. Each
decode rank has --decode-pages pages, handed out from a free list in order
(a fresh pool), or with --decode-free-runs N in seeded shuffled runs of N
pages (a pool after churn: a room of many pages is many runs).

Seeded faults (--fault), on --fault-room:
  none             healthy.
  no-answer        the decode creates the receiver but never sends the room's
                   destination: the prefill's room stays Bootstrapping (no
                   NIXL call) until SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
                   (300 s). With a TP2 instance only its rank 0 holds the
                   destination back; rank 1 answers (the prefill has 1 of
                   the room's required_dst_info_num = 2 destinations).
  bootstrap-timeout  no-answer with SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT =
                   --bootstrap-timeout (3 s) in the prefill: sender.poll()
                   fails the room by itself (failure_exception), with no
                   message to the decode; the scheduler then streams the
                   request's end (FINISH_ABORT) to its detokenizer.
  decode-dies      once the room is bootstrapped (and the decode's earlier
                   rooms concluded) the decode (rank 0 of the instance) is
                   SIGKILLed before the chunks go.
  hang             same point, the decode rank 0 is SIGSTOPped: the transfer
                   stays in progress (UCX over tcp) and the worker polls
                   forever; later rooms of the worker queue behind it.
  abort            the decode calls receiver.abort() (ABORT frames) when the
                   first byte of the room's KV lands; the router sends the
                   next chunk once the prefill's manager has the room Failed
                   (bounded 5 s), so the race always goes the abort's way.
  prefill-abort    right after the room's first chunk is sent, the tokenizer
                   sends the scheduler an AbortReq for the room's rid
                   (io_struct.sock_send, as SGLang's tokenizer manager does
                   when a client disconnects or asks /abort_request); the
                   scheduler receives it with sock_recv and calls
                   sender.abort() on the matching room, as
                   Scheduler.abort_request does (sglang's only callers of
                   sender.abort() are downstream of an AbortReq). The next
                   chunk waits until the abort is taken (bounded 5 s), so
                   the abort always races the room's last chunk.
  prefill-stops    right after the room's first chunk is handed to its
                   transfer worker, this process SIGSTOPs itself (every
                   thread: scheduler, bootstrap thread, transfer workers)
                   after printing prefill_stopping {room, pid}; the rooms
                   it holds stay where they were, their decodes wait.
                   SIGCONT resumes it.
  leak             a reference to the room's NIXL handles is kept outside
                   SGLang, as a debugger, a trace hook or a log record that
                   keeps a traceback would keep one: the room waits until
                   every earlier room concluded, and once it completed (its
                   worker idle, holding its last chunk's and its aux
                   handles, unreleased as SGLang leaves them) this process
                   takes the worker's `handles` from its frame
                   (sys._current_frames) and keeps them; then the later
                   rooms go, the worker drops its own references, and the
                   handles are never released (releaseXferReq never called):
                   handles_held {room, handles: ["0x..."], agents} says which.
Default fault room: the first room of decode instance 0 after the middle of
the run (abort: its last room). With hang and decode-dies the requests after
the fault room are issued once the fault is in place.

Protocol: JSON lines on stdout (the logs go to stderr; tests/support/
sglang.rs reads them). After set-up and one warm-up room per decode
instance:
  {"event":"ready","prefill_pid","decodes":[{"index","instance","pid","port",
   "tp_size","tp_rank","agent","mla"}],"instances","fault_room","shape",
   "nixl","libnixl","sglang","agent","rank_port","bootstrap_port"}
waits for "go" on stdin unless --no-wait, then prints
  request {room, rid, instance, decodes} (when the scheduler received it),
  bootstrapped {room, worker},
  chunk {room, chunk, last, pages}, completed {room}, failed {room, reason},
  prefill_abort {room}, decode_<event> {decode, ...} (answered, abort_sent,
  status {room, status, verified, reason}), decode_stopped, decode_killed,
  decode_exited, then
  done {completed, failed, verified}   every room concluded, or
  holding {rooms: {room: state}, workers: {i: [rooms of the chunks queued]}}  nothing moved
  for --settle s (states: bootstrapping, forward, inflight, completed,
  failed), then holds until stdin EOF / "quit", a signal or --max-seconds;
  last: exit {reason, code}.
No event names a transfer handle (it is made inside SGLang's worker; see
the uprobes below); `bootstrapped` carries the worker from SGLang's own
sharding formula; rooms are SGLang's bootstrap_room integers from
--room-start.

Marks (--marker LIB): enqueued when the sender is created, transfer_posted
at the first sender.send, transfer_done when poll() says Success (failed
when Failed), released at clear(), aborted with prefill-abort.

Example:
  PY=~/.cache/stallwatch/venv-sglang-<hash>/bin/python   (support::sglang_python())
  $PY tests/sglang/real/prefill.py --count 10 --no-wait
  $PY tests/sglang/real/prefill.py --decode-shape tp2 --fault hang --nixl cu12
  $PY tests/sglang/real/prefill.py --processes sglang --prefill-tp 2 --decode-shape mixed --no-wait

What the real code does, as measured
------------------------------------
Measured with bpftrace 0.17 uprobes on the libnixl.so mapped by the
processes (/proc/PID/maps: the venv's .nixl_cu13.mesonpy.libs/libnixl.so;
cu12 the same) and on pyzmq's bundled libzmq (zmq_msg_send, zmq_msg_recv),
UCX_TLS=tcp,self, UCX_NET_DEVICES=lo, prefill TP1; "room" = one request of
--pages-per-request 4 pages in --chunks 2 chunks.

Threads. Prefill: the scheduler (main thread) makes no NIXL call at all; the
bootstrap thread receives every decode frame and calls prepXferDlist; one of
the 4 transfer workers (the room's shard) makes every per-room NIXL call and
sends KV_STATUS. Decode: makes NO NIXL call per room (no getNotifs, no
getXferStatus, no genNotif): the main thread sends the registration and
TransferInfo frames, a listener thread receives KV_STATUS. The decode learns
the outcome only from the ZMQ KV_STATUS frame.

Per room, prefill transfer worker (per destination rank; TP1: 1, TP2: 2):
  makeXferReq      1 per chunk      _ZNK9nixlAgent11makeXferReqE14nixl_xfer_op_tRK10nixlDlistHSt4spanIKiLm18446744073709551615EES3_S6_RP12nixlXferReqHPK21nixlAgentOptionalArgs
                                    (or the vector overload ..._ZNK9nixlAgent11makeXferReqERK14nixl_xfer_op_tPK10nixlDlistHRKSt6vectorIiSaIiEES5_SA_RP12nixlXferReqHPK21nixlAgentOptionalArgs)
  createXferReq    1 (aux, last chunk) _ZNK9nixlAgent13createXferReqERK14nixl_xfer_op_tRK12nixlDescListI13nixlBasicDescES7_RKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERP12nixlXferReqHPK21nixlAgentOptionalArgs
  postXferReq      chunks + 1       _ZNK9nixlAgent11postXferReqEP12nixlXferReqHPK21nixlAgentOptionalArgs
                   (optional args pointer NULL; returned 1 IN_PROG for all 9
                   posts of 3 rooms on lo; on eth0 2 of 3 returned 0)
  getXferStatus    >= 1 per handle   _ZNK9nixlAgent13getXferStatusEP12nixlXferReqH
                   (16 KB chunks: 23 calls for 9 handles, 14 IN_PROG + 9 SUCCESS)
  releaseXferReq   chunks + 1, late _ZNK9nixlAgent14releaseXferReqEP12nixlXferReqH
  genNotif / getNotifs: never (_ZNK9nixlAgent8genNotifE..., _ZN9nixlAgent9getNotifsE...)
  e.g. TP1, 3 rooms (warm-up + 2): makeXferReq 6, createXferReq 3,
  postXferReq 9, releaseXferReq 7, getXferStatus 23, all on one thread.
Once per decode rank (bootstrap thread, on its registration):
add_remote_agent, then prepXferDlist for the peer's destination dlist, and
once per manager the local source dlist (2 calls for one decode rank, 3 for
a TP2 instance): _ZNK9nixlAgent13prepXferDlistERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERK12nixlDescListI14nixlStrideDescERP10nixlDlistHPK21nixlAgentOptionalArgs
(strided descriptors; the basic-desc overloads exist too).

Release (GC, nixl_xfer_handle.__del__): chunk k's handle is released when the
worker posts chunk k+1's (the `handles` list rebinds), the room's last KV
handle when the next room's first chunk is made, the aux handle when the
next room's aux handle is created. Observed order on the worker, room N:
release(last KV of N-1), post(make, chunk 0) at the SAME address, release
(chunk 0), post(make, chunk 1) at the same address again, post(create, aux),
release(aux of N-1), then KV_STATUS. The allocator reuses handle addresses
at once: key a lifecycle on (handle, generation), never the address. After
the last room the worker keeps its last KV and aux handles, unreleased and
answering SUCCESS, until traffic resumes on that worker.

Notification: none. Every handle at postXferReq has the notif optional
disengaged (+176 = 0, +152 = 0): neither the KV nor the aux transfer carries
a room id or any message; the remote agent name (+96) is the decode rank's
agent name, a uuid4 string (also sent in its ZMQ frames).

Handle layout in this build (1.5.1, cu12 and cu13 identical code), read with
bpftrace at postXferReq entry: +96 remote agent std::string (data ptr, length
at +104), +144 notif data ptr, +152 length, +176 engaged flag (checked with a
direct nixl_agent transfer with notif b"room-1000-notif-message": read back
exactly, engaged 1, on both builds), +180 op (1 = WRITE), +184 status (-1
before the post; at getXferStatus entry it holds the previous answer, 1 or 0).
NIXL.md's offsets hold.

hang (TP2, decode rank 0 SIGSTOPped when room 1001 is bootstrapped): the
worker made chunk 0's two handles (one per rank), posted both, and then
polled forever: 62 157 getXferStatus IN_PROG (the stopped rank's handle) and
62 107 SUCCESS (the live rank's handle, answering SUCCESS each round, never
released) in about 12 s on that one thread, no error, no log; chunk 1 was
never made (makeXferReq 10 = warm-up 4 + room 1000 4 + room 1001 chunk 0 2);
its later rooms stay queued in that worker's FastQueue; the scheduler's
sender.poll() says Transferring. Other workers' rooms complete.

ZMQ frames (every frame bytes; sizes for --layers 2 MHA, 4 pages):
 decode -> prefill PULL, registration, once per decode rank (25 frames):
  "NixlMsgGuard" | "None" | "127.0.0.1" | decode PULL port | agent name (36) |
  agent metadata (570, "nixlSerDes|Agent...") | kv ptrs (8/entry) | aux ptrs
  (16) | state ptrs "" | gpu id "0" | tp size | tp rank | kv item len "4096"
  | "" | "" | "" | "" | num slots "512" | "DRAM,DRAM,DRAM,DRAM" | kv item lens
  (8/entry) | "" | kv layer ids (4/entry) | dcp size "1" | dcp rank "0" | ""
 decode -> prefill, per room and rank, TransferInfo (11 frames):
  "NixlMsgGuard" | room (ASCII decimal) | ip | port | agent name | page
  indices (int32 LE, 16 bytes for 4 pages) | aux index | required_dst_info_num
  ("1"; "2" for TP2) | state indices "" | decode prefix len "0" | is_dummy "0"
 decode -> prefill, ABORT (5 frames): "ABORT" | room | ip | port | generation
  ("1"); sent from the decode's main thread by receiver.abort(). The
  prefill's bootstrap thread marks the room Failed and, once the room's
  worker has nothing in flight, answers from the bootstrap thread with
  ABORT_ACK (4 frames): "ABORT_ACK" | room | prefill rank "0" | generation
  "1" (deferred decode KV release, on by default). No KV_STATUS follows for
  the room; its later chunks and its aux are never made (the worker skips a
  Failed room: makeXferReq only for the chunk already sent).
  If the ABORT arrives after the last chunk's transfers finished, the
  prefill sends KV_STATUS Success anyway and concludes the room Success.
 prefill -> decode PULL, from the transfer worker (5 frames):
  "KV_STATUS" | room | status ("4" Success, "0" Failed) | prefill unique rank
  "0" | reason (utf-8; "" on success)
 HTTP (aiohttp bootstrap server): PUT /route by the prefill manager, GET
  /route?prefill_dp_rank=-1... (parallel info) and per rank by each decode;
  no room in HTTP.

Scheduler IPC (tokenizer -> scheduler): the target feeds every request
through SGLang's own path: io_struct.sock_send of a TokenizedGenerateReqInput
(rid "req-<room>", bootstrap_host/port/room, input_ids) on a PUSH socket
(the "tokenizer" thread) to the scheduler's PULL socket (ipc://), and the
scheduler loop does io_struct.sock_recv(NOBLOCK) and creates the sender from
req.bootstrap_room. SGLANG_USE_PICKLE_IPC defaults to True: one frame, a
pickle (protocol 5, starts 80 05 95, "msgspec._utils rebuild"), 2075 bytes for
64 input ids; class name "TokenizedGenerateReqInput" near offset 72, rid as
SHORT_BINUNICODE near offset 111, bootstrap_room as a pickle LONG1 near the
end (offset varies with the fields). With SGLANG_USE_PICKLE_IPC=0 it is
msgpack of the msgspec array_like struct (474 bytes: array header, tag string,
rid at offset ~30, bootstrap_room as uint64 0xcf near the end). Native
signal: zmq_msg_recv returning the frame length on the prefill's MAIN thread
(it returns -1 EAGAIN on every idle scheduler iteration); the frame is a
zero-copy message (msg_t type 105 at +42; content ptr at +8 -> data, size).

Scheduler output (scheduler -> detokenizer): sock_send of a BatchTokenIDOutput
from the MAIN thread at every request's end, through pyzmq's copying send
(zmq_msg_init_size, memcpy, zmq_msg_send): at zmq_msg_send's entry the
zmq_msg_t is type 102 (long message, +42), its content_t pointer at +8, the
data pointer at content+0, the size at content+8; msgpack: array16 of 54,
"BatchTokenIDOutput", then rids (`\\x91\\xa8req-1002`), http_worker_ipcs,
finished_reasons. bpftrace on the bootstrap-timeout fault: 124 bytes for a
transferred request, 243 for the timed-out one; the timed-out room's output
is the only thing on any socket when SGLang fails it (no KV_STATUS, no NIXL
call).
"""

import argparse
import json
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import forks  # noqa: E402
from common import emit, log  # noqa: E402

FAULTS = ("none", "no-answer", "bootstrap-timeout", "decode-dies", "hang", "abort", "prefill-abort", "prefill-stops",
          "leak")
WARMUP_ROOM = 10**12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_marker(path):
    if path is None:
        return None
    sys.path.insert(0, os.path.join(HERE, "../../../common/marker/python"))
    from stallwatch_marker import Marker

    return Marker(path)


def build_parser(prog="prefill.py", transfer="NIXL", faults=FAULTS):
    """The target's flags; tests/sglang/mooncake/prefill.py adds its own."""
    p = argparse.ArgumentParser(prog=prog, description=f"SGLang 0.5.23's own prefill/decode KV transfer "
                                f"classes over real {transfer} and ZMQ, with seeded faults. JSON lines on stdout.")
    p.add_argument("--fault", choices=faults, default="none")
    p.add_argument("--fault-room", type=int, default=None)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--decode-shape", choices=("tp1", "tp2", "mixed"), default="tp1")
    p.add_argument("--decodes", type=int, default=2, help="TP1 decode instances (tp1, mixed)")
    p.add_argument("--nixl", choices=("cu12", "cu13", "auto"), default="cu13")
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--pages-per-request", type=int, default=4)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (KVArgs.page_size)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--decode-pages", type=int, default=512)
    p.add_argument("--decode-free-runs", type=int, default=0,
                   help="the decodes hand pages out in shuffled runs of N (decode.py --free-runs)")
    p.add_argument("--aux-slots", type=int, default=64)
    p.add_argument("--room-start", type=int, default=1000)
    p.add_argument("--interval", type=float, default=0.005)
    p.add_argument("--step", type=float, default=0.002)
    p.add_argument("--settle", type=float, default=1.0)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--bootstrap-timeout", type=int, default=3, help="seconds (an EnvInt in SGLang)")
    p.add_argument("--marker", default=None, metavar="LIB")
    p.add_argument("--events", action="store_true", help="accepted for compatibility (no xfer events)")
    p.add_argument("--batch", type=int, default=1, help="requests per BatchTokenizedGenerateReqInput the tokenizer "
                   "sends (1: each its own TokenizedGenerateReqInput); a batch goes once full or 20 ms after its first")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--ucx-tls", default=None)
    p.add_argument("--max-seconds", type=float, default=120.0, help="from 'ready' on (set-up: 180 s, warm-up: 120 s)")
    p.add_argument("--processes", choices=("sglang", "one"), default=None,
                   help="sglang: SGLang's layout (launcher.py: this main process with the bootstrap server and the "
                   "tokenizer, a scheduler process per prefill TP rank); one: everything in this process "
                   "[default: the target's PROCESSES]")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill TP ranks, one scheduler process each "
                   "(--processes sglang)")
    p.add_argument("--rounds", type=int, default=1,
                   help="serve --count rooms this many times, each round on its own `go` (after the first round's "
                   "`done`), rooms numbered on; `done` counts the round's rooms (agent/benches/room.rs)")
    p.add_argument("--report-threads", action="store_true",
                   help="the ready line also names this process's threads by role (`threads`: {tid: role}; "
                   "agent/benches/room.rs reads each role's CPU)")
    p.add_argument("--disaggregation-mode", choices=("prefill",), default="prefill",
                   help="SGLang's own flag, so the main process's command line reads as an SGLang prefill's "
                   "(`pgrep -f 'sglang.*disaggregation-mode prefill'` finds it, as it finds SGLang's)")
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


class Target:
    """The NIXL target. The backend-specific parts are the methods up to
    `start`, overridden by the Mooncake target (tests/sglang/mooncake/)."""

    # Faults that stop (hang) or kill (decode-dies) the fault room's decode
    # rank 0 once the room is bootstrapped; later rooms wait until it is done.
    STOP_FAULTS = ("hang",)
    KILL_FAULTS = ("decode-dies",)
    # Faults whose room waits, once bootstrapped, until every earlier room
    # of any decode concluded (the fault then meets a worker that moved
    # every room before it); later rooms wait for it as for the others.
    QUIET_FAULTS = ("leak",)
    DECODE_SCRIPT = os.path.join(HERE, "decode.py")
    # The process layout without --processes: "one" (every class in this
    # process) until the tests that attach to this process by pid move to
    # SGLang's ("sglang", launcher.py).
    PROCESSES = "one"

    @staticmethod
    def configure_env(args):
        """The process environment the transfer library reads at start-up."""
        if args.ucx_tls is None:
            os.environ["UCX_TLS"] = "tcp,self"
        elif args.ucx_tls == "default":
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = args.ucx_tls
        # Loopback only: SGLang advertises get_local_ip_auto() (else the first
        # NIC's address) in its frames and /route; UCX's tcp uses lo.
        os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")

    def init_backend(self):
        """Select the NIXL build, publish the prefill's ServerArgs; SGLang's
        (bootstrap server, KV manager, sender) classes for this backend."""
        self.build = common.select_nixl(self.args.nixl)
        common.publish_server_args("prefill", self.tp_size, self.tp_rank, self.bootstrap_port)
        from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender

        return NixlKVBootstrapServer, NixlKVManager, NixlKVSender

    def bootstrap_server_class(self):
        """The bootstrap server's class, for the main process (launcher.py):
        SGLang's start_disagg_service imports it from the backend's conn
        module, which imports the library (nixl: libnixl.so is mapped)."""
        self.build = common.select_nixl(self.args.nixl)
        from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer

        return NixlKVBootstrapServer

    def decode_args(self):
        """Backend flags for decode.py."""
        return ["--nixl", self.args.nixl]

    def worker_of(self, room):
        """The transfer worker (queue index) SGLang's NIXL manager shards the
        room's chunks to: sum of the decode ranks' ZMQ ports."""
        infos = self.mgr.transfer_infos.get(room, {})
        return sum(i.dst_port for i in infos.values()) % len(self.mgr.transfer_queues)

    def ready_fields(self):
        return {"nixl": self.build, "libnixl": common.loaded_libnixl(), "agent": self.mgr.agent.name}

    def decode_fields(self, d):
        return {"agent": d["info"]["agent"]}

    def __init__(self, args):
        self.args = args
        self.marker = load_marker(args.marker)
        self.events = queue.Queue()  # (decode index, event dict) | ("stdin", line)
        self.decodes = []  # index, instance, proc, info
        self.instances = []  # {"tp": n, "ranks": [decode index]}
        self.rooms = {}
        self.moved = time.monotonic()
        self.decode_status = {}  # room -> [status events]
        self.stopped = []
        self.routed = {}  # room -> (instance, mode), until the scheduler receives it
        self.to_tokenizer = queue.Queue()
        self.abort_seen = set()
        self.exit_code = None
        self.tp_rank, self.tp_size = 0, 1  # this process's prefill rank (launcher.py: one per scheduler)
        self.tokenizer_binds = False  # SGLang's tokenizer binds its PUSH (launcher.py); here the scheduler binds

    # ---- set-up ----------------------------------------------------------
    def start(self):
        a = self.args
        mla = a.decode_shape != "tp1"
        self.mla = mla
        self.bootstrap_port = free_port()
        import numpy as np

        self.np = np
        BootstrapServer, Manager, Sender = self.init_backend()
        from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.runtime_context import get_server_args

        self.KVPoll, self.Sender = KVPoll, Sender
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

        self.FINISH_ABORT, self.FINISH_LENGTH = FINISH_ABORT, FINISH_LENGTH
        self.server = BootstrapServer(host="127.0.0.1", port=self.bootstrap_port)
        up = time.monotonic() + 30  # the server thread binds; the manager PUTs to it
        while time.monotonic() < up:
            try:
                socket.create_connection(("127.0.0.1", self.bootstrap_port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.02)
        self.pools = common.HostPools(np, layers=a.layers, mla=mla, pages=a.pages, page_bytes=a.page_bytes, aux_slots=a.aux_slots)
        kv_args = self.pools.kv_args(KVArgs, engine_rank=0, page_size=a.page_size, mla=mla, kv_head_num=2, total_kv_head_num=2)
        self.mgr = Manager(kv_args, DisaggregationMode.PREFILL, get_server_args(), mla)
        self.addr = f"127.0.0.1:{self.bootstrap_port}"
        import zmq

        from sglang.srt.managers.io_struct import sock_recv

        self.sock_recv = sock_recv
        self.zmq_ctx = zmq.Context()
        self.ipc_name = f"ipc://{tempfile.gettempdir()}/stallwatch-sglang-{os.getpid()}-scheduler"
        self.from_tokenizer = self.zmq_ctx.socket(zmq.PULL)
        self.from_tokenizer.bind(self.ipc_name)
        threading.Thread(target=self.tokenizer, daemon=True).start()
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper

        self.detokenizer_ipc = f"ipc://{tempfile.gettempdir()}/stallwatch-sglang-{os.getpid()}-detokenizer"
        to_detokenizer = self.zmq_ctx.socket(zmq.PUSH)
        to_detokenizer.connect(self.detokenizer_ipc)
        self.to_detokenizer = SenderWrapper(to_detokenizer)
        threading.Thread(target=self.detokenizer, daemon=True).start()
        self.start_decodes()

    def start_decodes(self):
        """The decode processes (each a decode rank), started and ready."""
        a = self.args
        mla = self.mla
        tp1 = a.decodes if a.decode_shape in ("tp1", "mixed") else 0
        shapes = [1] * tp1 + ([2] if a.decode_shape in ("tp2", "mixed") else [])
        for n, tp in enumerate(shapes):
            ranks = []
            for rank in range(tp):
                ranks.append(self.spawn_decode(n, tp, rank, mla))
            self.instances.append({"instance": n, "tp": tp, "ranks": ranks})
        for d in self.decodes:
            info = self.wait_decode_ready(d)
            d["info"] = info
        threading.Thread(target=self.watch_decodes, daemon=True).start()

    def spawn_decode(self, instance, tp, rank, mla):
        """A decode rank: `python DECODE_SCRIPT ...`, forked from the fork
        server (forks.py)."""
        a = self.args
        args = ["--bootstrap-port", str(self.bootstrap_port),
                "--tp-size", str(tp), "--tp-rank", str(rank), *self.decode_args(), "--layers", str(a.layers),
                "--pages", str(a.decode_pages), "--page-bytes", str(a.page_bytes), "--page-size", str(a.page_size),
                "--aux-slots", str(a.aux_slots), "--free-runs", str(a.decode_free_runs),
                "--max-seconds", str(a.max_seconds + 60)]
        if mla:
            args.append("--mla")
        proc = forks.Script(self.DECODE_SCRIPT, args)
        index = len(self.decodes)
        self.decodes.append({"index": index, "instance": instance, "proc": proc, "tp_size": tp, "tp_rank": rank})
        return index

    def wait_decode_ready(self, d):
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = d["proc"].stdout.readline()
            if not line:
                raise SystemExit(f"decode {d['index']} exited during set-up")
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "decode_ready":
                return msg
        raise SystemExit(f"decode {d['index']} not ready in 180 s")

    def watch_decodes(self):
        def pump(d):
            for line in d["proc"].stdout:
                try:
                    self.events.put((d["index"], json.loads(line)))
                except ValueError:
                    pass
            self.events.put((d["index"], {"event": "exited", "code": d["proc"].wait()}))

        for d in self.decodes:
            threading.Thread(target=pump, args=(d,), daemon=True).start()

    def tell(self, index, obj):
        try:
            proc = self.decodes[index]["proc"]
            proc.stdin.write(json.dumps(obj) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    # ---- rooms -------------------------------------------------------------
    def mark(self, room, stage):
        if self.marker is not None and room < WARMUP_ROOM:
            self.marker.mark(room, getattr(self.marker, stage))

    def route(self, room, instance, mode="answer"):
        """The router: the room goes to its decode instance's ranks and, as a
        TokenizedGenerateReqInput, through the tokenizer -> scheduler IPC."""
        self.routed[room] = (instance, mode)
        for rank, index in enumerate(self.instances[instance]["ranks"]):
            # no-answer: the instance's first rank alone holds its destination back
            rank_mode = "answer" if mode == "no-answer" and rank > 0 else mode
            self.tell(index, {"cmd": "room", "room": room, "pages": self.args.pages_per_request, "mode": rank_mode})
        self.to_tokenizer.put(("request", room))
        self.moved = time.monotonic()

    def tokenizer(self):
        """The tokenizer manager's side of the IPC (a thread here, a process in
        SGLang): io_struct.sock_send of a TokenizedGenerateReqInput (msgpack,
        msgspec array_like) on a PUSH socket to the scheduler's PULL."""
        import zmq
        from array import array

        from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput, sock_send
        from sglang.srt.sampling.sampling_params import SamplingParams

        from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput

        push = self.zmq_ctx.socket(zmq.PUSH)
        push.bind(self.ipc_name) if self.tokenizer_binds else push.connect(self.ipc_name)
        tokens = self.args.pages_per_request * self.args.page_size

        def tokenized(room):
            return TokenizedGenerateReqInput(
                rid=f"req-{room}", input_text=None, input_ids=array("i", range(tokens)), input_embeds=None,
                mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=1),
                return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
                stream=False, bootstrap_host="127.0.0.1", bootstrap_port=self.bootstrap_port, bootstrap_room=room)

        batch = []  # --batch: rooms waiting for their batch to fill
        while True:
            try:
                kind, what = self.to_tokenizer.get(timeout=0.02 if batch else None)
            except queue.Empty:
                kind, what = "flush", None
            if kind == "abort":
                sock_send(push, AbortReq(rid=what))
                continue
            if kind == "request" and self.args.batch <= 1:
                sock_send(push, tokenized(what))
                continue
            if kind == "request":
                batch.append(what)
            if batch and (kind == "flush" or len(batch) >= self.args.batch):
                # TokenizerManager._send_batch_request: one message for the batch.
                sock_send(push, BatchTokenizedGenerateReqInput(batch=[tokenized(room) for room in batch]))
                batch = []

    def detokenizer(self):
        """The detokenizer's end of the scheduler's output (a process in
        SGLang): takes every output, so the scheduler's sends never block."""
        import zmq

        pull = self.zmq_ctx.socket(zmq.PULL)
        pull.bind(self.detokenizer_ipc)
        while True:
            pull.recv()

    def stream_output(self, st, finished_reason):
        """The scheduler's stream_output of a request that finished (what
        SchedulerOutputStreamer sends to the detokenizer for it, through
        SGLang's own SenderWrapper.send_output -> sock_send): a
        BatchTokenIDOutput of that one request, which the disaggregated
        prefill sends at the end of every request: transferred
        (FINISH_LENGTH(0)), or failed or aborted (FINISH_ABORT, by
        prepare_abort)."""
        from array import array

        from sglang.srt.managers.io_struct import BatchTokenIDOutput

        none = dict.fromkeys([
            "output_ids", "input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val",
            "output_token_logprobs_idx", "input_top_logprobs_val", "input_top_logprobs_idx",
            "output_top_logprobs_val", "output_top_logprobs_idx", "input_token_ids_logprobs_val",
            "input_token_ids_logprobs_idx", "output_token_ids_logprobs_val", "output_token_ids_logprobs_idx",
            "output_token_entropy_val", "output_token_sampling_mask", "output_hidden_states", "routed_experts",
            "indexer_topk", "placeholder_tokens_idx", "placeholder_tokens_val"])
        tokens = self.args.pages_per_request * self.args.page_size
        self.to_detokenizer.send_output(BatchTokenIDOutput(
            rids=[st["rid"]], http_worker_ipcs=[None], finished_reasons=[finished_reason.to_json()],
            decoded_texts=[""], decode_ids=[array("i")], read_offsets=[0], skip_special_tokens=[True],
            spaces_between_special_tokens=[True], no_stop_trim=[False], prompt_tokens=[tokens],
            reasoning_tokens=[0], completion_tokens=[0], cached_tokens=[0], **none))

    def recv_requests(self):
        """The scheduler's recv path: io_struct.sock_recv(NOBLOCK) on its PULL
        socket, then PrefillBootstrapQueue.add -> create_sender, or, for an
        AbortReq, Scheduler.abort_request's disaggregated-prefill part:
        sender.abort() on every unconcluded room whose rid starts with the
        AbortReq's."""
        import zmq

        from sglang.srt.managers.io_struct import AbortReq, BatchTokenizedGenerateReqInput

        while True:
            try:
                req = self.sock_recv(self.from_tokenizer, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle_request(req)

    def handle_request(self, req):
        """One request the scheduler received (Scheduler.process_input_requests)."""
        from sglang.srt.managers.io_struct import AbortReq, BatchTokenizedGenerateReqInput

        if isinstance(req, AbortReq):
            self.abort_request(req.rid)
        elif isinstance(req, BatchTokenizedGenerateReqInput):
            # Scheduler.handle_batch_generate_request: each in turn.
            for one in req:
                self.new_room(one.bootstrap_room, one.rid)
        else:
            self.new_room(req.bootstrap_room, req.rid)

    def abort_request(self, rid):
        for st in self.rooms.values():
            if st["rid"].startswith(rid) and st["phase"] not in ("completed", "failed") and not st.get("aborted"):
                st["sender"].abort()
                st["aborted"] = True
                self.mark(st["room"], "ABORTED")
                self.moved = time.monotonic()
                emit("prefill_abort", room=st["room"])

    def new_room(self, room, rid):
        instance, mode = self.routed.pop(room)
        inst = self.instances[instance]
        st = {"room": room, "rid": rid, "instance": instance, "decodes": inst["ranks"], "phase": "bootstrapping",
              "pages": None, "aux": None, "chunk": 0, "next": 0.0, "quiet": room >= WARMUP_ROOM}
        self.rooms[room] = st
        st["sender"] = self.Sender(mgr=self.mgr, bootstrap_addr=self.addr, bootstrap_room=room)
        self.mark(room, "ENQUEUED")
        if not st["quiet"]:
            emit("request", room=room, rid=rid, instance=instance, decodes=inst["ranks"])
        self.moved = time.monotonic()

    def conclude(self, st, phase, **fields):
        st["phase"] = phase
        if st["pages"] is not None:
            self.pools.free(st["pages"], st["aux"])
            st["pages"] = None
        self.moved = time.monotonic()
        if not st["quiet"]:
            emit(phase, room=st["room"], **fields)

    def fail(self, st):
        try:
            st["sender"].failure_exception()
            reason = "unknown"
        except Exception as e:  # KVTransferError, as the scheduler gets it
            reason = str(e)
        self.mark(st["room"], "FAILED")
        self.stream_output(st, self.FINISH_ABORT(reason))
        self.conclude(st, "failed", reason=reason)

    def send_chunk(self, st, pages, k):
        """Hand chunk `k` of a room to SGLang's sender, as the scheduler's
        send_kv_chunk does."""
        st["sender"].send(pages)

    def fault_decode(self, st):
        """The fault on the room's decode (rank 0 of its instance): stopped
        (STOP_FAULTS) or killed (KILL_FAULTS), before its chunks go. The
        router's doing (launcher.py: the main process's)."""
        a = self.args
        room = st["room"]
        if a.fault == "leak":
            # Called once the room completed and its handles are held
            # (hold_handles), in the process the router runs in.
            self.fault_in_place = True
            return
        index = self.instances[st["instance"]]["ranks"][0]
        pid = self.decodes[index]["proc"].pid
        if a.fault in self.STOP_FAULTS:
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
            emit("decode_stopped", decode=index, pid=pid, room=room)
        elif a.fault in self.KILL_FAULTS:
            os.kill(pid, signal.SIGKILL)
            self.decodes[index]["proc"].wait()
            emit("decode_killed", decode=index, pid=pid, room=room)
        self.fault_in_place = True

    def hold_handles(self, st):
        """leak: keep the NIXL handles the room's transfer worker still
        holds (its `handles`: the last chunk's and the aux), taken from the
        worker's frame while it idles (no later room went yet), so that they
        are never released."""
        room = st["room"]
        held, agents = [], set()
        deadline = time.monotonic() + 5.0
        while not held and time.monotonic() < deadline:
            for frame in sys._current_frames().values():
                while frame is not None:
                    if frame.f_code.co_name == "transfer_worker":
                        # A snapshot of every local, kept on the frame: cleared
                        # once read, or it would keep (leak) the handles of
                        # whatever room each other worker last had.
                        local = frame.f_locals
                        if local.get("room") == room:
                            held.extend(local.get("handles") or ())
                            agents.update(i.agent_name for i in local.get("reqs_to_be_processed") or ())
                        local.clear()
                    frame = frame.f_back
            if not held:
                time.sleep(0.001)  # its worker has not bound them yet
        if not held:
            raise SystemExit(f"leak: no transfer worker holds room {room}'s handles")
        self.held_handles = held
        emit("handles_held", room=room, handles=[f"{h._handle:#x}" for h in held], agents=sorted(agents))
        self.fault_decode(st)  # the later rooms may go

    def earlier_rooms_done(self, st):
        every = self.args.fault in self.QUIET_FAULTS
        return all(o["phase"] in ("completed", "failed") for o in self.rooms.values()
                   if (every or o["instance"] == st["instance"]) and o["room"] < st["room"])

    def step(self):
        """One scheduler iteration over the bootstrap, forward and inflight queues."""
        KVPoll = self.KVPoll
        a = self.args
        self.recv_requests()
        now = time.monotonic()
        for st in list(self.rooms.values()):
            phase = st["phase"]
            room = st["room"]
            if phase == "bootstrapping":
                poll = st["sender"].poll()
                if poll == KVPoll.Failed:
                    self.fail(st)
                elif poll == KVPoll.WaitingForInput:
                    pages, aux = self.pools.alloc(a.pages_per_request)
                    if pages is None:
                        continue
                    st["pages"], st["aux"] = pages, aux
                    st["sender"].init(len(pages), aux)
                    worker = self.worker_of(room)
                    held = a.fault in self.STOP_FAULTS + self.KILL_FAULTS + self.QUIET_FAULTS
                    st["phase"] = "fault-wait" if room == self.fault_room and held else "forward"
                    self.moved = now
                    if not st["quiet"]:
                        emit("bootstrapped", room=room, worker=worker)
            elif phase == "fault-wait":
                if self.earlier_rooms_done(st):
                    if a.fault != "leak":  # leak: once the room completed
                        self.fault_decode(st)
                    st["phase"] = "forward"
            elif phase == "forward" and now >= st["next"]:
                if (a.fault == "abort" and room == self.fault_room and st["chunk"] >= 1
                        and self.mgr.request_status.get(room) != KVPoll.Failed and now < st["next"] + 5.0):
                    continue  # the next chunk once the bootstrap thread has taken the decode's ABORT
                if (a.fault == "prefill-abort" and room == self.fault_room and st["chunk"] >= 1
                        and not st.get("aborted") and now < st["next"] + 5.0):
                    continue  # the next chunk once the scheduler has taken the AbortReq
                n = a.chunks
                k = st["chunk"]
                per = -(-len(st["pages"]) // n)
                chunk_pages = st["pages"][k * per:(k + 1) * per]
                last = k == n - 1
                # The forward pass wrote this chunk's KV (and, at the end, the metadata).
                self.pools.fill(room, st["pages"]) if k == 0 else None
                if last:
                    self.pools.fill_aux(room, st["aux"])
                if k == 0:
                    self.mark(room, "TRANSFER_POSTED")
                self.send_chunk(st, self.np.array(chunk_pages, dtype=self.np.int32), k)
                st["chunk"] += 1
                st["next"] = now + a.step
                self.moved = now
                if not st["quiet"]:
                    emit("chunk", room=room, chunk=k, last=last, pages=len(chunk_pages))
                if k == 0 and room == self.fault_room and a.fault == "prefill-abort":
                    self.to_tokenizer.put(("abort", st["rid"]))
                if k == 0 and room == self.fault_room and a.fault == "prefill-stops":
                    emit("prefill_stopping", room=room, pid=os.getpid())
                    os.kill(os.getpid(), signal.SIGSTOP)
                if last or st["sender"].conclude_state == KVPoll.Failed:
                    st["phase"] = "inflight"
            elif phase == "inflight":
                poll = st["sender"].poll()
                if poll == KVPoll.Success:
                    self.mark(room, "TRANSFER_DONE")
                    st["sender"].clear()
                    self.mark(room, "RELEASED")
                    self.stream_output(st, self.FINISH_LENGTH(length=0))
                    self.conclude(st, "completed")
                    if room == self.fault_room and a.fault == "leak":
                        self.hold_handles(st)
                elif poll == KVPoll.Failed:
                    self.fail(st)

    def drain_events(self, stdin_lines):
        while True:
            try:
                index, msg = self.events.get_nowait()
            except queue.Empty:
                return
            if index == "stdin":
                stdin_lines.append(msg)
                continue
            ev = msg.pop("event", "?")
            if ev == "abort_sent":
                self.abort_seen.add(msg.get("room"))
            if ev == "status":
                self.decode_status.setdefault(msg.get("room"), []).append(msg)
            if msg.get("room", 0) >= WARMUP_ROOM:
                continue
            self.moved = time.monotonic()
            emit(f"decode_{ev}", decode=index, **msg)

    # ---- the run ------------------------------------------------------------
    def run_rooms(self, plan, deadline, warmup=False):
        """Issue `plan` [(room, instance, mode)] and drive the loop until all
        concluded (-> "done"), or nothing moved for --settle s (-> "holding")."""
        a = self.args
        stdin_lines = []
        pending = list(plan)
        next_issue = 0.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            if pending and now >= next_issue:
                room, instance, mode = pending[0]
                blocked = (not warmup and a.fault in self.STOP_FAULTS + self.KILL_FAULTS + self.QUIET_FAULTS
                           and self.fault_room is not None
                           and room > self.fault_room and not self.fault_in_place)
                if not blocked:
                    pending.pop(0)
                    self.route(room, instance, mode)
                    next_issue = now + a.interval
            self.step()
            self.drain_events(stdin_lines)
            for line in stdin_lines:
                if line.strip() == "quit":
                    return "quit"
                if line == "":
                    return "stdin-eof"
            stdin_lines.clear()
            if not pending and not self.routed and all(st["phase"] in ("completed", "failed") for st in self.rooms.values()):
                if warmup:
                    return "done"
                completed = [r for r, st in self.rooms.items() if st["phase"] == "completed" and r < WARMUP_ROOM]
                # the decodes' own verdicts on completed rooms, briefly awaited
                wait_until = time.monotonic() + 2.0
                def answered(r):
                    return len(self.decode_status.get(r, ())) >= len(self.rooms[r]["decodes"])

                while time.monotonic() < wait_until and not all(answered(r) for r in completed):
                    self.drain_events(stdin_lines)
                    time.sleep(0.005)
                verified = sum(1 for r in completed if answered(r) and all(s.get("verified") for s in self.decode_status[r]))
                failed = sum(1 for r, st in self.rooms.items() if st["phase"] == "failed" and r < WARMUP_ROOM)
                emit("done", completed=len(completed), failed=failed, verified=verified)
                return "done"
            if not warmup and (now - self.moved > a.settle and not pending or now - self.moved > max(a.settle, 5.0)):
                return "holding"
            time.sleep(0.0005)
        return "max-seconds"

    def next_round(self, deadline):
        """--rounds: the scheduler loop runs (idle) until the next `go` on
        stdin; False on EOF, `quit` or the deadline."""
        stdin_lines = []
        while time.monotonic() < deadline:
            self.step()
            self.drain_events(stdin_lines)
            for line in stdin_lines:
                if line == "" or line.strip() == "quit":
                    return False
                if line.strip() == "go":
                    return True
            stdin_lines.clear()
            time.sleep(0.0005)
        return False

    def holding(self):
        emit("holding", **self.holding_state())

    def holding_state(self):
        """What this scheduler holds: its rooms' states, and the rooms whose
        chunks wait in each worker's FastQueue (read, not taken)."""
        rooms = {str(r): st["phase"] for r, st in self.rooms.items() if r < WARMUP_ROOM}
        workers = {str(i): [c.room for c in list(q._buf) if c.room < WARMUP_ROOM] for i, q in enumerate(self.mgr.transfer_queues)}
        return {"rooms": rooms, "workers": workers, **self.holding_fields()}

    def holding_fields(self):
        """What a backend's `holding` line says besides rooms and workers."""
        return {}


# The role of each Python thread of the target, by the function it runs
# (SGLang's own threads and this target's); the main thread is the
# scheduler (--processes one).
THREAD_ROLES = {"bootstrap_thread_guarded": "bootstrap", "bootstrap_thread": "bootstrap",
                "transfer_worker": "transfer_worker", "tokenizer": "tokenizer", "detokenizer": "detokenizer"}


def thread_roles():
    """{tid: role} of every thread of this process: the Python threads by
    THREAD_ROLES (else `python:<name>`), the rest `native` (NIXL's and UCX's
    progress threads, torch's pools)."""
    roles = {}
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        target = getattr(getattr(t, "_target", None), "__name__", None)
        if t is threading.main_thread():
            roles[t.native_id] = "scheduler"
        else:
            roles[t.native_id] = THREAD_ROLES.get(target, f"python:{target or t.name}")
    for tid in os.listdir("/proc/self/task"):
        roles.setdefault(int(tid), "native")
    return {str(tid): role for tid, role in sorted(roles.items())}


def main(argv, target_class=Target, args=None):
    if args is None:
        args = parse_args(argv)
    if (args.processes or target_class.PROCESSES) == "sglang":
        import launcher

        target_class = launcher.front(target_class)
    elif args.prefill_tp != 1:
        raise SystemExit(f"--prefill-tp {args.prefill_tp} needs --processes sglang (a scheduler process per rank)")
    target_class.configure_env(args)
    if args.fault == "bootstrap-timeout":
        os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(args.bootstrap_timeout)
    common.claim_stdout()
    # Its imports run beside this process's own (forks.py).
    forks.context()
    start = time.monotonic()
    deadline = start + args.max_seconds
    t = target_class(args)
    exit_reason = {"reason": None}

    def finish(reason, code):
        for d in t.decodes:
            try:
                os.kill(d["proc"].pid, signal.SIGCONT)
                os.kill(d["proc"].pid, signal.SIGKILL)
            except OSError:
                pass
        for ipc in (getattr(t, "ipc_name", None), getattr(t, "detokenizer_ipc", None)):
            try:
                os.unlink(ipc[len("ipc://"):])
            except (OSError, TypeError):
                pass
        emit("exit", reason=reason, code=code)
        os._exit(code)

    def on_signal(signum, _frame):
        finish(f"signal {signal.Signals(signum).name}", 128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    t.fault_room = None
    t.fault_in_place = False
    t.start()
    n_inst = len(t.instances)
    # warm-up: one room per instance (UCX connection set-up, dlist preparation)
    r = t.run_rooms([(WARMUP_ROOM + i, i, "answer") for i in range(n_inst)], time.monotonic() + 120, warmup=True)
    if r != "done":
        finish(f"warm-up {r}", 1)
    plan_rooms = [(args.room_start + i, i % n_inst) for i in range(args.count)]
    if args.fault != "none":
        if args.fault_room is None:
            own = [room for room, inst in plan_rooms if inst == 0]
            if args.fault == "abort":
                args.fault_room = own[-1]
            else:
                later = [room for room in own if room >= args.room_start + args.count // 2]
                args.fault_room = (later or own)[0]
        t.fault_room = args.fault_room
    mode_of = {"no-answer": "no-answer", "bootstrap-timeout": "no-answer", "abort": "abort"}
    plan = [(room, inst, mode_of.get(args.fault, "answer") if room == t.fault_room else "answer") for room, inst in plan_rooms]
    emit("ready", prefill_pid=os.getpid(), sglang="0.5.23", **t.ready_fields(),
         **({"threads": thread_roles()} if args.report_threads else {}),
         shape=args.decode_shape, mla=t.mla, rank_port=t.mgr.rank_port,
         bootstrap_port=t.bootstrap_port, fault=args.fault, fault_room=t.fault_room,
         instances=[{"instance": i["instance"], "tp": i["tp"], "decodes": i["ranks"]} for i in t.instances],
         decodes=[{"index": d["index"], "instance": d["instance"], "pid": d["proc"].pid, "port": d["info"]["port"],
                   "tp_size": d["tp_size"], "tp_rank": d["tp_rank"], **t.decode_fields(d), "mla": t.mla}
                  for d in t.decodes])

    deadline = time.monotonic() + args.max_seconds  # set-up and warm-up have their own bounds

    def read_stdin():
        for line in sys.stdin:
            t.events.put(("stdin", line))
        t.events.put(("stdin", ""))

    if not args.no_wait:
        while time.monotonic() < deadline:
            line = sys.stdin.readline()
            if line == "" or line.strip() == "quit":
                finish("stdin-eof" if line == "" else "quit", 0)
            if line.strip() == "go":
                break
        threading.Thread(target=read_stdin, daemon=True).start()
    result = t.run_rooms(plan, deadline)
    for k in range(1, args.rounds):
        if result != "done" or not t.next_round(deadline):
            break
        # Each round's rooms its own; the concluded ones forgotten, so that
        # every round's loop walks as many rooms as the first's.
        for room in [r for r, st in t.rooms.items() if r < WARMUP_ROOM and st["phase"] in ("completed", "failed")]:
            del t.rooms[room]
            t.decode_status.pop(room, None)
        start_room = args.room_start + k * args.count
        result = t.run_rooms([(start_room + i, i % n_inst, "answer") for i in range(args.count)], deadline)
    if result in ("quit", "stdin-eof"):
        finish(result, 0)
    if result == "max-seconds":
        finish("max-seconds", 0)
    if result == "done" and not args.hold:
        finish("done", 0)
    if result == "holding":
        t.holding()
    # hold: keep the scheduler loop running (it still polls) until stdin EOF / quit / max-seconds
    stdin_lines = []
    while time.monotonic() < deadline:
        t.step()
        t.drain_events(stdin_lines)
        for line in stdin_lines:
            if line == "" and not args.no_wait:
                finish("stdin-eof", 0)
            if line.strip() == "quit":
                finish("quit", 0)
        stdin_lines.clear()
        time.sleep(0.001)
    finish("max-seconds", 0)


if __name__ == "__main__":
    main(sys.argv[1:])
