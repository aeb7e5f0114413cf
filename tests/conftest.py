"""Shared fixtures. One section per kind of real part a test needs; heavy imports stay lazy."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import socket
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

# ---------------------------------------------------------------------------------------
# Triton's interpreter (TRITON_INTERPRET=1: the kernel tests on CPU tensors)
# ---------------------------------------------------------------------------------------


def pytest_configure(config):
    _refuse_the_repo_root_on_the_path()
    _fix_interpreter_scalars()


def _refuse_the_repo_root_on_the_path() -> None:
    """Python started in the repo root (`python -m pytest`) has the root on sys.path, where its
    kernels/ folder stands for the `kernels` distribution that transformers (>= 5.25) imports:
    every test that builds a model would fail on transformers' import. Say so once instead."""
    import importlib.metadata
    import sys

    root = Path(__file__).resolve().parents[1]
    if not any(Path(p or os.getcwd()).resolve() == root for p in sys.path):
        return
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    pytest.exit(
        f"{root} is on sys.path, where its kernels/ folder hides the 'kernels' package transformers imports: "
        "run `make test`, or PYTHONSAFEPATH=1 / python -P -m pytest",
        returncode=4,
    )


def _fix_interpreter_scalars() -> None:
    """Lets Triton 3.6's interpreter run on NumPy >= 2.4. It hands a kernel's scalars around as
    one-element arrays and turns them into Python ints with int(array), which NumPy 2.4 refuses for
    arrays of one dimension (triton-lang/triton#9171): every `tl.range` over a loaded bound failed.
    Wraps the interpreter's patching of tl.tensor so that conversion squeezes first; once per process,
    a no-op without triton or without the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "squeezes_scalars", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor


# ---------------------------------------------------------------------------------------
# Waiting for work of other threads and tasks
# ---------------------------------------------------------------------------------------


async def until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Polls `condition()` on the running loop until it holds; fails after timeout_s. For what
    lands through a thread (a fetch's landing, a copy thread) or a later loop turn: a fixed sleep
    before asserting it fails on a slow or loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:g}s"
        await asyncio.sleep(0.001)


@pytest.fixture(name="until")
def until_fixture():
    """`until` (above), for test modules (they cannot import conftest)."""
    return until


# ---------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def unused_port() -> int:
    """A loopback port free now, for a child process that binds it seconds later. Drawn below the
    kernel's ephemeral range: a port from bind(0) lies in that range, where every client connection
    of the suite (gRPC, Redis, S3) takes its local port, and one could take it meanwhile."""
    draw = random.Random()  # its own: tests that seed the global one do not repeat ports
    top = max(_ephemeral_low(), 20001)
    for _ in range(200):
        port = draw.randrange(20000, top)
        if port in _handed_out:  # free now, but perhaps not yet bound by the child it went to
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # that range is taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(name="free_port", scope="session")
def free_port_fixture():
    """`unused_port` (above), for test modules (they cannot import conftest)."""
    return unused_port


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: an endpoint that refuses connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# Redis: the real server CI starts at 127.0.0.1:6379
# ---------------------------------------------------------------------------------------

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


@dataclass(frozen=True)
class RedisTarget:
    url: str
    prefix: str  # unique per test; every key under it is deleted afterwards


@pytest.fixture
def redis_url():
    try:
        socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=0.5).close()
    except OSError as exc:
        pytest.skip(f"no Redis server at {REDIS_HOST}:{REDIS_PORT} ({exc}); CI starts one")
    import redis

    target = RedisTarget(f"redis://{REDIS_HOST}:{REDIS_PORT}/0", f"loraserve-test:{uuid.uuid4().hex}")
    yield target
    client = redis.Redis.from_url(target.url)
    keys = list(client.scan_iter(match=f"{target.prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


# ---------------------------------------------------------------------------------------
# S3: moto's real HTTP server on loopback
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """The endpoint URL of a moto S3 server; dummy AWS credentials set for boto3 meanwhile."""
    from moto.server import ThreadedMotoServer

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)  # no profile on this machine can interfere
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
        server.stop()


# ---------------------------------------------------------------------------------------
# Models: a tiny random Llama and real PEFT LoRA adapters for it
# ---------------------------------------------------------------------------------------

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


@pytest.fixture(scope="session")
def tiny_llama_model():
    """A random LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128), fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama_model, tmp_path_factory) -> Path:
    """The base model saved as config.json + model.safetensors."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_model.save_pretrained(directory)
    return directory


@pytest.fixture
def peft_adapter(tiny_llama_model, tmp_path_factory):
    """Factory: make_adapter(r=8, lora_alpha=16, ...) -> directory of a saved PEFT LoRA adapter.

    lora_B is re-initialised to non-zero values (PEFT starts it at zero, which would make
    every adapter a no-op and hide bugs).
    """
    import torch
    from peft import LoraConfig, get_peft_model

    def make_adapter(
        r: int = 8,
        lora_alpha: int = 16,
        target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
        use_rslora: bool = False,
        seed: int = 0,
        safe_serialization: bool = True,  # False writes a pickled adapter_model.bin
    ) -> Path:
        torch.manual_seed(seed)
        config = LoraConfig(
            r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0
        )
        with warnings.catch_warnings():  # transformers' deprecation notes about its own internals
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(copy.deepcopy(tiny_llama_model), config)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        directory = tmp_path_factory.mktemp(f"adapter-r{r}-seed{seed}")
        model.save_pretrained(directory, safe_serialization=safe_serialization)
        return directory

    return make_adapter


# ---------------------------------------------------------------------------------------
# Servers: an asyncio loop on a thread, so tests can talk to real gRPC servers with
# the blocking clients
# ---------------------------------------------------------------------------------------


class LoopThread:
    def __init__(self):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 120):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


# ---------------------------------------------------------------------------------------
# A tiny chat model: random Llama + a byte-level tokenizer with a chat template, so text and
# chat requests work (ids 0..255 are bytes, then <s> </s> <pad>), and PEFT adapters for it
# ---------------------------------------------------------------------------------------

CHAT_BOS, CHAT_EOS, CHAT_VOCAB = 256, 257, 260


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, then <s> </s> <pad>
    (the one tools/make_tiny_llama.py writes for `make up-tp2`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_llama", Path(__file__).parents[1] / "tools/make_tiny_llama.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.write_byte_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory):
    """(transformers model, its folder with config, safetensors weights and a byte tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **{**TINY_LLAMA, "vocab_size": CHAT_VOCAB, "max_position_embeddings": 512},
        bos_token_id=CHAT_BOS,
        eos_token_id=CHAT_EOS,
        pad_token_id=258,
    )
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny-chat-llama")
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return model, directory


@pytest.fixture(scope="session")
def save_byte_tokenizer():
    """save_byte_tokenizer(model_dir): writes the byte-level tokenizer (with a chat template) there."""
    return write_byte_tokenizer


@pytest.fixture(scope="session")
def chat_adapters(tiny_chat_llama, tmp_path_factory):
    """A folder of PEFT adapters for tiny_chat_llama: name -> its directory (non-zero lora_B)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_chat_llama
    root = tmp_path_factory.mktemp("chat-adapters")
    specs = {
        "qv8": (8, ("q_proj", "v_proj")),
        "mlp4": (4, ("gate_proj", "up_proj", "down_proj")),
        "o2": (2, ("o_proj",)),
        "all4": (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
    }
    for seed, (name, (r, targets)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        peft.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def module_loop_thread():
    """One loop thread for a module's shared servers (e.g. one executor for many tests)."""
    lt = LoopThread()
    yield lt
    lt.stop()
