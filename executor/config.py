"""The executor's one configuration object, built in one place (the CLI) and passed down.

No module of the executor reads the environment: everything it may be told is a field here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.metrics import DEFAULT_MAX_ADAPTER_LABELS
from loraserve.tls import ClientTls, ServerTls

from .engine.kv_events import endpoint_error
from .lora_fp8 import LORA_DTYPES
from .model.kv_scales import KV_CACHE_DTYPES, cache_dtype
from .parallel import ep_with_tp_error

# Tokens of real vocabularies rarely exceed 16 bytes; twice that leaves room for chat markup
# and whitespace runs, so a prompt that fits max_model_len tokens is never refused by bytes.
PROMPT_BYTES_PER_TOKEN = 32
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ExecutorConfig:
    # The base model: a .gguf file or a Hugging Face model directory.
    model: str = ""
    base_model: str = ""  # the name adapters must have been trained on; part of the layout
    device: str = "cpu"  # "cpu", "cuda", "cuda:1"
    dtype: str = "float32"  # "float32" | "float16" | "bfloat16"
    quantization: str = ""  # "fp8": the linear layers in FP8 (executor/model/fp8.py; FP8 GPUs only); "": as the checkpoint
    tp_size: int = 1  # tensor-parallel ranks (processes; one GPU each on CUDA): executor/ranks.py
    tp_timeout_s: float = 120.0  # a collective waiting this long on another rank fails (a hung rank)
    ep_size: int = 1  # expert-parallel ranks (MoE models; tp_size 1): the same processes, experts split
    fully_sharded_loras: bool = False  # under TP, also shard LoRA's rank (vLLM's --fully-sharded-loras)
    cache_dir: str = ""  # derived files kept across starts (the GGUF's converted tokenizer); "": none
    cpu_threads: int = 0  # torch intra-op threads on CPU; 0: torch's default. Fewer than the cores
    # helps when other processes share them (OpenMP threads spin-wait and oversubscribe).

    # LoRA slots and the CPU tier in front of them.
    max_loras: int = 0  # GPU slots: adapters usable in one batch; 0: from the GPU memory free once the
    # model and KV cache are in place (executor/memory.py), 8 on CPU. Set to the resolved count at start.
    max_rank: int = 64  # slot rank; larger adapters are refused by the store
    lora_dtype: str = "auto"  # "auto": slots in dtype; "fp8": dense layers' slots in FP8 with scales (executor/lora_fp8.py)
    lora_embeddings: bool = False  # also give embed_tokens and lm_head slots (vocab-sized: costly)
    enable_dora: bool = False  # serve DoRA adapters (executor/dora.py): a per-slot output scale in every dense
    # LoRA layer, applied in every captured decode step; off, DoRA adapters are refused with FAILED_PRECONDITION
    enable_trainable_tokens: bool = False  # serve trainable tokens (executor/token_rows.py): per-slot embedding /
    # lm_head rows, applied in every captured decode step; off, token adapters are refused with FAILED_PRECONDITION
    cpu_cache_bytes: int = 0  # packed shards kept in (pinned) host memory, in bytes; 0: half the host
    # memory available at start (executor/memory.py). Set to the resolved budget at start. The host arena
    # fetched shards land in is sized from it (executor/build.py `pinned_arena`).
    max_cpu_adapters: int = 0  # also at most this many shards in the CPU cache; 0: the bytes alone decide
    slot_wait_timeout_s: float = 30.0  # how long a request waits for a slot when all are in use
    max_concurrent_loads: int = 4  # store fetches of adapters in flight at once (the rest wait their turn)
    adapter_refresh_s: float = 30.0  # how often held adapters are checked against the store's
    # current version (re-registered or deleted there); 0: only LoadAdapter checks

    # KV cache and batching.
    num_blocks: int = 1024  # KV blocks of block_size tokens each
    # "auto": the KV cache in the compute dtype; "fp8": float8_e4m3fn with per-kv-head scales (the
    # checkpoint's kv_cache_scheme, else 1.0; executor/model/kv_scales.py): half the bytes of a bf16 block
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 32  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens (prefill + decode) in one step
    max_model_len: int = 0  # prompt + output tokens of one sequence; 0: the model's positions
    # (ModelConfig.max_context_len), at most num_blocks x block_size. Set to the resolved length at start
    # (executor/build.py `resolve_max_model_len`), where one above the model's positions is refused.
    # Admission pacing (executor/engine/scheduler.py), CUDA graphs only: while every running
    # sequence decodes, ready requests wait until those with a free seat number admit_ratio x the
    # running ones or the hold has lasted max_admit_delay_steps steps, so that one eager (prefill) step admits
    # them all instead of one eager step each (a request whose prompt is cached but for its last token is
    # no prefill: admitted at once). admit_ratio 0: admit each at once.
    admit_ratio: float = 0.125
    max_admit_delay_steps: int = 16
    enforce_eager: bool = False  # CUDA: run every step eagerly instead of replaying CUDA graphs
    # Reuse the KV of full blocks across requests with the same prefix under the same adapter
    # version (executor/engine/prefix_cache.py); False: every request prefills its whole prompt.
    prefix_caching: bool = True

    # Request limits and defaults.
    max_prompt_bytes: int = 0  # text/chat prompts above this many UTF-8 bytes are refused before
    # tokenizing (a huge prompt would hold a CPU core for seconds); 0: PROMPT_BYTES_PER_TOKEN x max_model_len
    default_max_tokens: int = 64
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256

    # Services.
    store_address: str = "localhost:50051"
    store_timeout_s: float = 5.0  # a store call unanswered this long fails UNAVAILABLE (naming the store)
    listen_address: str = "0.0.0.0:50052"
    admin_token: str | None = None  # None: admin RPCs are open
    http_listen: str = ""  # host:port of the OpenAI-compatible HTTP front (executor/http.py); "": off
    tls: ServerTls | None = None  # the gRPC server's certificate (and client CA: mutual TLS); None: plaintext
    store_tls: ClientTls | None = None  # how to reach a store that serves TLS; None: plaintext
    metrics_listen: str = ""  # host:port of Prometheus' /metrics (loraserve/metrics.py); "": off
    metrics_max_adapters: int = DEFAULT_MAX_ADAPTER_LABELS  # adapters named in metric labels; the rest: "_other"
    metrics_compat: str = "none"  # "vllm": /metrics also serves vLLM's names of the routing readings (loraserve/metrics.py)
    # KV-block events for prefix-aware routing (executor/engine/kv_events.py), vLLM's ZMQ format:
    # the PUB endpoint ("": off; tcp://*:5557 binds, tcp://host:port connects), its topic, and an
    # optional ROUTER endpoint answering replay requests
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in ("", "fp8"):
            raise ValueError(f"quantization must be '' or 'fp8', got {self.quantization!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {self.tp_size}")
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be at least 1, got {self.ep_size}")
        if (error := ep_with_tp_error(self.tp_size, self.ep_size)) is not None:
            raise ValueError(error)
        if self.enable_dora and self.fully_sharded_loras and self.tp_size > 1:
            # DoRA's norm needs each rank's whole rank dim, which fully sharded LoRA cuts (adapter_store/dora.py)
            raise ValueError(
                "--enable-dora is not served with --fully-sharded-loras under --tp-size > 1: "
                "a DoRA norm needs each rank's whole LoRA rank (drop one of the two)"
            )
        if min(self.max_loras, self.cpu_cache_bytes, self.max_cpu_adapters) < 0:
            raise ValueError("max_loras, cpu_cache_bytes and max_cpu_adapters must be 0 (automatic / no limit) or more")
        if self.max_concurrent_loads < 1:
            raise ValueError(f"max_concurrent_loads must be at least 1, got {self.max_concurrent_loads}")
        if self.admit_ratio < 0 or self.max_admit_delay_steps < 0:
            raise ValueError(
                f"admit_ratio ({self.admit_ratio}) and max_admit_delay_steps ({self.max_admit_delay_steps}) must be 0 or more"
            )
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be 0 (the model's) or more, got {self.max_model_len}")
        for value, flag in (
            (self.kv_events_endpoint, "--kv-events-endpoint"),
            (self.kv_events_replay_endpoint, "--kv-events-replay-endpoint"),
        ):
            if value and (error := endpoint_error(value, flag)):
                raise ValueError(error)
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.kv_events_endpoint and not self.prefix_caching:
            raise ValueError(
                "--kv-events-endpoint needs prefix caching: the events are the prefix cache's (drop --no-prefix-caching)"
            )
        if self.num_blocks * self.block_size < self.max_model_len:
            # One sequence of max_model_len tokens must fit alone, or it could never finish.
            raise ValueError(
                f"num_blocks * block_size = {self.num_blocks * self.block_size} tokens is less "
                f"than max_model_len = {self.max_model_len}"
            )

    @property
    def world_size(self) -> int:
        """Processes of the executor: the tensor- or the expert-parallel ranks (never both)."""
        return self.tp_size * self.ep_size

    @property
    def prompt_byte_limit(self) -> int:
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_model_len

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype."""
        return cache_dtype(self.kv_cache_dtype, self.torch_dtype)
