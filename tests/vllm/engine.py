#!/usr/bin/env python3
"""One vLLM engine (prefill or decode) whose KV connector is vLLM 0.33.0's
own NixlPullConnector, imported unchanged from the wheel (PyPI), with real
NIXL (UCX over loopback TCP) and real ZMQ, on CPU. tests/vllm/pd.py starts
one of each and routes requests between them; see its header for the faults.

What runs unchanged, from the vllm 0.33.0 wheel
-----------------------------------------------
- vllm.config.VllmConfig / ModelConfig / CacheConfig / KVTransferConfig
  (kv_connector "NixlConnector", kv_buffer_device "cpu"), the CPU platform
  (VLLM_TARGET_DEVICE=cpu), the CPU attention backend (CPU_ATTN) and the KV
  cache layout it resolves (resolve_kv_cache_layout, as EngineCore does).
- vllm.distributed.parallel_state: a one-rank gloo world, TP=PP=1, as the
  uniproc executor sets up.
- The KV cache config from vllm.v1.core.kv_cache_planning
  (get_global_kv_cache_groups, get_kv_cache_configs) and its tensors from
  vllm.v1.worker.utils.allocate_kv_cache, in host memory (NIXL DRAM).
- NixlPullConnector twice per process, as vLLM makes it: role SCHEDULER
  (NixlPullConnectorScheduler: get_num_new_matched_tokens, on_new_request,
  update_state_after_alloc, build_connector_meta, update_connector_output,
  request_finished; its ZMQ ROUTER side channel, the handshake listener) and
  role WORKER (NixlPullConnectorWorker: register_kv_caches, the handshake
  over ZMQ in its background thread, start_load_kv -> make_prepped_xfer
  ("READ", notif "<id>:<consumers>") + transfer, get_transfer_results ->
  get_new_notifs / check_xfer_state / release_xfer_handle, heartbeats "HB:"
  and the lease in _reqs_to_send / _reap_expired_send_leases).
- vllm.v1.request.Request with SamplingParams(extra_args={"kv_transfer_params":
  ...}), as the API server builds it; KVCacheBlocks of KVCacheBlock. A
  finished prefill goes through the Request's own append_output_token_ids,
  vllm.v1.core.sched.utils.check_stop (-> FINISHED_LENGTH_CAPPED),
  prefill_stats (PrefillStats.set / take_prefill_stats / finalize),
  get_finished_reason, take_events, as update_from_output calls them.
- The prefill's output path (role prefill, --output-path): vLLM's
  EngineCoreProc.process_output_sockets, the engine core's output IO
  thread, unchanged, in a daemon thread with ([--output-path], None, 0):
  make_zmq_socket(PUSH, connect, linger 4000, SNDHWM 0),
  MsgpackEncoder().encode_into with its reused buffers,
  EngineCoreProc._send_msg_tracking_payload (socket.send copy=False,
  track=True). What it sends: vllm.v1.engine.EngineCoreOutputs of
  EngineCoreOutput (FinishReason), stamped by EngineCore._attach_weight_version
  (run unchanged, as EngineCore.step runs it) and put on its output_queue
  as (client_index 0, outputs), as _process_engine_step puts them. The
  router (pd.py) binds the PULL and decodes with vLLM's
  MsgpackDecoder(EngineCoreOutputs), as the frontend's core client does.

What this process supplies instead of a server
----------------------------------------------
- The model: a config.json-only tiny Llama (2 layers, 2 KV heads, head size
  16, float32) in --model-dir (pd.py gives both engines one); no weights, no tokenizer
  (skip_tokenizer_init). Nothing is computed: "prefill" writes a pattern
  derived from the request id into the request's KV blocks, which the decode
  checks after its READ.
- The engine-step loop (vllm/v1/core/sched/scheduler.py and
  kv_connector_model_runner_mixin.py, reduced to what the connector sees),
  every --step seconds: admit new requests (on_new_request), schedule the
  ones allowed to run (get_num_new_matched_tokens, allocate blocks from a
  free list of block ids in place of vLLM's BlockPool,
  update_state_after_alloc), build_connector_meta(SchedulerOutput.make_empty()),
  then the worker's bind_connector_metadata / start_load_kv / wait_for_save /
  get_transfer_results / clear_connector_metadata, then
  update_connector_output with what finished. A prefill request finishes as
  soon as it is scheduled (FINISHED_LENGTH_CAPPED, max_tokens=1) and goes
  through request_finished, whose kv_transfer_params it prints; its blocks
  are held (delay_free_blocks) until finished_sending names it. A decode
  request finishes once finished_recving names it (request_finished, blocks
  freed).
- The end of Scheduler.update_from_output for the prefill: per finished
  request one EngineCoreOutput with the fields the scheduler sets for it
  (request_id, new_token_ids = the one "sampled" token, derived from the
  request id as nothing is computed; finish_reason LENGTH; stop_reason,
  events, trace_headers, num_nans_in_logits from the Request (None, None,
  None, 0: log_stats off, as with --disable-log-stats, so no events and no
  scheduler_stats); prefill_stats; kv_transfer_params = request_finished's
  return plus remote_prefill_cached_tokens, as update_from_output adds it
  when the params have do_remote_prefill), and one EngineCoreOutputs per
  step with finished requests (finished_requests None: EngineCoreProc
  builds the scheduler with include_finished_set = internal DP balancing,
  False for DP=1). Put on the queue right after the step's finishes, before
  build_connector_meta, as the real engine puts a step's outputs before the
  next schedule() hands the held request to the worker. An abort
  (EngineCore.abort_requests -> finish_requests) sends nothing: the
  scheduler makes no EngineCoreOutput for it.
- The EngineCoreProc that process_output_sockets runs on:
  object.__new__(EngineCoreProc) (no __init__: no executor, no frontend
  handshake, no input thread), with only output_queue = queue.Queue() (what
  process_output_sockets reads) and _weight_version = "default"
  (EngineCore.__init__'s value, read by _attach_weight_version).
- Control: JSON lines on stdin ({"cmd": "prefill"|"decode"|"schedule"|
  "abort", ...}) from pd.py, events as JSON lines on stdout.

Checked on: vllm 0.33.0, torch 2.14.1 (vLLM's metadata pins 2.14.0; the
wheel has no `vllm._C` by that name (it ships _C_stable_libtorch.abi3.so),
so vLLM warns "Failed to import from vllm._C" and goes on; the connector
runs on 2.14.1), CPython 3.11.7, nixl 1.5.1 (the meta package
loads nixl_cu13 here, from torch.version.cuda 13.0), pyzmq 27.3.0 (its
bundled libzmq 4.3.5, pyzmq.libs/libzmq-*.so.5.2.5), msgspec 0.23.0.
"""
import argparse
import json
import os
import sys
import threading
import time

# Set before vLLM is imported: the CPU platform, no hub look-ups.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BLOCK_SIZE = 32  # CPU_ATTN takes multiples of 32 only
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": len(LAYERS),
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}

_out_lock = threading.Lock()


def emit(event, **fields):
    line = json.dumps({"event": event, "t": time.time(), **fields})
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--side-port", type=int, required=True, help="VLLM_NIXL_SIDE_CHANNEL_PORT")
    p.add_argument("--dist-port", type=int, required=True, help="the one-rank gloo world's port")
    p.add_argument("--model-dir", required=True, help="where the config.json-only model is written")
    p.add_argument("--lease", type=int, default=30, help="kv_lease_duration (s)")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--step", type=float, default=0.01, help="engine step period (s)")
    p.add_argument("--output-path", help="prefill: the zmq address of the router's PULL socket, where vLLM's "
                   "process_output_sockets sends each step's EngineCoreOutputs (as the frontend's outputs[0])")
    args = p.parse_args()
    if args.role == "prefill" and not args.output_path:
        p.error("--output-path is required for the prefill")
    return args


def build(args):
    """VllmConfig, KV cache config, tensors and both connector roles."""
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.side_port)
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    # One directory for both engines: vLLM hashes the model path into the
    # NIXL compatibility hash both sides compare in the handshake.
    model_dir = args.model_dir
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL, f)
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True
    )
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
            kv_buffer_device="cpu",
            engine_id=args.engine_id,
            kv_connector_extra_config={"kv_lease_duration": args.lease},
        ),
    )
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{args.dist_port}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=MODEL["num_key_value_heads"], head_size=MODEL["head_dim"],
            dtype=torch.float32,
        )
        specs = {layer: spec for layer in LAYERS}
        backends = get_current_attn_backends(cfg)
        layouts = [[layout.name for layout in get_supported_kv_cache_layouts(backends)]]
        layout = resolve_kv_cache_layout(cfg, layouts, [spec])
        groups = get_global_kv_cache_groups(cfg, [specs])
        memory = spec.page_size_bytes * args.blocks * len(LAYERS)
        kv_cache_config = get_kv_cache_configs(cfg, [specs], [memory], groups)[0]
        scheduler = NixlPullConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = NixlPullConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, [BLOCK_SIZE])
        worker.register_kv_caches(caches)
        # What the engine core does with the workers' handshake metadata.
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
    return cfg, kv_cache_config, scheduler, worker, caches


def pattern(request_id, layer):
    """The value the prefill writes into every element of a request's blocks
    of `layer`, and the decode expects after its READ."""
    return float((sum(request_id.encode()) * 31 + layer) % 100003)


def start_output_thread(output_path):
    """vLLM's own output IO thread, EngineCoreProc.process_output_sockets,
    unchanged, on an EngineCoreProc made without its __init__ (no executor,
    no handshake with a frontend): it has only the attributes the methods
    called on it use. Started as EngineCoreProc.__init__ starts it: a daemon
    thread, args (addresses.outputs, addresses.coordinator_output,
    engine_index), here ([output_path], None, 0) (DP=1, no coordinator)."""
    import queue

    from vllm.v1.engine.core import EngineCoreProc

    core = object.__new__(EngineCoreProc)
    # process_output_sockets: the (client_index, EngineCoreOutputs) items it
    # sends (what _process_engine_step puts there after each step).
    core.output_queue = queue.Queue()
    # EngineCore._attach_weight_version, which EngineCore.step runs on every
    # step's outputs: EngineCore.__init__'s value ("default" until a
    # set_weight_version utility call).
    core._weight_version = "default"
    core.output_thread = threading.Thread(
        target=core.process_output_sockets, args=([output_path], None, 0), daemon=True
    )
    core.output_thread.start()
    return core


class Engine:
    def __init__(self, args):
        self.args = args
        self.cfg, self.kv_cache_config, self.scheduler, self.worker, self.caches = build(args)
        self.core = start_output_thread(args.output_path) if args.role == "prefill" else None
        self.free_blocks = list(range(1, self.kv_cache_config.num_blocks))  # block 0: vLLM's null block
        self.waiting = {}  # request id -> Request, admitted, not scheduled
        self.allowed = set()  # decode: ids the router let the scheduler run
        self.running = {}  # request id -> (Request, block ids)
        self.held = {}  # prefill: request id -> (block ids, finished at)
        self.inbox = []
        self.inbox_lock = threading.Lock()
        self.seen_expiry = {}

    # --- the scheduler's side -------------------------------------------------
    def new_request(self, request_id, prompt_len, params):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        request = Request(request_id, list(range(7, 7 + prompt_len)), sampling, None)
        self.scheduler.on_new_request(request)
        self.waiting[request_id] = request
        emit("admitted", role=self.args.role, request=request_id, params=params)

    def allocate(self, n_tokens):
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        n = -(-n_tokens // BLOCK_SIZE)
        if n > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: {n} wanted, {len(self.free_blocks)} free")
        ids = [self.free_blocks.pop(0) for _ in range(n)]
        return ids, KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))

    def schedule(self):
        from vllm.v1.request import RequestStatus

        outputs = []  # this step's EngineCoreOutput, one per finished request
        runnable = [r for r in self.waiting if self.args.role == "prefill" or r in self.allowed]
        for request_id in runnable:
            request = self.waiting.pop(request_id)
            external, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
            tokens = request.num_prompt_tokens
            ids, blocks = self.allocate(tokens)
            self.scheduler.update_state_after_alloc(request, blocks, external or 0)
            if self.args.role == "prefill":
                # Scheduler.schedule: the first scheduled prefill's stats
                # (no local prefix cache in this block free list).
                if request.prefill_stats and request.num_preemptions <= 0:
                    request.prefill_stats.set(
                        num_prompt_tokens=tokens, num_local_cached_tokens=0,
                        num_external_cached_tokens=external or 0,
                    )
                # The forward pass: this request's KV, then it finishes.
                for layer, name in enumerate(LAYERS):
                    self.caches[name][ids] = pattern(request_id, layer)
                request.num_computed_tokens = tokens
                request.status = RequestStatus.RUNNING
                outputs.append(self.finish_prefill(request, ids))
            else:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.running[request_id] = (request, ids)
                emit("scheduled", role="decode", request=request_id, blocks=ids, external_tokens=external,
                     load_async=is_async)
        if self.core is not None:
            self.send_outputs(outputs)

    def finish_prefill(self, request, ids):
        """What Scheduler.update_from_output does with a prefill request whose
        one sampled token meets max_tokens=1: _update_request_with_output
        (append_output_token_ids, check_stop -> FINISHED_LENGTH_CAPPED),
        take_prefill_stats + finalize, get_finished_reason,
        _free_request -> the connector's request_finished (blocks held:
        delay_free_blocks), remote_prefill_cached_tokens, and the
        EngineCoreOutput it appends for the request."""
        from vllm.v1.core.sched.utils import check_stop
        from vllm.v1.engine import EngineCoreOutput

        request_id = request.request_id
        # The token the model would have sampled (nothing is computed).
        token = sum(request_id.encode()) % MODEL["vocab_size"]
        request.append_output_token_ids(token)
        stopped = check_stop(request, self.cfg.model_config.max_model_len)
        assert stopped and request.is_finished(), (request_id, request.status)
        prefill_stats = request.take_prefill_stats()
        if prefill_stats is not None:
            # kv_cache_manager.estimate_cached_tokens: no block carries a
            # prefix-cache hash here, so 0.
            prefill_stats.finalize(0)
        finish_reason = request.get_finished_reason()
        delay, params = self.scheduler.request_finished(request, ids)
        if prefill_stats is not None and params is not None and params.get("do_remote_prefill"):
            params["remote_prefill_cached_tokens"] = prefill_stats.num_cached_tokens
        if delay:
            self.held[request_id] = (ids, time.time())
        else:
            self.free(ids)
        emit("finished", role="prefill", request=request_id, blocks=ids, delay_free=delay, params=params,
             token=token, finish_reason=str(finish_reason))
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[token],
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            events=request.take_events(),
            prefill_stats=prefill_stats,
            kv_transfer_params=params,
            trace_headers=request.trace_headers,
            num_nans_in_logits=request.num_nans_in_logits,
        )

    def send_outputs(self, outputs):
        """The end of update_from_output (one EngineCoreOutputs per client
        with outputs, finished_requests when include_finished_set), then
        EngineCore.step's _attach_weight_version and
        EngineCoreProc._process_engine_step's output_queue.put_nowait, from
        which vLLM's process_output_sockets thread encodes and sends it."""
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.engine.core import EngineCore

        # No finished_requests: EngineCoreProc builds the scheduler with
        # include_finished_set = internal DP balancing, False with DP=1.
        engine_core_outputs = {0: EngineCoreOutputs(outputs=outputs)} if outputs else {}
        EngineCore._attach_weight_version(self.core, engine_core_outputs)
        for output in engine_core_outputs.items():
            self.core.output_queue.put_nowait(output)

    def abort(self, request_id):
        """The API server aborts a request (client gone) before the scheduler
        ran it: EngineCore.abort_requests -> Scheduler.finish_requests
        (FINISHED_ABORTED) -> _free_request -> request_finished. That path
        makes no EngineCoreOutput (the frontend finished the request itself
        when it aborted it); with DP=1 the id is not queued for
        finished_requests either, so nothing goes to the output socket."""
        from vllm.v1.request import RequestStatus

        request = self.waiting.pop(request_id, None)
        if request is None:
            emit("abort_ignored", role=self.args.role, request=request_id)
            return
        request.status = RequestStatus.FINISHED_ABORTED
        delay, params = self.scheduler.request_finished(request, [])
        emit("aborted", role=self.args.role, request=request_id, delay_free=delay)

    def free(self, ids):
        self.free_blocks.extend(ids)

    # --- one engine step --------------------------------------------------------
    def step(self):
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput

        with self.inbox_lock:
            commands, self.inbox = self.inbox, []
        for command in commands:
            self.handle(command)
        self.schedule()
        meta = self.scheduler.build_connector_meta(SchedulerOutput.make_empty())
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        if self.args.role == "decode":
            for request_id, handles in list(self.worker.connector_worker._recving_transfers.items()):
                if handles and request_id not in self.seen_expiry:
                    self.seen_expiry[request_id] = True
                    emit("read_posted", role="decode", request=request_id, handles=len(handles))
        results = self.worker.get_transfer_results(set())
        self.worker.clear_connector_metadata()
        if self.args.role == "prefill":
            self.report_leases()
        self.scheduler.update_connector_output(
            KVConnectorOutput(finished_sending=results.finished_sending, finished_recving=results.finished_recving)
        )
        for request_id in sorted(results.finished_sending or ()):
            ids, since = self.held.pop(request_id, ([], None))
            self.free(ids)
            emit("freed", role="prefill", request=request_id, blocks=ids,
                 held_s=None if since is None else round(time.time() - since, 3))
        for request_id in sorted(results.finished_recving or ()):
            self.received(request_id, request_id in (results.failed_recving or ()))

    def report_leases(self):
        """The lease of each held request, as the worker holds it
        (_reqs_to_send, perf_counter seconds): one line per change, so a
        heartbeat's extension shows."""
        now = time.perf_counter()
        for request_id, expiry in list(self.worker.connector_worker._reqs_to_send.items()):
            if self.seen_expiry.get(request_id) != expiry:
                first = request_id not in self.seen_expiry
                self.seen_expiry[request_id] = expiry
                emit("lease", role="prefill", request=request_id, left_s=round(expiry - now, 3),
                     extended=not first)

    def received(self, request_id, failed):
        import torch

        request, ids = self.running.pop(request_id, (None, []))
        ok = not failed and all(
            bool(torch.all(self.caches[name][ids] == pattern(request_id, layer)))
            for layer, name in enumerate(LAYERS)
        ) if request is not None else False
        if request is not None:
            from vllm.v1.request import RequestStatus

            request.status = RequestStatus.FINISHED_LENGTH_CAPPED if not failed else RequestStatus.FINISHED_ERROR
            self.scheduler.request_finished(request, ids)
            self.free(ids)
        emit("received", role="decode", request=request_id, failed=failed, kv_matches=ok)

    def handle(self, command):
        cmd = command["cmd"]
        if cmd in ("prefill", "decode"):
            self.new_request(command["request"], command["prompt_len"], command["params"])
            if command.get("schedule", True):
                self.allowed.add(command["request"])
        elif cmd == "schedule":
            self.allowed.add(command["request"])
        elif cmd == "abort":
            self.abort(command["request"])
        elif cmd == "exit":
            raise SystemExit(0)
        else:
            raise ValueError(f"unknown command {cmd!r}: want prefill, decode, schedule, abort or exit")

    def read_stdin(self):
        for line in sys.stdin:
            line = line.strip()
            if line:
                with self.inbox_lock:
                    self.inbox.append(json.loads(line))
        with self.inbox_lock:
            self.inbox.append({"cmd": "exit"})

    def run(self):
        threading.Thread(target=self.read_stdin, daemon=True).start()
        emit("ready", role=self.args.role, pid=os.getpid(), engine_id=self.args.engine_id,
             agent=self.worker.connector_worker.nixl_wrapper.name, side_port=self.args.side_port,
             lease_s=self.args.lease, nixl=sys.modules["nixl._api"].__file__)
        while True:
            self.step()
            time.sleep(self.args.step)


def main():
    args = parse_args()
    Engine(args).run()


if __name__ == "__main__":
    main()
