"""KV-block events for prefix-aware routing: the prefix cache's filings and evictions, published
in vLLM's KV-event wire format so that a KV-cache indexer (the llm-d KV-cache manager's) can score
executors by the prompt prefixes they hold.

Wire format (vLLM's `vllm/distributed/kv_events.py` in its positional form: msgspec array-like
tagged structs, as vLLM encoded events before it moved to maps; the llm-d KV-cache indexer decodes
it, its older versions only it): a ZMQ PUB socket sends one multipart message per batch,

    [topic (UTF-8), sequence number (8 bytes, big-endian, from 0), payload (msgpack)]
    payload = [ts (float, Unix seconds), [event, ...], data_parallel_rank (0)]
    event   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
            | ["BlockRemoved", block_hashes, medium]

block_hashes are the prefix cache's keys (prefix_cache.py: 16-byte blake2b chain keys over the
executor's KV format (prefix_cache.KVFormat: model, compute dtype, weights' format, LoRA slots' dtype,
KV dtype and scales, block size), the adapter name and content digest, and the tokens), sent as msgpack
bin; parent_block_hash is the key of the block before the first one (nil: the sequence's first
block); token_ids the stored blocks' tokens, block_size of them per block; lora_name the adapter
(nil: the base model); lora_id a 63-bit id of the adapter version (`lora_id`; nil: the base
model); medium "GPU" for a KV cache in GPU memory, "CPU" otherwise. A batch holds the events of
one engine step in the order the allocator saw them, so replaying the stream reproduces its set
of filed keys. AllBlocksCleared is never sent: the cache is never reset while the process lives.

Replay (optional ROUTER socket): a request [identity, b"", start sequence (8 bytes big-endian)]
is answered with [identity, b"", sequence, payload] for each kept batch from that sequence on
(the last REPLAY_BATCHES, kept only while a replay socket exists), then [identity, b"", -1 (8
bytes, signed), b""].

Sockets live in one background thread (ZMQ sockets are not thread-safe); the engine only appends
events to a list and hands a finished batch to the thread. PUB drops messages past its high-water
mark rather than stall the engine: a consumer that sees a gap in the sequence numbers asks the
replay socket. If the thread dies (a send or encode error, logged), the engine keeps serving and
every later event is dropped: consumers see the stream stop.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

REPLAY_BATCHES = 10_000  # batches kept for the replay socket
SEND_HWM = 100_000  # messages queued per subscriber before PUB drops
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SCHEMES = ("tcp://", "ipc://", "inproc://")


def endpoint_error(endpoint: str, flag: str) -> str | None:
    """Why `endpoint` cannot be a ZMQ endpoint of `flag`; None when it has a known scheme."""
    if not endpoint.startswith(SCHEMES) or endpoint.endswith("://"):
        return (
            f"{flag} {endpoint!r}: want a ZMQ endpoint, tcp://*:5557 (bind) or tcp://host:port (connect), or ipc:// or inproc://"
        )
    return None


def binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard host (tcp://*:5557, tcp://[::]:5557) or an ipc/inproc path is bound,
    any other address is connected to (a consumer that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def lora_id(adapter: str, digest: str) -> int | None:
    """A 63-bit id of one adapter version (name and content digest); None for the base model."""
    if not adapter:
        return None
    h = hashlib.blake2b(f"{adapter}\0{digest}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


class KVEventPublisher:
    """Collects the allocator's KV-block events and publishes one batch per `flush`.

    Construction binds (or connects) the sockets at once: ValueError naming the flag and the
    endpoint if ZMQ refuses it (malformed, address in use), or if pyzmq / msgspec are missing.
    """

    def __init__(self, endpoint: str, *, block_size: int, medium: str, topic: str = "", replay_endpoint: str = ""):
        try:
            import msgspec
            import zmq
        except ImportError as exc:  # pragma: no cover - both are dependencies of the package
            raise ValueError(f"--kv-events-endpoint needs pyzmq and msgspec: {exc}") from exc
        for value, flag in ((endpoint, "--kv-events-endpoint"), (replay_endpoint, "--kv-events-replay-endpoint")):
            if value and (error := endpoint_error(value, flag)):
                raise ValueError(error)
        self.block_size = block_size
        self.medium = medium
        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        for sock, value, flag in (
            (self._pub, endpoint, "--kv-events-endpoint"),
            (self._replay, replay_endpoint, "--kv-events-replay-endpoint"),
        ):
            if sock is None:
                continue
            try:
                sock.setsockopt(zmq.LINGER, 0)
                # PUB drops past its mark; a replay answers with up to REPLAY_BATCHES + 1 messages at once
                sock.setsockopt(zmq.SNDHWM, SEND_HWM if sock is self._pub else REPLAY_BATCHES + 1)
                (sock.bind if sock is self._replay or binds(value) else sock.connect)(value)
            except zmq.ZMQError as exc:
                self._close_sockets()
                raise ValueError(f"{flag} {value!r}: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint  # the bound port of tcp://*:0
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else ""
        self._events: list[list] = []
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        # the last batches sent, for replay requests (None: no replay socket, nothing kept)
        self._kept: deque[tuple[int, bytes]] | None = deque(maxlen=REPLAY_BATCHES) if self._replay is not None else None
        self.flushed = 0  # batches handed to the thread so far
        self.published = 0  # batches sent so far (the next one's sequence number)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- called by the engine (one thread) ----------------------------------------------------

    def stored(
        self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], lora_name: str | None, lora: int | None
    ):
        """Blocks filed under these keys, in chain order; `token_ids`: their tokens, block_size each."""
        if not self._closed:
            self._events.append(["BlockStored", block_hashes, parent, token_ids, self.block_size, lora, self.medium, lora_name])

    def removed(self, block_hash: bytes) -> None:
        """A filed block evicted (its key dropped); runs of removals share one event."""
        if self._closed:
            return
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(block_hash)
        else:
            self._events.append(["BlockRemoved", [block_hash], self.medium])

    def flush(self) -> None:
        """Publishes the events since the last flush as one batch (nothing if there are none). Once
        the socket thread has died the batch is dropped and the publisher closes (later events are
        dropped too): nothing queues for a thread that is gone."""
        if not self._events or self._closed:
            return
        if not self._thread.is_alive():
            self._closed = True
            self._events = []
            log.error("KV-event publisher thread is gone: KV events are dropped from now on")
            while True:  # what it left unsent
                try:
                    self._batches.get_nowait()
                except queue.Empty:
                    return
        self._batches.put([time.time(), self._events, 0])
        self.flushed += 1
        self._events = []

    def close(self) -> None:
        """Publishes what is pending, stops the thread and closes the sockets; later events are dropped."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._batches.put(None)
        self._thread.join(timeout=5.0)

    # ---- the socket thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                    try:
                        batch = self._batches.get(timeout=0.05)
                    except queue.Empty:
                        continue
                else:
                    batch = self._batches.get()
                if batch is None:
                    return
                payload = self._encode(batch)
                seq = self.published
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                if self._kept is not None:
                    self._kept.append((seq, payload))
                self.published = seq + 1
        except Exception:  # the engine keeps serving; consumers see the stream stop
            log.exception("KV-event publisher stopped")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV-event replay: ignored a request of %d frames (want identity, empty, 8-byte sequence)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
