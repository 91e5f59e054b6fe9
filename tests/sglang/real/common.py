"""What tests/sglang/real/prefill.py and decode.py (and the Mooncake target,
tests/sglang/mooncake/, built on them) share: the NIXL build
selection, the SGLang process set-up a scheduler process would do (ServerArgs,
publish), host-memory KV / aux buffers as KVArgs, and the JSON-lines output.
Nothing here is on the transfer path: SGLang's own classes do the transfers.
"""

import importlib
import json
import os
import sys
import tempfile
import threading
import types

_out_lock = threading.Lock()
_OUT = None


def claim_stdout():
    """Keep fd 1 for the JSON lines; everything else (SGLang's logging,
    warnings, NIXL / UCX output) goes to stderr."""
    global _OUT
    _OUT = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(event, **fields):
    line = json.dumps({"event": event, **fields}, separators=(",", ":"))
    with _out_lock:
        _OUT.write(line + "\n")
        _OUT.flush()


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def select_nixl(build):
    """Make `nixl`, `nixl._api`, `nixl._bindings`, ... resolve to one libnixl
    build, before SGLang imports them.

    SGLang imports `from nixl._api import nixl_agent, ...` and
    `from nixl._bindings import ...` (the `nixl` meta package from PyPI). That
    package has no switch: nixl/__init__.py asks nixl_meta_utils for the CUDA
    major of torch (13 for torch 2.14.1), imports nixl_cu13 and aliases its
    submodules as nixl._bindings, nixl._utils, nixl.logging, nixl._api in
    sys.modules. This does the same aliasing for the chosen build, so SGLang's
    code runs unchanged on either library. "auto" leaves the meta package to
    choose. Only one build per process: both register the same pybind11
    types.
    """
    if build == "auto":
        importlib.import_module("nixl")
        return sys.modules["nixl._api"].__name__.split(".")[0]
    name = {"cu12": "nixl_cu12", "cu13": "nixl_cu13"}[build]
    pkg = importlib.import_module(name)
    shim = types.ModuleType("nixl")
    shim.__file__ = __file__
    shim.__path__ = []
    shim.__doc__ = f"stallwatch test shim: the nixl meta package, bound to {name}"
    for sub in ("_bindings", "_utils", "logging", "_api"):
        module = importlib.import_module(f"{name}.{sub}")
        sys.modules[f"nixl.{sub}"] = module
        setattr(shim, sub, module)
        for attr in dir(module):
            if not attr.startswith("_"):
                setattr(shim, attr, getattr(module, attr))
    sys.modules["nixl"] = shim
    return pkg.__name__


def loaded_libnixl():
    """The libnixl.so this process mapped, from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if path.endswith("/libnixl.so"):
                return path
    return None


# A tiny model config: ServerArgs resolution reads the HF config of
# model_path (no weights, no tokenizer). MHA: Llama; MLA: DeepSeek-V2 shape.
_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "head_dim": 16,
}


def model_dir():
    path = os.path.join(tempfile.gettempdir(), f"stallwatch-sglang-model-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        tmp = f"{config}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(_LLAMA, f)
        os.replace(tmp, config)
    return path


def publish_server_args(mode, tp_size, tp_rank, bootstrap_port, backend="nixl"):
    """What run_scheduler_process does before it builds a Scheduler:
    ServerArgs for this role and transfer backend ("nixl", "mooncake"),
    published with the launcher's placement."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        host="127.0.0.1",
        tp_size=tp_size,
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=bootstrap_port,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, gpu_id=0))
    # No torch.distributed groups are built (one prefill rank; PP 1): the
    # managers read pp_group only to build a PP consensus store when pp > 1.
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(pp_group=None)
    return server_args


class HostPools:
    """KV pages and aux (metadata) slots in host memory, registered with NIXL
    as DRAM by SGLang's register_buffer_to_engine. MHA: one K and one V
    buffer per layer (2 x layers entries); MLA: one buffer per layer.
    kv_item_len = bytes of one page in one buffer."""

    AUX_ITEM_LENS = (64, 16)  # like MetadataBuffers: output ids row, a small row

    def __init__(self, np, *, layers, mla, pages, page_bytes, aux_slots):
        entries = layers if mla else 2 * layers
        self.np = np
        self.page_bytes = page_bytes
        self.kv = [np.zeros(pages * page_bytes, dtype=np.uint8) for _ in range(entries)]
        self.aux = [np.zeros(aux_slots * n, dtype=np.uint8) for n in self.AUX_ITEM_LENS]
        self.free_pages = list(range(pages))
        self.free_aux = list(range(aux_slots))

    def kv_args(self, kv_args_class, *, engine_rank, page_size, mla, kv_head_num, total_kv_head_num):
        args = kv_args_class()
        args.engine_rank = engine_rank
        args.pp_rank = 0
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.kv_cache_dtype_str = "auto"
        args.kv_layout = None
        args.prefill_start_layer = 0
        args.prefill_end_layer = None
        args.kv_data_ptrs = [int(b.ctypes.data) for b in self.kv]
        args.kv_data_lens = [int(b.nbytes) for b in self.kv]
        args.kv_item_lens = [self.page_bytes] * len(self.kv)
        args.kv_data_mem_kinds = ["DRAM"] * len(self.kv)
        args.num_draft_entries = 0
        layers = len(self.kv) if mla else len(self.kv) // 2
        args.kv_layer_ids = list(range(layers)) if mla else list(range(layers)) * 2
        if not mla:
            args.kv_head_num = kv_head_num
            args.total_kv_head_num = total_kv_head_num
        args.page_size = page_size
        args.aux_data_ptrs = [int(b.ctypes.data) for b in self.aux]
        args.aux_data_lens = [int(b.nbytes) for b in self.aux]
        args.aux_item_lens = list(self.AUX_ITEM_LENS)
        args.ib_device = None
        args.gpu_id = 0
        # setup_state_kv_args for a model without extra state (no mamba/SWA/DSA)
        args.state_types = []
        args.state_data_ptrs = []
        args.state_data_lens = []
        args.state_item_lens = []
        args.state_layer_ids = []
        args.state_dim_per_tensor = []
        args.state_slice_outer_counts = []
        args.state_conv_shard_groups = []
        args.is_hybrid_mla_backend = False
        args.swa_kv_cache_layout = None
        args.mla_compression_ratios = None
        args.kv_buf_groups = 1
        args.hidden_kv_layers = layers
        args.draft_kv_layers = 0
        return args

    def scatter(self, run, seed=40):
        """The free list as an allocator's after churn rather than a fresh
        pool's: runs of `run` pages in a seeded shuffled order, so a room of
        many pages is many runs, none predictable from its first page."""
        import random

        runs = [self.free_pages[i:i + run] for i in range(0, len(self.free_pages), run)]
        random.Random(seed).shuffle(runs)
        self.free_pages = [page for r in runs for page in r]

    def alloc(self, n):
        if len(self.free_pages) < n or not self.free_aux:
            return None, None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages, self.free_aux.pop(0)

    def free(self, pages, aux):
        self.free_pages.extend(pages)
        if aux is not None:
            self.free_aux.append(aux)

    def patterns(self, room, n):
        """The byte a prefill writes into each of pages 0..n of room's KV
        (never 0), a page's bytes all alike."""
        k = self.np.arange(n, dtype=self.np.int64)
        return ((room % 251) * 31 + k * 7) % 251 + 1

    def spans(self, pages):
        """Every byte offset of these pages in a KV buffer, page by page
        (one numpy index: a room of thousands of pages is written, zeroed
        and checked at once)."""
        pages = self.np.asarray(pages, dtype=self.np.int64)
        return (pages[:, None] * self.page_bytes + self.np.arange(self.page_bytes)).ravel()

    def fill(self, room, pages):
        at, values = self.spans(pages), self.np.repeat(self.patterns(room, len(pages)), self.page_bytes)
        for buf in self.kv:
            buf[at] = values
        return None

    def fill_aux(self, room, slot):
        for n, buf in zip(self.AUX_ITEM_LENS, self.aux):
            buf[slot * n:(slot + 1) * n] = room % 255 + 1

    def landed(self, pages):
        """Whether any byte of these pages is non-zero (a write has begun)."""
        return any(buf[p * self.page_bytes:(p + 1) * self.page_bytes].any() for buf in self.kv for p in pages[:1])

    def verify(self, room, pages, aux):
        at, values = self.spans(pages), self.np.repeat(self.patterns(room, len(pages)), self.page_bytes)
        ok = all((buf[at] == values).all() for buf in self.kv)
        return ok and all((buf[aux * n:(aux + 1) * n] == room % 255 + 1).all() for n, buf in zip(self.AUX_ITEM_LENS, self.aux))

    def zero(self, pages, aux):
        at = self.spans(pages)
        for buf in self.kv:
            buf[at] = 0
        if aux is not None:
            for n, buf in zip(self.AUX_ITEM_LENS, self.aux):
                buf[aux * n:(aux + 1) * n] = 0
