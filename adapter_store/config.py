"""The adapter store's one config object, built in one place (loraserve/cli.py) and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraserve.tls import ServerTls

from .sources import SourceConfig
from .validate import Limits


@dataclass
class StoreConfig:
    listen: str = "127.0.0.1:50061"
    data_dir: Path = Path("var/store")
    base_model: str = ""  # the base model adapters must be made for ("" = any)
    base_model_path: Path | None = None  # HF dir (config.json) or .gguf: module shapes to check
    disk_cache_bytes: int = 8 << 30
    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0; None = disk tier only
    redis_prefix: str = "loraserve:"
    registry: str = "file"  # "file": manifests + adapter files under data_dir (one store);
    # "redis": in redis_url, shared by several store replicas
    redis_cache_bytes: int = 4 << 30
    admin_token: str | None = None  # when set, mutating RPCs need "authorization: Bearer <token>"
    tls: ServerTls | None = None  # certificate and key (and client CA: mutual TLS); None: plaintext
    metrics_listen: str = ""  # host:port of Prometheus' /metrics; "": off
    max_streams: int = 64  # FetchShard streams served at once (each holds up to three chunks
    # and a reader thread, or a packed shard); more wait their turn; 0: no cap
    max_stream_wait_s: float = 2.0  # the longest a stream waits for its turn, then RESOURCE_EXHAUSTED with
    # a retry hint (executors ask again); below executors' --store-timeout-s
    limits: Limits = field(default_factory=Limits)
    sources: SourceConfig = field(default_factory=lambda: SourceConfig(local_roots=(Path.cwd(),)))

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"

    @property
    def staging_dir(self) -> Path:
        return self.data_dir / "staging"
