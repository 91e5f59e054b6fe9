#!/usr/bin/env python3
"""What receiving one scheduler request costs the receiving thread, as
SGLang's scheduler receives it (io_struct.sock_recv, pickle or msgpack IPC):
a PUSH thread sends --count TokenizedGenerateReqInput of --tokens token ids
(SGLang 0.5.23's own class and sock_send) to a PULL socket; the main thread
times its sock_recv calls. `cargo bench -p stallwatch --bench recv` runs it
unwatched, with empty programs and with `stallwatch run --pid PID --profile
sglang`, side by side: the difference is what the agent's probes on the
frame cost. SGLANG_USE_PICKLE_IPC picks the IPC (SGLang's default: pickle).

JSON lines: {"event":"ready","pid"} then waits for a line on stdin, then
{"event":"result","tokens","ipc","per_request_us","count"}.
"""
import argparse, json, os, sys, threading, time
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=100)
p.add_argument("--count", type=int, default=3000)
p.add_argument("--nixl", default="cu13")
args = p.parse_args()
common.select_nixl(args.nixl)  # libnixl.so mapped, as in a prefill (the profile attaches to it)
import zmq  # noqa: E402
from array import array  # noqa: E402
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, sock_recv, sock_send  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

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


reqs = [request((1 << 62) + n) for n in range(args.count)]
print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
sys.stdin.readline()
go = threading.Event()


def pusher():
    push = ctx.socket(zmq.PUSH)
    push.connect(name)
    go.wait()
    for r in reqs:
        sock_send(push, r)


threading.Thread(target=pusher, daemon=True).start()
spent = 0.0
go.set()
for _ in range(args.count):
    pull.poll()
    t = time.perf_counter()
    sock_recv(pull)
    spent += time.perf_counter() - t
ipc = "pickle" if os.environ.get("SGLANG_USE_PICKLE_IPC", "1") not in ("0", "false") else "msgpack"
print(json.dumps({"event": "result", "tokens": args.tokens, "ipc": ipc, "count": args.count,
                  "per_request_us": round(spent / args.count * 1e6, 2)}), flush=True)
os.unlink(name[len("ipc://"):])
