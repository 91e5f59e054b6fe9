"""SGLang's process layout for the prefill target (prefill.py, `--processes
sglang`, the default): the classes run in the processes SGLang 0.5.23's
launcher puts them in.

Followed: sglang 0.5.23 (the wheel), sglang/srt/entrypoints/engine.py
`Engine._launch_subprocesses` and `_launch_scheduler_processes`,
`_set_envs_and_config` (mp.set_start_method("spawn", force=True)), and
sglang/srt/managers/scheduler.py `run_scheduler_process` /
`configure_scheduler_process`, scheduler_components/ipc_channels.py
`SchedulerIpcChannels.create`, `Scheduler.recv_requests`.

- The main process (`python prefill.py ...`, not retitled; SGLang's is
  `python -m sglang.launch_server ...`): the KV bootstrap server (SGLang
  starts it in the TokenizerManager's __init__, `start_disagg_service`:
  NixlKVBootstrapServer, whose module imports nixl, so the main process
  maps libnixl.so and makes no NIXL call) and the tokenizer side of the
  scheduler IPC: io_struct.sock_send of each TokenizedGenerateReqInput /
  AbortReq on a PUSH socket it BINDS (`get_zmq_socket(..., PUSH,
  scheduler_input_ipc_name, True)`). Besides SGLang's: the test's router and
  the decode processes it starts (a client and a load balancer would be
  elsewhere), and the JSON lines on stdout.
- One scheduler process per TP rank, started as a multiprocessing Process
  (`mp.Process(target=run_scheduler_process_func, ...)`, which SGLang
  starts with the spawn method; here with the fork server's, forks.py: the
  same process, SGLang imported once for all of them), which
  publishes its ServerArgs with its rank (`SpawnRanks(world_rank=tp_rank,
  gpu_id=0)`) and calls SGLang's own `configure_scheduler_process`: the
  parent-death signal, SGLang's logger prefix and the process title
  `sglang::scheduler` (TP1) / `sglang::scheduler_TP<rank>` (TP > 1),
  setproctitle, from the published parallel ranks. Each has its own NIXL
  agent, NixlKVManager (engine_rank = its TP rank, its share of the KV
  heads; MLA: the whole latent cache), transfer workers, senders and
  rooms. Rank 0 alone connects to the tokenizer's socket (PULL) and to the
  detokenizer (PUSH, the request's end) as `SchedulerIpcChannels` does;
  every rank gets each iteration's requests from rank 0 by
  `broadcast_pyobj` over a gloo process group (SGLang's `tp_cpu_group`),
  as `Scheduler.recv_requests` does for tp_size > 1: no rank but 0 reads a
  request from ZMQ.
- A detokenizer process (started the same way, titled `sglang::detokenizer`
  as run_detokenizer_process titles it): the scheduler's outputs land
  there. Test stand-in: it only takes them (SGLang's DetokenizerManager
  needs a tokenizer).

What the test supplies instead of a server (no model, no GPU): no model
runner, no torch.distributed model groups but the gloo group for the
request broadcast, host-memory KV (common.HostPools), the scheduler loop of
prefill.py (`Target.step`) instead of `event_loop_normal_disagg_prefill`,
and a control pipe per scheduler (a multiprocessing Pipe, as SGLang hands
each scheduler its `pipe_writer` for the init info) on which it tells the
main process its rooms' states and JSON lines, and the main process tells
it each room's decode instance, the fault room, and asks what it holds.
None of that is ZMQ or NIXL: the agent sees only SGLang's own traffic.
"""

import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import types
from multiprocessing.connection import wait as wait_conns

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import common  # noqa: E402
import forks  # noqa: E402
from common import log  # noqa: E402

# How far a room has gone; a TP > 1 room is as far as its slowest rank.
PHASE_ORDER = {"bootstrapping": 0, "fault-wait": 1, "forward": 2, "inflight": 3, "completed": 4, "failed": 4}
SETUP_S = 180


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def combined_phase(phases):
    """The phase of a room over its ranks' phases: concluded when every rank
    concluded (failed if any failed), else its least advanced rank's."""
    if all(p in ("completed", "failed") for p in phases):
        return "failed" if "failed" in phases else "completed"
    return min((p for p in phases if p not in ("completed", "failed")), key=PHASE_ORDER.get)


class _PipeOut:
    """common._OUT in a scheduler: each JSON line goes to the main process,
    which prints it (rank 0's; other ranks' room lines would repeat rank
    0's, so they are dropped)."""

    def __init__(self, conn, keep):
        self.conn = conn
        self.keep = keep

    def write(self, text):
        if self.keep and text.strip():
            self.conn.send(("line", text.rstrip("\n")))

    def flush(self):
        pass


class _TokenizerProxy:
    """A scheduler's `to_tokenizer` (prefill-abort puts the room's AbortReq
    there): handed to the main process's tokenizer."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, item):
        self.conn.send(("tokenizer", item))


class FrontMixin:
    """The main process of the prefill server (see the module's docs)."""

    BASE = None  # the target class the schedulers run, set by front()

    # ---- set-up -----------------------------------------------------------
    def start(self):
        a = self.args
        if a.prefill_tp < 1:
            raise SystemExit(f"--prefill-tp {a.prefill_tp}: a prefill has at least one rank")
        if a.prefill_tp > 1 and a.fault != "none":
            raise SystemExit(f"--fault {a.fault} with --prefill-tp {a.prefill_tp}: faults are seeded on a TP1 prefill "
                             "only")
        self.sched = []  # {"rank", "proc", "conn", "info"}
        self.detok = None
        self.mla = a.decode_shape != "tp1"
        self.bootstrap_port = free_port()
        self.tokenizer_binds = True
        self.rank_phases = {}  # room -> {rank: phase}
        self.replies = queue.Queue()
        self.fault_room_value = None
        import zmq

        self.zmq_ctx = zmq.Context()
        base = f"{tempfile.gettempdir()}/stallwatch-sglang-{os.getpid()}"
        self.ipc_name = f"ipc://{base}-scheduler"
        self.detokenizer_ipc = f"ipc://{base}-detokenizer"
        # This process's imports (SGLang's, for the bootstrap server's
        # class) first, beside the fork server's, which a fork waits for:
        # the schedulers, up in about a second once forked, then find the
        # bootstrap server up or about to be.
        BootstrapServer = self.bootstrap_server_class()
        # _set_envs_and_config (its start method: forks.py), then
        # _launch_scheduler_processes and _launch_detokenizer_subprocesses.
        mp = forks.context()
        dist_port = free_port() if a.prefill_tp > 1 else None
        for rank in range(a.prefill_tp):
            conn, child = mp.Pipe(duplex=True)
            proc = mp.Process(target=run_scheduler, args=(self.BASE, a, rank, a.prefill_tp, self.bootstrap_port,
                                                          self.ipc_name, self.detokenizer_ipc, dist_port, child))
            proc.start()
            child.close()
            self.sched.append({"rank": rank, "proc": proc, "conn": conn, "info": None})
        self.detok = mp.Process(target=run_detokenizer, args=(self.detokenizer_ipc,))
        self.detok.start()
        # Then the TokenizerManager, which starts the bootstrap server: the
        # schedulers' managers retry their PUT until it answers
        # (CommonKVManager.register_to_bootstrap).
        self.server = BootstrapServer(host="127.0.0.1", port=self.bootstrap_port)
        threading.Thread(target=self.tokenizer, daemon=True).start()
        # The decode servers (the test's), set up beside the schedulers.
        self.start_decodes()
        # wait_for_ready: each scheduler's init info on its pipe.
        deadline = time.monotonic() + SETUP_S
        while any(s["info"] is None for s in self.sched):
            if time.monotonic() > deadline:
                self.die(f"the schedulers were not ready in {SETUP_S} s")
            self.pump(0.1)
        rank0 = self.sched[0]["info"]
        # main() prints the rank's ZMQ port as `rank_port`: rank 0's.
        self.mgr = types.SimpleNamespace(rank_port=rank0["rank_port"])
        for s in self.sched:
            s["conn"].send(("set", "instances", self.instances))

    def ready_fields(self):
        fields = dict(self.sched[0]["info"]["ready"])
        fields["processes"] = "sglang"
        fields["schedulers"] = [
            {k: s["info"][k] for k in ("tp_rank", "pid", "title", "agent", "rank_port")} for s in self.sched
        ]
        fields["detokenizer"] = {"pid": self.detok.pid, "title": "sglang::detokenizer"}
        return fields

    # ---- the schedulers' messages -----------------------------------------
    @property
    def fault_room(self):
        return self.fault_room_value

    @fault_room.setter
    def fault_room(self, room):
        self.fault_room_value = room
        for s in getattr(self, "sched", ()):
            s["conn"].send(("set", "fault_room", room))

    def pump(self, timeout=0.0):
        """Take every message the schedulers sent (waiting up to `timeout`
        for the first)."""
        conns = [s["conn"] for s in self.sched]
        ready = wait_conns(conns, timeout)
        while ready:
            for conn in ready:
                s = next(s for s in self.sched if s["conn"] is conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    self.scheduler_died(s)
                self.on_message(s, msg)
            ready = wait_conns(conns, 0)

    def scheduler_died(self, s):
        s["proc"].join(5)
        self.die(f"scheduler TP{s['rank']} (pid {s['proc'].pid}) exited with {s['proc'].exitcode}")

    def die(self, reason):
        """Out, with every process this one started (a plain exit would wait
        for the non-daemon scheduler processes, as multiprocessing does)."""
        log(f"prefill: {reason}")
        common.emit("exit", reason=reason, code=1)
        procs = [s["proc"] for s in self.sched] + ([self.detok] if self.detok else [])
        for pid in [p.pid for p in procs] + [d["proc"].pid for d in self.decodes]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)

    def on_message(self, s, msg):
        kind = msg[0]
        if kind == "line":
            with common._out_lock:
                common._OUT.write(msg[1] + "\n")
                common._OUT.flush()
        elif kind == "ready":
            s["info"] = msg[1]
        elif kind == "phases":
            _, rank, phases, moved = msg
            self.moved = max(self.moved, moved)
            for room, phase in phases.items():
                self.rank_phases.setdefault(room, {})[rank] = phase
                self.mirror(room)
        elif kind == "tokenizer":
            self.to_tokenizer.put(msg[1])
        elif kind == "fault":
            st = self.rooms[msg[1]]
            self.fault_decode(st)
            s["conn"].send(("fault_done",))
        elif kind == "holding":
            self.replies.put((s["rank"], msg[1]))
        elif kind == "error":
            self.die(f"scheduler TP{s['rank']}: {msg[1]}")

    def mirror(self, room):
        """The room as run_rooms reads it (its phase over every rank)."""
        phases = self.rank_phases[room]
        st = self.rooms.get(room)
        if st is None:
            instance, _mode = self.routed.pop(room)
            inst = self.instances[instance]
            st = self.rooms[room] = {"room": room, "instance": instance, "decodes": inst["ranks"]}
        if len(phases) < len(self.sched):
            st["phase"] = "bootstrapping"
        else:
            st["phase"] = combined_phase(list(phases.values()))

    # ---- what the single-process target does itself -------------------------
    def route(self, room, instance, mode="answer"):
        for s in self.sched:
            s["conn"].send(("routed", room, instance, mode))
        super().route(room, instance, mode)

    def step(self):
        self.pump(0.0)

    def holding(self):
        for s in self.sched:
            s["conn"].send(("holding",))
        got = {}
        # A scheduler that stopped (fault prefill-stops) answers once resumed:
        # what the others hold is said without it.
        deadline = time.monotonic() + 5
        while len(got) < len(self.sched) and time.monotonic() < deadline:
            self.pump(0.05)
            while not self.replies.empty():
                rank, state = self.replies.get()
                got[rank] = state
        if 0 not in got:
            common.emit("holding", rooms={}, workers={}, unanswered=sorted(set(range(len(self.sched))) - set(got)))
            return
        line = dict(got[0])
        if len(got) < len(self.sched):
            line["unanswered"] = sorted(set(range(len(self.sched))) - set(got))
        if len(self.sched) > 1:
            line["rooms"] = {r: combined_phase([got[k]["rooms"].get(r, "bootstrapping") for k in got])
                             for r in got[0]["rooms"]}
            line["ranks"] = [{"tp_rank": k, **got[k]} for k in sorted(got)]
        common.emit("holding", **line)


def front(target_class):
    """The main process's class for `target_class` (a prefill.Target)."""
    return type(f"Front{target_class.__name__}", (FrontMixin, target_class), {"BASE": target_class})


class SchedulerMixin:
    """A scheduler process: the target's scheduler loop on SGLang's KV
    manager of one TP rank."""

    def start_rank(self, rank, tp, bootstrap_port, ipc_name, detokenizer_ipc, dist_port):
        a = self.args
        self.tp_rank, self.tp_size = rank, tp
        self.mla = a.decode_shape != "tp1"
        self.bootstrap_port = bootstrap_port
        self.addr = f"127.0.0.1:{bootstrap_port}"
        self.ipc_name, self.detokenizer_ipc = ipc_name, detokenizer_ipc
        import numpy as np

        self.np = np
        _server, Manager, Sender = self.init_backend()
        from sglang.srt.runtime_context import get_server_args

        configure_scheduler_process(get_server_args())
        from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

        self.KVPoll, self.Sender = KVPoll, Sender
        self.FINISH_ABORT, self.FINISH_LENGTH = FINISH_ABORT, FINISH_LENGTH
        self.pools = common.HostPools(np, layers=a.layers, mla=self.mla, pages=a.pages, page_bytes=a.page_bytes,
                                      aux_slots=a.aux_slots)
        heads = 2  # total KV heads of the tiny model (common._LLAMA); a rank holds its share
        kv_args = self.pools.kv_args(KVArgs, engine_rank=rank, page_size=a.page_size, mla=self.mla,
                                     kv_head_num=max(1, heads // tp), total_kv_head_num=heads)
        self.mgr = Manager(kv_args, DisaggregationMode.PREFILL, get_server_args(), self.mla)
        import zmq

        from sglang.srt.managers.io_struct import sock_recv
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper

        self.sock_recv = sock_recv
        self.zmq_ctx = zmq.Context(2)
        if rank == 0:
            self.from_tokenizer = self.zmq_ctx.socket(zmq.PULL)
            self.from_tokenizer.connect(ipc_name)
            push = self.zmq_ctx.socket(zmq.PUSH)
            push.connect(detokenizer_ipc)
            self.to_detokenizer = SenderWrapper(push)
        else:
            self.from_tokenizer = None
            self.to_detokenizer = SenderWrapper(None)
        self.cpu_group = None
        if tp > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", world_size=tp, rank=rank)
            self.cpu_group = dist.group.WORLD

    def recv_requests(self):
        if self.tp_size == 1:
            return super().recv_requests()
        import zmq

        from sglang.srt.utils.common import broadcast_pyobj

        reqs = []
        if self.tp_rank == 0:
            while True:
                try:
                    reqs.append(self.sock_recv(self.from_tokenizer, zmq.NOBLOCK))
                except zmq.Again:
                    break
        for req in broadcast_pyobj(reqs, self.tp_rank, self.cpu_group, src=0):
            self.handle_request(req)

    def new_room(self, room, rid):
        # The router sends a room's decode instance before the tokenizer
        # sends its request, but a rank that gets the request by broadcast
        # may not have read its pipe since: the message is on its way.
        while room not in self.routed:
            self.control(self.conn.recv())
        super().new_room(room, rid)

    def fault_decode(self, st):
        """The router (main process) stops or kills the decode; the room goes
        on once it has."""
        self.conn.send(("fault", st["room"]))
        while True:
            msg = self.conn.recv()
            if msg[0] == "fault_done":
                break
            self.control(msg)
        self.fault_in_place = True

    def control(self, msg):
        kind = msg[0]
        if kind == "routed":
            _, room, instance, mode = msg
            self.routed[room] = (instance, mode)
        elif kind == "set":
            setattr(self, msg[1], msg[2])
        elif kind == "holding":
            self.conn.send(("holding", self.holding_state()))

    def serve(self):
        sent, moved = {}, None
        while True:
            while self.conn.poll(0):
                self.control(self.conn.recv())
            self.step()
            diff = {r: st["phase"] for r, st in self.rooms.items() if sent.get(r) != st["phase"]}
            if diff or moved != self.moved:
                sent.update(diff)
                moved = self.moved
                self.conn.send(("phases", self.tp_rank, diff, self.moved))
            time.sleep(0.0005)


def configure_scheduler_process(server_args):
    """sglang 0.5.23's managers/scheduler.py `configure_scheduler_process`
    (no display ranks given, as run_scheduler_process calls it for TP/PP
    ranks), its statements as they are there but the CPU affinity and NUMA
    binding (no GPU): the parent-death signal, the title
    `sglang::scheduler<prefix>` from the published parallel ranks, SGLang's
    logger with that prefix. Not imported from there: scheduler.py's
    imports load the whole scheduler (einops, uvicorn, fastapi, and seconds
    per process), none of which a prefill's KV transfer uses."""
    import faulthandler

    import setproctitle
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import configure_logger, kill_itself_when_parent_died

    kill_itself_when_parent_died()
    parallel = get_parallel()
    shown_dp = parallel.dp_rank
    shown_tp = parallel.tp_rank
    shown_moe_ep = parallel.moe_ep_rank
    prefix = ""
    if shown_dp is not None:
        prefix += f" DP{shown_dp}"
    if parallel.pp_size > 1:
        prefix += f" PP{parallel.pp_rank}"
    if parallel.attn_cp_size > 1:
        prefix += f" ATTN_CP{parallel.attn_cp_rank}"
    if parallel.moe_dp_size > 1:
        prefix += f" MOE_DP{parallel.moe_dp_rank}"
    if parallel.tp_size > 1:
        prefix += f" TP{shown_tp}"
    if parallel.ep_size > 1:
        prefix += f" EP{shown_moe_ep}"
    setproctitle.setproctitle(f"sglang::scheduler{prefix.replace(' ', '_')}")
    faulthandler.enable()
    configure_logger(server_args, prefix=prefix)


def run_scheduler(target_class, args, rank, tp, bootstrap_port, ipc_name, detokenizer_ipc, dist_port, conn):
    """A scheduler process's entry (SGLang's run_scheduler_process)."""
    common._OUT = _PipeOut(conn, keep=rank == 0)
    cls = type(f"Scheduler{target_class.__name__}", (SchedulerMixin, target_class), {})
    t = cls(args)
    t.conn = conn
    t.to_tokenizer = _TokenizerProxy(conn)
    t.fault_room = None
    t.fault_in_place = False
    try:
        t.start_rank(rank, tp, bootstrap_port, ipc_name, detokenizer_ipc, dist_port)
    except Exception as e:  # said to the main process, which exits with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        title = f.read().split(b"\0")[0].decode()
    conn.send(("ready", {"tp_rank": rank, "pid": os.getpid(), "title": title, "agent": t.mgr.agent.name
                         if hasattr(t.mgr, "agent") else None, "rank_port": t.mgr.rank_port,
                         "ready": t.ready_fields()}))
    t.serve()


def run_detokenizer(ipc_name):
    """The detokenizer process's stand-in: titled as SGLang titles it, it
    takes every output the scheduler sends (so those sends never block)."""
    import ctypes
    import signal

    import setproctitle
    import zmq

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, as SGLang's kill_itself_when_parent_died
    setproctitle.setproctitle("sglang::detokenizer")
    pull = zmq.Context().socket(zmq.PULL)
    pull.bind(ipc_name)
    while True:
        pull.recv()
