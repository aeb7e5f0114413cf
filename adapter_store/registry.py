"""Adapter names -> manifests, and the validated adapter files, content-addressed on disk:
the registry of one store (the default). Several replicas share redis_registry.RedisRegistry,
which has the same methods.

  <data_dir>/registry/<name>.json      the manifest (protobuf JSON), written atomically
  <data_dir>/adapters/<digest>/        adapter_config.json + weights: the "source" cache tier,
                                       so a shard can be re-packed without fetching again

Names are validated (validate.check_name) before they become file names, so nothing a
client sends leads outside data_dir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from google.protobuf import json_format

from loraserve.errors import not_found
from loraserve.v1 import common_pb2 as pb

from .validate import check_name

log = logging.getLogger(__name__)


class FileRegistry:
    def __init__(self, data_dir: Path):
        self.manifest_dir = data_dir / "registry"
        self.adapter_root = data_dir / "adapters"
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        for tmp in [*self.adapter_root.glob(".tmp-*"), *self.manifest_dir.glob(".tmp-*")]:  # a crash mid-put
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._manifests: dict[str, pb.AdapterManifest] = {}
        for path in self.manifest_dir.glob("*.json"):
            self._manifests[path.stem] = json_format.Parse(path.read_text(), pb.AdapterManifest())
        log.info("registry: %d adapters in %s", len(self._manifests), data_dir)

    def adapter_dir(self, digest: str) -> Path:
        return self.adapter_root / digest

    @contextlib.contextmanager
    def files(self, digest: str):
        """The local folder holding the digest's files (kept: this registry is their record)."""
        yield self.adapter_dir(digest)

    def get(self, name: str) -> pb.AdapterManifest:
        check_name(name)
        with self._lock:
            manifest = self._manifests.get(name)
        if manifest is None:
            raise not_found(f"adapter {name!r} is not registered")
        return manifest

    def stage(self, digest: str, files: list[Path]) -> list[Path]:
        """Nothing to do before the commit: put moves the files (a rename, under the same data dir)."""
        return files

    def discard(self, staged: list[Path], digest: str) -> None:
        """The staged files are the registration's own staging folder: its caller removes it."""

    def put(self, manifest: pb.AdapterManifest, files: list[Path]) -> str | None:
        """Keeps (moves) the adapter's files under its digest, then (atomically) points the name at it.

        Returns the digest the name pointed at before when no name uses it any more (its files
        are gone; the caller drops its cached shards), else None.
        """
        check_name(manifest.name)
        target = self.adapter_dir(manifest.digest)
        if target.exists():  # same content kept before: the fresh, just validated copies replace
            for f in files:  # it, so registering again repairs files damaged on disk (DATA_LOSS)
                os.replace(f, target / f.name)
        else:
            tmp = Path(tempfile.mkdtemp(dir=self.adapter_root, prefix=".tmp-"))
            for f in files:  # moved: staging is under the same data dir, so this is a rename
                shutil.move(f, tmp / f.name)
            try:
                os.rename(tmp, target)
            except OSError:  # another register of the same content won the race
                shutil.rmtree(tmp, ignore_errors=True)
        _atomic_write(self.manifest_dir / f"{manifest.name}.json", json_format.MessageToJson(manifest))
        with self._lock:
            old = self._manifests.get(manifest.name)
            self._manifests[manifest.name] = manifest
        if old is None or old.digest == manifest.digest or self.is_referenced(old.digest):
            return None
        shutil.rmtree(self.adapter_dir(old.digest), ignore_errors=True)
        return old.digest

    def delete(self, name: str) -> pb.AdapterManifest:
        """Forgets a name; its files go when no other name shares the digest."""
        manifest = self.get(name)
        with self._lock:
            del self._manifests[name]
            shared = any(m.digest == manifest.digest for m in self._manifests.values())
        (self.manifest_dir / f"{name}.json").unlink(missing_ok=True)
        if not shared:
            shutil.rmtree(self.adapter_dir(manifest.digest), ignore_errors=True)
        return manifest

    def is_referenced(self, digest: str) -> bool:
        with self._lock:
            return any(m.digest == digest for m in self._manifests.values())

    def page(self, page_size: int, after: str) -> tuple[list[pb.AdapterManifest], str]:
        """Manifests sorted by name, starting after `after`; returns the next page token."""
        with self._lock:
            names = sorted(n for n in self._manifests if n > after)
            items = [self._manifests[n] for n in names[:page_size]]
        next_token = items[-1].name if len(names) > page_size else ""
        return items, next_token


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
