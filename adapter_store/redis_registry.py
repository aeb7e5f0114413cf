"""The registry of record in Redis, shared by every store replica (the file registry's Redis twin).

Keys, under the store's --redis-prefix P:

  P:registry:m:<name>        the manifest (serialized AdapterManifest): one SET, so whole or absent
  P:registry:names           sorted set of names (score 0): ListAdapters pages with ZRANGEBYLEX
  P:registry:refs            hash digest -> how many names point at it
  P:registry:files:<digest>  JSON {"upload": id, "files": {file name: [bytes, chunks]}}: the
                             adapter's validated files, so any replica can (re-)pack its shards
  P:registry:blob:<digest>:<upload id>:<file name>:<i>   the files' bytes in chunks

Every write is one WATCH/MULTI/EXEC transaction that watches `refs` (and the keys it read):
writes are serialized optimistically, a conflicting one is re-run on what the winner left,
so two stores registering one name end with the last writer's complete manifest and the
loser's files dropped. A file upload is written first under its own upload id and becomes
visible only when a commit points `files:<digest>` at it; an upload that lost (the digest
was already there) is deleted by its writer. Nothing is cached in memory: every read goes
to Redis, so no replica serves a manifest another one deleted or replaced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import uuid
from pathlib import Path

import grpc

from loraserve.errors import StatusError, not_found, unavailable
from loraserve.v1 import common_pb2 as pb

from .redis_cache import redact_url
from .validate import check_name

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20  # each Redis value stays small; a file is read back with one pipelined round trip


class _NeedUpload(Exception):
    """The digest's files vanished (deleted by another replica) between the check and the commit."""


class RedisRegistry:
    def __init__(self, url: str, prefix: str, staging_dir: Path, socket_timeout_s: float = 5.0, chunk_bytes: int = CHUNK_BYTES):
        import redis

        self.url = redact_url(url)
        self._redis = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self._p = f"{prefix}:registry"
        self._names, self._refs = f"{self._p}:names", f"{self._p}:refs"
        self.staging_dir = staging_dir
        self.chunk_bytes = chunk_bytes
        with self._errors():
            log.info("registry: %d adapters in redis at %s (%s)", self._redis.zcard(self._names), self.url, self._p)

    def _mkey(self, name: str) -> str:
        check_name(name)  # a name never reaches a key unchecked
        return f"{self._p}:m:{name}"

    def _files_key(self, digest: str) -> str:
        return f"{self._p}:files:{digest}"

    # -- reads ---------------------------------------------------------------------------
    def get(self, name: str) -> pb.AdapterManifest:
        with self._errors():
            raw = self._redis.get(self._mkey(name))
        if raw is None:
            raise not_found(f"adapter {name!r} is not registered")
        return pb.AdapterManifest.FromString(raw)

    def page(self, page_size: int, after: str) -> tuple[list[pb.AdapterManifest], str]:
        """Manifests sorted by name, starting after `after`; returns the next page token."""
        start = f"({after}" if after else "-"
        with self._errors():
            names = [n.decode() for n in self._redis.zrangebylex(self._names, start, "+", 0, page_size + 1)]
            raws = self._redis.mget([self._mkey(n) for n in names[:page_size]]) if names else []
        items = [pb.AdapterManifest.FromString(r) for r in raws if r is not None]  # None: deleted meanwhile
        next_token = names[page_size - 1] if len(names) > page_size else ""
        return items, next_token

    def is_referenced(self, digest: str) -> bool:
        with self._errors():
            return bool(self._redis.hexists(self._refs, digest))

    @contextlib.contextmanager
    def files(self, digest: str):
        """A local folder holding the digest's files, fetched from Redis; removed afterwards."""
        with self._errors():
            meta = self._redis.get(self._files_key(digest))
            if meta is None:
                raise StatusError(
                    grpc.StatusCode.DATA_LOSS,
                    f"the files of digest {digest[:12]} are not in redis at {self.url}: register the adapter again",
                )
            meta = json.loads(meta)
            pipe = self._redis.pipeline(transaction=False)
            for fname, (_, n_chunks) in meta["files"].items():
                for i in range(n_chunks):
                    pipe.get(self._blob_key(digest, meta["upload"], fname, i))
            chunks = iter(pipe.execute())
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=self.staging_dir, prefix="redis-"))
        try:
            for fname, (size, n_chunks) in meta["files"].items():
                data = b"".join(c or b"" for c in (next(chunks) for _ in range(n_chunks)))
                if len(data) != size:  # removed mid-read by a delete on another replica
                    raise StatusError(
                        grpc.StatusCode.DATA_LOSS,
                        f"{fname} of digest {digest[:12]} in redis at {self.url} is {len(data)} bytes, not {size}: register the adapter again",
                    )
                (folder / fname).write_bytes(data)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # -- writes --------------------------------------------------------------------------
    def stage(self, digest: str, files: list[Path]) -> tuple[list[Path], dict | None]:
        """Uploads the files unless the digest has them; run before the commit lock (it can be long)."""
        with self._errors():
            return files, None if self._redis.exists(self._files_key(digest)) else self._upload(digest, files)

    def discard(self, staged: tuple[list[Path], dict | None], digest: str) -> None:
        """Drops an upload whose put never ran (a registration refused at the drain's deadline)."""
        if staged[1] is not None:
            with self._errors():
                self._delete_blobs(digest, staged[1])

    def put(self, manifest: pb.AdapterManifest, staged: tuple[list[Path], dict | None]) -> str | None:
        """Points the name at the manifest (uploading the files again if another store removed
        the digest's meanwhile). Returns the digest the name pointed at before when no name uses
        it any more (its files are gone; the caller drops its cached shards), else None.

        An error here may leave the upload behind unreferenced (EXEC's answer lost: it may have
        committed, so its chunks are never deleted on a guess).
        """
        files, upload = staged
        mkey, fkey = self._mkey(manifest.name), self._files_key(manifest.digest)
        with self._errors():
            while True:
                try:
                    freed, used = self._redis.transaction(
                        lambda pipe: self._commit_put(pipe, manifest, upload), self._refs, mkey, fkey, value_from_callable=True
                    )
                    break
                except _NeedUpload:
                    upload = self._upload(manifest.digest, files)
            if upload is not None and not used:  # another store uploaded the same digest first
                self._delete_blobs(manifest.digest, upload)
        return freed

    def _commit_put(self, pipe, manifest: pb.AdapterManifest, upload: dict | None) -> tuple[str | None, bool]:
        mkey, fkey = self._mkey(manifest.name), self._files_key(manifest.digest)
        raw = pipe.get(mkey)
        old = pb.AdapterManifest.FromString(raw) if raw is not None else None
        have_files = pipe.exists(fkey)
        if not have_files and upload is None:
            raise _NeedUpload()
        moved = old is not None and old.digest != manifest.digest
        old_refs = int(pipe.hget(self._refs, old.digest) or 0) if moved else 0
        old_files = pipe.get(self._files_key(old.digest)) if moved and old_refs <= 1 else None
        pipe.multi()
        if not have_files:
            pipe.set(fkey, json.dumps(upload))
        pipe.set(mkey, manifest.SerializeToString())
        pipe.zadd(self._names, {manifest.name: 0})
        if old is None or moved:
            pipe.hincrby(self._refs, manifest.digest, 1)
        freed = None
        if moved:
            if old_refs <= 1:
                self._queue_drop_digest(pipe, old.digest, old_files)
                freed = old.digest
            else:
                pipe.hincrby(self._refs, old.digest, -1)
        return freed, not have_files

    def delete(self, name: str) -> pb.AdapterManifest:
        """Forgets a name; its files go when no other name shares the digest."""
        mkey = self._mkey(name)

        def commit(pipe) -> pb.AdapterManifest:
            raw = pipe.get(mkey)
            if raw is None:
                raise not_found(f"adapter {name!r} is not registered")
            manifest = pb.AdapterManifest.FromString(raw)
            refs = int(pipe.hget(self._refs, manifest.digest) or 0)
            old_files = pipe.get(self._files_key(manifest.digest)) if refs <= 1 else None
            pipe.multi()
            pipe.delete(mkey)
            pipe.zrem(self._names, name)
            if refs <= 1:
                self._queue_drop_digest(pipe, manifest.digest, old_files)
            else:
                pipe.hincrby(self._refs, manifest.digest, -1)
            return manifest

        with self._errors():
            return self._redis.transaction(commit, self._refs, mkey, value_from_callable=True)

    # -- files ---------------------------------------------------------------------------
    def _blob_key(self, digest: str, upload_id: str, fname: str, i: int) -> str:
        return f"{self._p}:blob:{digest}:{upload_id}:{fname}:{i}"

    def _upload(self, digest: str, files: list[Path]) -> dict:
        """Writes the files' chunks under a fresh upload id (invisible until a commit names it)."""
        upload = {"upload": uuid.uuid4().hex, "files": {}}
        for f in files:
            size, n = 0, 0
            with open(f, "rb") as src:  # a chunk at a time: a 2 GiB adapter is never whole in memory
                while (chunk := src.read(self.chunk_bytes)) or n == 0:
                    self._redis.set(self._blob_key(digest, upload["upload"], f.name, n), chunk)
                    size, n = size + len(chunk), n + 1
                    if not chunk:
                        break
            upload["files"][f.name] = [size, n]
        return upload

    def _blob_keys(self, digest: str, upload: dict) -> list[str]:
        return [self._blob_key(digest, upload["upload"], fname, i) for fname, (_, n) in upload["files"].items() for i in range(n)]

    def _delete_blobs(self, digest: str, upload: dict) -> None:
        keys = self._blob_keys(digest, upload)
        if keys:
            self._redis.delete(*keys)

    def _queue_drop_digest(self, pipe, digest: str, files_json: bytes | None) -> None:
        pipe.hdel(self._refs, digest)
        pipe.delete(self._files_key(digest), *(self._blob_keys(digest, json.loads(files_json)) if files_json else []))

    @contextlib.contextmanager
    def _errors(self):
        import redis

        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise unavailable(f"the registry's redis at {self.url} is unavailable: {exc}") from exc
