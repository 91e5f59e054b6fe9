"""A P/D proxy for two real `vllm serve` servers (a NixlConnector
`kv_producer` prefill and `kv_consumer` decode), speaking vLLM's own
disaggregation protocol as its examples' toy proxy does
(examples/disaggregated/.../toy_proxy_server.py in vllm-project/vllm):

1. POST /v1/completions to the prefill with `max_tokens: 1`, `stream: false`
   and `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill":
   false, "remote_engine_id": null, "remote_block_ids": null, "remote_host":
   null, "remote_port": null}`; the prefill computes the KV, keeps its blocks
   for the decode (until read, or until its `kv_lease_duration`) and answers
   with `kv_transfer_params` naming them (`remote_request_id` is the
   prefill's internal request id, what NIXL notifications carry);
2. POST the same prompt to the decode with those `kv_transfer_params`; the
   decode READs the KV from the prefill (NIXL) and generates.

Scenario controls: one JSON object per line on stdin, run in order (each
command's requests concurrently, up to `concurrency`, default 4):

  {"cmd": "healthy", "n": 100}              prefill then decode, N requests
  {"cmd": "prefill_only", "n": 3}           prefill only: the decode never
                                            reads them (held until the lease)
  {"cmd": "delayed", "n": 1, "delay": 15}   prefill, then the decode D s after
                                            the prefill answered (e.g. past
                                            the lease)
  {"cmd": "quit"}                           exit (also on end of stdin)

Output, one JSON object per line on stdout:
  {"event": "ready", ...}                   after both servers answered /health
  {"event": "request", "cmd", "seq", "request_id" (the prefill's internal
   id, from its kv_transfer_params), "x_request_id" (the id the proxy sent
   in X-Request-Id), "prefill_sent", "prefill_answered", "prefill_status",
   "decode_sent", "decode_answered", "decode_status", "text", "error"}
   (times: Unix seconds; decode_* null for prefill_only)
  {"event": "prefill", "cmd", "seq", "request_id", "x_request_id",
   "prefill_answered"}                      as soon as the prefill answered a
                                            request (before its decode is
                                            sent): tests stop a process there
  {"event": "done", "cmd", "n", "ok"}       after the last request of a command

Usage: python proxy.py --prefill http://127.0.0.1:P --decode http://127.0.0.1:D
Standard library only.
"""

import argparse
import concurrent.futures
import http.client
import itertools
import json
import sys
import threading
import time
import urllib.parse
import uuid

PROMPT_WORDS = 24
_print_lock = threading.Lock()
_seq = itertools.count()


def emit(obj):
    with _print_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def post(base, path, body, headers):
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, {"raw": data.decode(errors="replace")}
    finally:
        conn.close()


def get_status(base, path):
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def one(args, model, cmd, delay):
    seq = next(_seq)
    x_id = f"sw-{seq}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Request-Id": x_id}
    prompt = " ".join(f"w{(seq * 7 + i) % 500}" for i in range(PROMPT_WORDS))
    rec = {"event": "request", "cmd": cmd, "seq": seq, "x_request_id": x_id, "request_id": None,
           "prefill_sent": None, "prefill_answered": None, "prefill_status": None,
           "decode_sent": None, "decode_answered": None, "decode_status": None, "text": None, "error": None}
    try:
        rec["prefill_sent"] = time.time()
        status, body = post(args.prefill, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None},
        }, headers)
        rec["prefill_answered"] = time.time()
        rec["prefill_status"] = status
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if status != 200 or not params:
            rec["error"] = f"prefill answered {status} without kv_transfer_params: {str(body)[:300]}"
            return rec
        rec["request_id"] = params.get("remote_request_id")
        emit({"event": "prefill", "cmd": cmd, "seq": seq, "request_id": rec["request_id"],
              "x_request_id": x_id, "prefill_answered": rec["prefill_answered"]})
        if cmd == "prefill_only":
            return rec
        if delay:
            time.sleep(max(0.0, rec["prefill_answered"] + delay - time.time()))
        rec["decode_sent"] = time.time()
        status, body = post(args.decode, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": args.decode_tokens, "stream": False,
            "kv_transfer_params": params,
        }, headers)
        rec["decode_answered"] = time.time()
        rec["decode_status"] = status
        if status == 200:
            rec["text"] = body["choices"][0]["text"]
        else:
            rec["error"] = f"decode answered {status}: {str(body)[:300]}"
        return rec
    except Exception as e:  # reported, not raised: the scenario goes on
        rec["error"] = repr(e)
        return rec


def model_of(base):
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", "/v1/models")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data["data"][0]["id"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--decode-tokens", type=int, default=4)
    args = parser.parse_args()
    for base in (args.prefill, args.decode):
        if get_status(base, "/health") != 200:
            sys.exit(f"{base}/health is not 200")
    model = model_of(args.prefill)
    emit({"event": "ready", "model": model, "prefill": args.prefill, "decode": args.decode})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        command = json.loads(line)
        cmd = command["cmd"]
        if cmd == "quit":
            break
        if cmd not in ("healthy", "prefill_only", "delayed"):
            emit({"event": "error", "error": f"unknown cmd {cmd!r}"})
            continue
        n = int(command.get("n", 1))
        delay = float(command.get("delay", 0)) if cmd == "delayed" else 0.0
        def run(_):
            rec = one(args, model, cmd, delay)
            emit(rec)  # as soon as it is answered: tests time alerts from it
            return rec["error"] is None

        with concurrent.futures.ThreadPoolExecutor(int(command.get("concurrency", 4))) as pool:
            ok = sum(pool.map(run, range(n)))
        emit({"event": "done", "cmd": cmd, "n": n, "ok": ok})


if __name__ == "__main__":
    main()
