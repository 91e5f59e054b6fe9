#!/usr/bin/env python3
"""Real NIXL workload for stallwatch's integration tests.

Two NIXL agents in two OS processes do real DRAM-to-DRAM WRITE transfers over
UCX on loopback:

  * the *initiator* ("prefill", agent name ``prefill``) is this process, the one
    stallwatch watches; every transfer is createXferReq -> postXferReq ->
    getXferStatus (polled) -> releaseXferReq, with the notification message
    ``room-<n>`` (the request's external id);
  * the *target* ("decode", agent name ``decode``) is a child process running
    this same file with the hidden ``--role target``; it drains notifications
    (getNotifs, the call under check_remote_xfer_done) and answers control
    commands on its stdin.

Metadata (agent blobs, buffer addresses) is exchanged through files in a
work directory. No torch, no GPU, no network other than loopback.

Protocol (initiator stdout, one JSON object a line, flushed; NIXL/UCX logging
that would go to stdout is redirected to stderr):

  {"event":"ready","initiator_pid":P,"target_pid":Q,...}
      both agents connected; one warm-up transfer (message "warmup") has
      already run, so the UCX connection set-up (0.13-0.26 s) is behind us
      and every transfer after this line has a clean lifecycle.
  then the driver waits for one line "go" on stdin (attach uprobes now),
  unless --no-wait. Afterwards, depending on the mode:
  {"event":"created"|"posted"|"completed"|"failed","n":i,"room":"room-i","handle":"0x..",...}
  {"event":"target_stopped","target_pid":Q}         (hang, inflight-kill)
  {"event":"holding","mode":M,...}                   the stall is in place
  {"event":"status",...}                             periodic, hang mode
  {"event":"done","transfers":N,"seconds":S,"bytes":B,...}   healthy success
  {"event":"exit","reason":R,"code":C}               always the last line
  {"event":"error","message":...}                    then exit code 1

Modes:
  healthy        N transfers, each created, posted, polled to completion,
                 released; done line has transfers/s and GB/s. Exits after
                 done unless --hold.
  never-post     K requests created (initialize_xfer) but never posted; holds.
  hang           SIGSTOPs the target, then posts K transfers that therefore
                 never complete, and keeps polling their status (every
                 --poll-interval seconds) like a prefill side would.
  no-release     K transfers posted and polled to completion, never released;
                 holds. Its "posted" lines carry before_ns, CLOCK_MONOTONIC
                 (time.monotonic_ns) just before the post.
  inflight-kill  SIGSTOPs the target, posts K transfers (in flight), prints
                 "holding" with both pids and waits (no polling) to be killed.
  target-kill    SIGSTOPs the target, posts K transfers, SIGKILLs the target,
                 polls each transfer until it fails (a "failed" line each,
                 status NIXL_ERR_REMOTE_DISCONNECT), then holds the failed
                 handles without releasing them.
  fail-release   as target-kill, but releases each failed handle as soon as
                 its poll answers the error (a "released" line each), as a
                 prefill side dropping a failed transfer does; then holds.

Holding modes run until stdin reaches EOF (or a line "quit"), SIGTERM/SIGINT/
SIGHUP, or --max-seconds. stdin EOF ends a healthy run too, so a harness keeps
stdin open for the whole run (--no-wait ignores stdin altogether). On any exit the target is SIGKILLed (after SIGCONT)
and reaped; the target also has PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILL of
the initiator leaves no orphan. --max-seconds (default 120) bounds every run;
past it the driver exits by itself with reason "max-seconds" (exit code 3 in
healthy mode, 0 in holding modes).

Transport (UCX_TLS): hang and inflight-kill default to "tcp,self", the other
modes to UCX's own choice (UCX_TLS unset: cma, i.e. process_vm_writev, for the
data and tcp on loopback for the rest). Measured with NIXL 1.5.1 and a target
stopped BEFORE the post: both settings keep every transfer IN_PROG (status 1)
for as long as the stop lasts (8/8 transfers in 6/6 runs each; 100 s runs; no
UCX keepalive error). With the default, cma has already written the bytes into
the stopped process and only the flush and the notification wait for it; with
tcp,self nothing reaches the target at all, which is why it is the default
here. --ucx-tls overrides ("default" unsets it); an UCX_TLS already in the
environment is kept when --ucx-tls is not given. If the target dies, status
polls raise nixlRemoteDisconnectError within milliseconds ("failed" lines).

Examples (the harness uses target/venv/bin/python):
  python tests/nixl/driver.py --mode healthy --count 2000 --size 4096
  python tests/nixl/driver.py --mode hang --count 4
  python tests/nixl/driver.py --mode healthy --count 20 --size 67108864 --no-wait
"""

import argparse
import ctypes
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MODES = ("healthy", "never-post", "hang", "no-release", "inflight-kill", "target-kill", "fail-release")
DEFAULT_TLS = {"hang": "tcp,self", "inflight-kill": "tcp,self", "target-kill": "tcp,self"}
INITIATOR_NAME = "prefill"
TARGET_NAME = "decode"
PR_SET_PDEATHSIG = 1


class Stop(Exception):
    """Ends the run: stdin EOF, a signal, the deadline, or a closed stdout."""

    def __init__(self, reason, code=0):
        super().__init__(reason)
        self.reason = reason
        self.code = code


class Failure(Exception):
    """Something that should have worked did not."""


# --------------------------------------------------------------------------
# stdout protocol: keep our own copy of fd 1 and send fd 1 itself to stderr,
# so that NIXL's Python logger (configured with sys.stdout) and any C-level
# printf in NIXL/UCX can never corrupt the JSON lines.
_proto = None


def take_stdout():
    global _proto
    fd = os.dup(1)
    os.dup2(2, 1)
    _proto = os.fdopen(fd, "w", buffering=1)


def emit(event, **fields):
    rec = {"event": event}
    rec.update(fields)
    try:
        _proto.write(json.dumps(rec, separators=(",", ":")) + "\n")
        _proto.flush()
    except (BrokenPipeError, OSError, ValueError):
        raise Stop("stdout-closed")


def log(msg):
    try:
        sys.stderr.write(f"[driver {os.getpid()}] {msg}\n")
        sys.stderr.flush()
    except Exception:
        pass


class LineReader:
    """Non-blocking line reader on a raw fd (select + os.read)."""

    def __init__(self, fd):
        self.fd = fd
        self.buf = b""
        self.eof = False

    def poll(self, timeout):
        """Return complete lines available within `timeout` seconds."""
        if not self.eof:
            try:
                r, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
            except InterruptedError:
                r = []
            if r:
                try:
                    data = os.read(self.fd, 65536)
                except (BlockingIOError, InterruptedError):
                    data = None
                if data == b"":
                    self.eof = True
                elif data:
                    self.buf += data
        lines = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            lines.append(line.decode(errors="replace").strip())
        if self.eof and self.buf:
            lines.append(self.buf.decode(errors="replace").strip())
            self.buf = b""
        return lines


def make_agent(name):
    from nixl_cu12 import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False))


def libnixl_path():
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("/libnixl.so"):
                    return line.split(None, 5)[5].strip()
    except OSError:
        pass
    return None


def write_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# --------------------------------------------------------------------------
# target ("decode") side


def run_target(args):
    take_stdout()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != args.parent_pid:  # parent died before prctl
        os._exit(0)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    deadline = time.monotonic() + args.max_seconds + 30

    import numpy as np

    total = args.size * args.slots
    buf = np.zeros(total, dtype=np.uint8)
    agent = make_agent(TARGET_NAME)
    agent.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
    write_atomic(os.path.join(args.workdir, "decode.md"), agent.get_agent_metadata())
    info = {"agent": TARGET_NAME, "pid": os.getpid(), "addr": buf.ctypes.data,
            "size": args.size, "slots": args.slots}
    write_atomic(os.path.join(args.workdir, "decode.json"), json.dumps(info).encode())
    emit("meta")

    ctl = LineReader(0)
    received = 0
    last = None
    last_activity = time.monotonic()
    while True:
        now = time.monotonic()
        if now > deadline:
            os._exit(3)
        # Spin while transfers are flowing (tcp needs our progress); back off
        # to 1 ms naps after 50 ms without a notification.
        idle = (now - last_activity) > 0.05
        for line in ctl.poll(0.001 if idle else 0.0):
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "peer":
                with open(os.path.join(args.workdir, "prefill.md"), "rb") as f:
                    agent.add_remote_agent(f.read())
                emit("peer")
            elif cmd[0] == "count":
                emit("count", n=received, last=last)
            elif cmd[0] == "hash":
                nbytes = min(int(cmd[1]), total)
                emit("hash", sha256=hashlib.sha256(buf[:nbytes].tobytes()).hexdigest())
            elif cmd[0] == "quit":
                os._exit(0)
        if ctl.eof:
            os._exit(0)
        notifs = agent.get_new_notifs()
        for msgs in notifs.values():
            if msgs:
                received += len(msgs)
                last = msgs[-1].decode(errors="replace")
                last_activity = time.monotonic()


# --------------------------------------------------------------------------
# initiator ("prefill") side


class Initiator:
    def __init__(self, args):
        self.args = args
        self.target = None
        self.own_workdir = False
        self.workdir = None
        self.ctl_out = None  # target's stdout (JSON lines)
        self.held = []  # handles kept alive on purpose (never released)
        self.started = time.monotonic()
        self.deadline = self.started + args.max_seconds
        self.stdin = LineReader(0)
        self.pending = []  # stdin lines read early
        self.waiting_go = False
        self.cleaned = False

    # ---- target control ------------------------------------------------
    def target_cmd(self, line):
        try:
            self.target.stdin.write((line + "\n").encode())
            self.target.stdin.flush()
        except (BrokenPipeError, OSError):
            raise Failure("target control pipe closed")

    def target_wait(self, what, timeout=30.0):
        end = min(time.monotonic() + timeout, self.deadline)
        while True:
            for line in self.ctl_out.poll(0.05):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == what:
                    return rec
            if self.ctl_out.eof:
                raise Failure(f"target exited (code {self.target.poll()}) while waiting for {what}")
            if time.monotonic() > end:
                raise Failure(f"timed out waiting for target {what}")
            self.check_stop()

    def target_count(self):
        self.target_cmd("count")
        return self.target_wait("count")

    def stop_target(self):
        os.kill(self.target.pid, signal.SIGSTOP)
        end = time.monotonic() + 5
        while proc_state(self.target.pid) not in ("T", "t"):
            if time.monotonic() > end:
                raise Failure("target did not stop")
            time.sleep(0.001)
        emit("target_stopped", target_pid=self.target.pid)

    # ---- stop conditions -----------------------------------------------
    def check_stop(self, timeout=0.0):
        """Raise Stop on stdin EOF/"quit" or the deadline; optionally nap."""
        if time.monotonic() > self.deadline:
            raise Stop("max-seconds", 3 if self.args.mode == "healthy" and not self.args.hold_now else 0)
        if self.args.no_wait:  # stdin is not ours to watch
            if timeout > 0:
                time.sleep(timeout)
            return
        for line in self.stdin.poll(timeout):
            if line in ("quit", "exit", "stop"):
                raise Stop("quit")
            self.pending.append(line)  # e.g. an early "go", read by ready()
        if self.stdin.eof and not self.waiting_go:
            raise Stop("stdin-eof")

    # ---- NIXL ------------------------------------------------------------
    def setup(self):
        import numpy as np

        a = self.args
        if a.workdir:
            self.workdir = a.workdir
            os.makedirs(self.workdir, exist_ok=True)
        else:
            self.workdir = tempfile.mkdtemp(prefix="stallwatch-nixl-")
            self.own_workdir = True
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "target",
               "--workdir", self.workdir, "--size", str(a.size), "--slots", str(a.slots),
               "--parent-pid", str(os.getpid()), "--max-seconds", str(a.max_seconds)]
        # Target first, so both agents initialise in parallel.
        self.target = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=os.environ.copy(), close_fds=True)
        self.ctl_out = LineReader(self.target.stdout.fileno())

        total = a.size * a.slots
        self.src = np.random.default_rng(a.seed).integers(0, 256, total, dtype=np.uint8)
        self.agent = make_agent(INITIATOR_NAME)
        self.agent.register_memory([(self.src.ctypes.data, total, 0, "")], "DRAM")
        write_atomic(os.path.join(self.workdir, "prefill.md"), self.agent.get_agent_metadata())

        self.target_wait("meta", timeout=60)
        t_connect = time.monotonic()
        with open(os.path.join(self.workdir, "decode.md"), "rb") as f:
            self.peer = self.agent.add_remote_agent(f.read())
        self.connect_seconds = time.monotonic() - t_connect
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        with open(os.path.join(self.workdir, "decode.json"), "rb") as f:
            tinfo = json.loads(f.read())
        self.target_cmd("peer")
        self.target_wait("peer")

        self.local = [self.agent.get_xfer_descs([(self.src.ctypes.data + i * a.size, a.size, 0)], "DRAM")
                      for i in range(a.slots)]
        self.remote = [self.agent.get_xfer_descs([(tinfo["addr"] + i * a.size, a.size, 0)], "DRAM")
                       for i in range(a.slots)]

        # Warm-up: pays the UCX connection set-up before "ready".
        t0 = time.monotonic()
        h = self.create(0, b"warmup")
        self.post(h)
        st = self.poll_until_done(h)
        if st != "DONE":
            raise Failure(f"warm-up transfer ended in {st}")
        self.agent.release_xfer_handle(h)
        self.warmup_seconds = time.monotonic() - t0
        end = time.monotonic() + 10
        while self.target_count()["n"] < 1:
            if time.monotonic() > end:
                raise Failure("target never got the warm-up notification")
            time.sleep(0.005)

    def create(self, slot, msg):
        s = slot % self.args.slots
        return self.agent.initialize_xfer("WRITE", self.local[s], self.remote[s], self.peer, msg)

    def post(self, h):
        st = self.agent.transfer(h)
        if st == "ERR":
            raise Failure("postXferReq failed")
        return st

    def poll_until_done(self, h):
        """Poll getXferStatus (at least once) until it leaves IN_PROG."""
        n = 0
        while True:
            st = self.agent.check_xfer_state(h)
            if st != "PROC":
                return st
            n += 1
            if (n & 0x3FFF) == 0:
                self.check_stop()

    def room(self, n):
        return f"{self.args.room_prefix}{n}"

    # ---- modes -----------------------------------------------------------
    def ready(self):
        a = self.args
        emit("ready", initiator_pid=os.getpid(), target_pid=self.target.pid, mode=a.mode,
             count=a.count, size=a.size, ucx_tls=os.environ.get("UCX_TLS", "default"),
             libnixl=libnixl_path(), workdir=self.workdir,
             setup_seconds=round(time.monotonic() - self.started, 4),
             connect_seconds=round(self.connect_seconds, 4),
             warmup_seconds=round(self.warmup_seconds, 4))
        if a.no_wait:
            return
        self.waiting_go = True
        while True:
            while self.pending:
                if self.pending.pop(0) == "go":
                    self.waiting_go = False
                    return
            if self.stdin.eof:
                raise Stop("stdin-eof")
            self.check_stop(0.2)

    def hold(self, mode, **fields):
        emit("holding", mode=mode, initiator_pid=os.getpid(), target_pid=self.target.pid, **fields)
        while True:
            self.check_stop(0.25)

    def run_healthy(self):
        a = self.args
        t0 = time.monotonic()
        polls = 0
        for i in range(a.count):
            n = a.room_start + i
            h = self.create(i, self.room(n).encode())
            st = self.post(h)
            if a.events:
                emit("posted", n=n, room=self.room(n), handle=hex(h._handle), post=st)
            while True:  # poll at least once, as a prefill side does
                st = self.agent.check_xfer_state(h)
                polls += 1
                if st != "PROC":
                    break
                if (polls & 0x3FFF) == 0:
                    self.check_stop()
            if st != "DONE":
                raise Failure(f"transfer {self.room(n)} ended in {st}")
            self.agent.release_xfer_handle(h)
            if (i & 0xFF) == 0xFF:
                self.check_stop()
        secs = time.monotonic() - t0
        # Every notification arrived, and the target holds the source bytes.
        end = time.monotonic() + 10
        while True:
            c = self.target_count()
            if c["n"] >= a.count + 1 or time.monotonic() > end:
                break
            time.sleep(0.002)
        nbytes = a.size * min(a.slots, a.count)
        self.target_cmd(f"hash {nbytes}")
        verified = self.target_wait("hash")["sha256"] == hashlib.sha256(self.src[:nbytes].tobytes()).hexdigest()
        total = a.count * a.size
        emit("done", transfers=a.count, seconds=round(secs, 6), bytes=total,
             transfers_per_s=round(a.count / secs, 1) if secs > 0 else None,
             gb_per_s=round(total / secs / 1e9, 4) if secs > 0 else None,
             polls=polls, notified=c["n"] - 1, last_room=c["last"], verified=verified)
        if not verified or c["n"] < a.count + 1:
            raise Failure(f"target got {c['n'] - 1} of {a.count} notifications, data verified={verified}")
        if a.hold:
            self.args.hold_now = True
            self.hold("healthy")

    def run_never_post(self):
        for i in range(self.args.count):
            n = self.args.room_start + i
            h = self.create(i, self.room(n).encode())
            self.held.append(h)
            emit("created", n=n, room=self.room(n), handle=hex(h._handle))
        self.hold("never-post", created=len(self.held))

    def run_no_release(self):
        for i in range(self.args.count):
            n = self.args.room_start + i
            h = self.create(i, self.room(n).encode())
            self.held.append(h)
            # CLOCK_MONOTONIC just before the post: a time the test knows
            # precedes it (the line itself reaches the test later).
            before_ns = time.monotonic_ns()
            st = self.post(h)
            emit("posted", n=n, room=self.room(n), handle=hex(h._handle), post=st, before_ns=before_ns)
            st = self.poll_until_done(h)
            if st != "DONE":
                raise Failure(f"transfer {self.room(n)} ended in {st}")
            emit("completed", n=n, room=self.room(n), handle=hex(h._handle))
        self.hold("no-release", unreleased=len(self.held))

    def post_to_stopped(self):
        self.stop_target()
        pending = []
        for i in range(self.args.count):
            n = self.args.room_start + i
            h = self.create(i, self.room(n).encode())
            self.held.append(h)
            st = self.post(h)
            emit("posted", n=n, room=self.room(n), handle=hex(h._handle), post=st)
            pending.append((n, h))
        return pending

    def run_hang(self):
        a = self.args
        pending = self.post_to_stopped()
        states = {}
        polls = 0
        t0 = time.monotonic()
        last_report = t0
        first = True
        while True:
            for n, h in pending:
                if states.get(n) in ("DONE", "ERR"):
                    continue
                err = None
                try:
                    st = self.agent.check_xfer_state(h)
                except Exception as e:  # e.g. nixlRemoteDisconnectError when the target dies
                    st, err = "ERR", f"{type(e).__name__}: {e}"
                polls += 1
                if st != states.get(n):
                    if st == "DONE":
                        emit("completed", n=n, room=self.room(n), handle=hex(h._handle), unexpected=True)
                    elif st == "ERR":
                        emit("failed", n=n, room=self.room(n), handle=hex(h._handle), error=err)
                    states[n] = st
            in_prog = sum(1 for s in states.values() if s == "PROC")
            if first:
                self.hold_started(in_progress=in_prog)
                first = False
            now = time.monotonic()
            if now - last_report >= a.status_interval:
                emit("status", in_progress=in_prog, polls=polls, seconds=round(now - t0, 3),
                     target_state=proc_state(self.target.pid))
                last_report = now
            self.check_stop(a.poll_interval)

    def run_target_kill(self, release=False):
        pending = self.post_to_stopped()
        os.kill(self.target.pid, signal.SIGKILL)
        self.target.wait(timeout=10)
        emit("target_killed", target_pid=self.target.pid)
        failed = set()
        while len(failed) < len(pending):
            for n, h in pending:
                if n in failed:
                    continue
                try:
                    st, err = self.agent.check_xfer_state(h), None
                except Exception as e:  # nixlRemoteDisconnectError
                    st, err = "ERR", f"{type(e).__name__}: {e}"
                if st == "DONE":
                    raise Failure(f"transfer {self.room(n)} to a killed target completed")
                if st == "ERR":
                    failed.add(n)
                    emit("failed", n=n, room=self.room(n), handle=hex(h._handle), error=err)
                    if release:
                        self.agent.release_xfer_handle(h)
                        self.held.remove(h)
                        emit("released", n=n, room=self.room(n), handle=hex(h._handle))
            self.check_stop(0.001)
        self.hold(self.args.mode, failed=len(failed))

    def hold_started(self, **fields):
        emit("holding", mode=self.args.mode, initiator_pid=os.getpid(),
             target_pid=self.target.pid, **fields)

    def run_inflight_kill(self):
        pending = self.post_to_stopped()
        in_prog = sum(1 for _, h in pending if self.agent.check_xfer_state(h) == "PROC")
        self.hold("inflight-kill", in_progress=in_prog)

    # ---- teardown ----------------------------------------------------------
    def cleanup(self):
        if self.cleaned:
            return
        self.cleaned = True
        t = self.target
        if t is not None and t.poll() is None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(t.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                t.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log("target did not die")
        if self.own_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def run_initiator(args):
    take_stdout()
    tls = args.ucx_tls if args.ucx_tls is not None else os.environ.get("UCX_TLS", DEFAULT_TLS.get(args.mode, "default"))
    if tls == "default":
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = tls
    if args.slots is None:
        args.slots = 1 if args.mode == "healthy" else max(1, min(args.count, 1024))
    args.hold_now = False

    def on_signal(signum, _frame):
        raise Stop(signal.Signals(signum).name)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    # Backstop in case the main loop cannot notice the deadline: SIGALRM's
    # handler raises; a second alarm with the default action kills us.
    def on_alarm(_signum, _frame):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(10)
        raise Stop("max-seconds", 3 if args.mode == "healthy" and not args.hold_now else 0)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.max_seconds) + 5)

    ini = Initiator(args)
    code = 0
    reason = "done"
    try:
        ini.setup()
        ini.ready()
        {"healthy": ini.run_healthy, "never-post": ini.run_never_post, "hang": ini.run_hang,
         "no-release": ini.run_no_release, "inflight-kill": ini.run_inflight_kill,
         "target-kill": ini.run_target_kill,
         "fail-release": lambda: ini.run_target_kill(release=True)}[args.mode]()
    except Stop as e:
        reason, code = e.reason, e.code
    except Failure as e:
        reason, code = "error", 1
        try:
            emit("error", message=str(e))
        except Stop:
            pass
    except Exception as e:  # noqa: BLE001 - report anything as a protocol error
        reason, code = "error", 1
        try:
            emit("error", message=f"{type(e).__name__}: {e}")
        except Stop:
            pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ini.cleanup()
    try:
        emit("exit", reason=reason, code=code)
    except Stop:
        pass
    # os._exit: skip interpreter teardown, so Python finalizers never call
    # releaseXferReq on the handles held on purpose (that would put fake
    # "released" events at the end of a stall the agent is asked to see).
    os._exit(code)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="driver.py",
        description="Real NIXL (UCX, DRAM-to-DRAM, loopback) prefill/decode workload for stallwatch tests. "
                    "Prints JSON lines on stdout; waits for 'go' on stdin after the 'ready' line.",
        epilog=__doc__.split("Modes:", 1)[1].split("Examples", 1)[0].rstrip() if "Modes:" in __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="healthy", help="workload (default: healthy)")
    p.add_argument("--count", type=int, default=None,
                   help="transfers/requests of interest (default: 100 for healthy, 4 otherwise)")
    p.add_argument("--size", type=int, default=4096, help="bytes per transfer (default: 4096)")
    p.add_argument("--slots", type=int, default=None,
                   help="distinct buffer slots of --size bytes per side (default: 1 for healthy, "
                        "min(count, 1024) otherwise)")
    p.add_argument("--room-prefix", default="room-", help="notification message prefix (default: room-)")
    p.add_argument("--room-start", type=int, default=1, help="first room number (default: 1)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="hard limit on the whole run, set-up included (default: 120)")
    p.add_argument("--no-wait", action="store_true", help="do not wait for 'go' after 'ready', and ignore stdin altogether "
                        "(holding modes then end only on a signal or --max-seconds)")
    p.add_argument("--hold", action="store_true",
                   help="healthy: after 'done', keep running until stdin EOF instead of exiting")
    p.add_argument("--events", action="store_true", help="healthy: print a 'posted' line per transfer")
    p.add_argument("--poll-interval", type=float, default=0.001,
                   help="hang: seconds between status-poll rounds, 0 = hot loop (default: 0.001)")
    p.add_argument("--status-interval", type=float, default=5.0,
                   help="hang: seconds between 'status' lines (default: 5)")
    p.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for both agents; 'default' unsets it "
                        "(default: tcp,self for hang/inflight-kill, UCX's choice otherwise)")
    p.add_argument("--workdir", default=None, help="directory for the metadata files (default: a new temp dir, removed at exit)")
    p.add_argument("--seed", type=int, default=1, help="seed of the source data pattern")
    p.add_argument("--role", choices=("initiator", "target"), default="initiator", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.count is None:
        args.count = 100 if args.mode == "healthy" else 4
    if args.count < 0 or args.size <= 0 or (args.slots is not None and args.slots <= 0):
        p.error("--count must be >= 0, --size and --slots > 0")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.role == "target":
        run_target(args)
    else:
        run_initiator(args)


if __name__ == "__main__":
    main()
