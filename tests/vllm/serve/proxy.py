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

  Any of the three request commands takes "stream": true: the decode's
  answer is streamed, and its request line says when its first token came
  (`first_token`, for a time to first token through both servers).

Two commands act at once, even while an earlier command still runs (the
others wait for the one before them): they fill the decode so that the P/D
requests sent after them wait in its queue, as on a decode at capacity:

  {"cmd": "hog", "n": 4, "tokens": 4000}    N streamed completions sent
                                            straight to the decode (no KV
                                            transfer), each generating up to
                                            TOKENS tokens (`ignore_eos`); with
                                            the decode's `--max-num-seqs` N
                                            they take every sequence slot.
                                            {"event": "hog", "n", "errors"}
                                            once each has streamed a token
                                            (is running) or failed
  {"cmd": "unhog"}                          their connections closed (vLLM
                                            aborts them); {"event":
                                            "unhogged", "n", "ended_early",
                                            "tokens"}: how many had ended on
                                            their own before (the decode was
                                            not full all along if any), and
                                            the tokens each streamed

Output, one JSON object per line on stdout:
  {"event": "ready", ...}                   after both servers answered /health
  {"event": "request", "cmd", "seq", "request_id" (the prefill's internal
   id, from its kv_transfer_params), "x_request_id" (the id the proxy sent
   in X-Request-Id), "prefill_sent", "prefill_answered", "prefill_status",
   "decode_sent", "decode_answered", "decode_status", "text", "error"}
   "first_token" (streamed only)}
   (times: Unix seconds; decode_* null for prefill_only)
  {"event": "prefill", "cmd", "seq", "request_id", "x_request_id",
   "prefill_answered"}                      as soon as the prefill answered a
                                            request (before its decode is
                                            sent): tests stop a process there
  {"event": "done", "cmd", "n", "ok", "elapsed"}
                                            after the last request of a
                                            command (elapsed: s from its
                                            start)

Usage: python proxy.py --prefill http://127.0.0.1:P --decode http://127.0.0.1:D
Standard library only.
"""

import argparse
import concurrent.futures
import http.client
import itertools
import json
import queue
import socket
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


def stream_decode(base, body, headers, rec):
    """POST a streamed completion; the text, and `first_token` set when the
    first token arrived. The status, and the error body if not 200."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, resp.read().decode(errors="replace")
        text = []
        for line in resp:
            data = line.strip()
            if not data.startswith(b"data:") or data == b"data: [DONE]":
                continue
            chunk = json.loads(data[5:])
            if rec["first_token"] is None:
                rec["first_token"] = time.time()
            text.extend(c.get("text", "") for c in chunk.get("choices", []))
        rec["text"] = "".join(text)
        return 200, None
    finally:
        conn.close()


def one(args, model, cmd, delay, stream):
    seq = next(_seq)
    x_id = f"sw-{seq}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Request-Id": x_id}
    prompt = " ".join(f"w{(seq * 7 + i) % 500}" for i in range(PROMPT_WORDS))
    rec = {"event": "request", "cmd": cmd, "seq": seq, "x_request_id": x_id, "request_id": None,
           "prefill_sent": None, "prefill_answered": None, "prefill_status": None,
           "decode_sent": None, "decode_answered": None, "decode_status": None, "text": None, "error": None,
           "first_token": None}
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
        decode = {"model": model, "prompt": prompt, "max_tokens": args.decode_tokens, "stream": False,
                  "kv_transfer_params": params}
        if stream:
            status, body = stream_decode(args.decode, decode, headers, rec)
        else:
            status, body = post(args.decode, "/v1/completions", decode, headers)
        rec["decode_answered"] = time.time()
        rec["decode_status"] = status
        if status == 200 and not stream:
            rec["text"] = body["choices"][0]["text"]
        elif status != 200:
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


class Hogs:
    """The streamed completions filling the decode (`hog`), until `unhog`."""

    def __init__(self, args, model):
        self.args, self.model = args, model
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.threads, self.socks, self.tokens, self.ended = [], [], [], []
        self.stop = threading.Event()

    def start(self, n, tokens):
        started = queue.Queue()
        for i in range(n):
            self.tokens.append(0)
            self.ended.append(False)
            thread = threading.Thread(target=self.one, args=(i, tokens, started), daemon=True)
            thread.start()
            self.threads.append(thread)
        errors = [e for e in (started.get(timeout=300) for _ in range(n)) if e]
        emit({"event": "hog", "n": n, "errors": errors})

    def one(self, i, tokens, started):
        url = urllib.parse.urlsplit(self.args.decode)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        told = False
        try:
            body = {"model": self.model, "prompt": f"w{i} w1 w2", "max_tokens": tokens, "ignore_eos": True,
                    "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            with self.lock:
                self.socks.append(conn.sock)
            resp = conn.getresponse()
            if resp.status != 200:
                started.put(f"the decode answered {resp.status}: {resp.read()[:300]!r}")
                told = True
                return
            for line in resp:
                if self.stop.is_set():
                    return
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                    self.tokens[i] += 1
                    if not told:
                        started.put(None)
                        told = True
            self.ended[i] = not self.stop.is_set()
        except Exception as e:  # the decode gone, or unhogged: reported, not raised
            if not told:
                started.put(repr(e))
                told = True
            self.ended[i] = not self.stop.is_set()
        finally:
            conn.close()

    def release(self):
        self.stop.set()
        with self.lock:
            for sock in self.socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self.threads:
            thread.join(timeout=30)
        emit({"event": "unhogged", "n": len(self.threads), "ended_early": sum(self.ended), "tokens": self.tokens})
        self.reset()


def run_command(args, model, command):
    cmd = command["cmd"]
    n = int(command.get("n", 1))
    delay = float(command.get("delay", 0)) if cmd == "delayed" else 0.0
    stream = bool(command.get("stream", False))
    started = time.time()

    def run(_):
        rec = one(args, model, cmd, delay, stream)
        emit(rec)  # as soon as it is answered: tests time alerts from it
        return rec["error"] is None

    with concurrent.futures.ThreadPoolExecutor(int(command.get("concurrency", 4))) as pool:
        ok = sum(pool.map(run, range(n)))
    emit({"event": "done", "cmd": cmd, "n": n, "ok": ok, "elapsed": time.time() - started})


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
    # The request commands run in order on one thread; hog and unhog at once.
    commands = queue.Queue()

    def worker():
        while (command := commands.get()) is not None:
            run_command(args, model, command)

    runner = threading.Thread(target=worker, daemon=True)
    runner.start()
    hogs = Hogs(args, model)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        command = json.loads(line)
        cmd = command["cmd"]
        if cmd == "quit":
            break
        if cmd == "hog":
            hogs.start(int(command.get("n", 1)), int(command.get("tokens", 1000)))
        elif cmd == "unhog":
            hogs.release()
        elif cmd in ("healthy", "prefill_only", "delayed"):
            commands.put(command)
        else:
            emit({"event": "error", "error": f"unknown cmd {cmd!r}"})
    commands.put(None)
    runner.join()


if __name__ == "__main__":
    main()
