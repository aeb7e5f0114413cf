"""Adapter sources: file://, s3:// and hf:// URIs -> the adapter's files in a staging dir.

Only the files an adapter needs are copied: adapter_config.json and
adapter_model.safetensors (adapter_model.bin only when there is no safetensors file and
pickled weights are allowed). Nothing here parses them; validation comes next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from loraserve.errors import StatusError, invalid, not_found, unavailable

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class SourceConfig:
    local_roots: tuple[Path, ...]  # file:// and plain paths must resolve inside one of these
    s3_endpoint_url: str | None = None  # S3-compatible override (moto, MinIO, ...)
    s3_region: str | None = None
    s3_max_concurrency: int = 8  # parallel ranged GETs for one large file
    s3_multipart_threshold_bytes: int = 8 * 2**20  # also the size of each ranged GET
    hf_endpoint: str | None = None
    hf_token: str | None = None
    hf_cache_dir: Path | None = None
    hf_offline: bool = False
    allow_pickle: bool = False  # accept adapter_model.bin when no safetensors file exists
    max_file_bytes: int = 2 * 2**30  # larger files are refused before they are downloaded


@dataclass(frozen=True)
class FetchedAdapter:
    directory: Path  # staging dir: adapter_config.json + adapter_model.safetensors (or .bin)
    uri: str  # normalized uri, without the revision
    revision: str  # hf: commit sha; s3: ETag of the weights file; file: ""


@dataclass(frozen=True)
class ParsedUri:
    scheme: str  # "file" | "s3" | "hf"
    root: str  # file: "" ; s3: bucket ; hf: repo id "org/name"
    path: str  # file: the path as given; s3: key prefix (no trailing "/"); hf: folder in the repo
    revision: str | None = None  # hf: branch, tag or commit sha; s3: the weights' ETag

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"{self.scheme}://{'/'.join(p for p in (self.root, self.path) if p)}"


# ---------------------------------------------------------------------------------------
# Parsing (pure)
# ---------------------------------------------------------------------------------------


def parse_uri(uri: str, revision: str | None) -> ParsedUri:
    """Splits an adapter URI; plain paths mean file. `hf://org/name[/folder][@rev]`."""
    if not uri:
        raise invalid("adapter URI is empty: use file://, s3:// or hf://")
    revision = revision or None
    match = _SCHEME_RE.match(uri)
    scheme = match.group(1).lower() if match else "file"
    rest = uri[match.end() :] if match else uri
    if scheme == "file":
        return _parse_file(uri, rest, is_plain=match is None, revision=revision)
    if scheme == "s3":
        return _parse_s3(uri, rest, revision)
    if scheme == "hf":
        return _parse_hf(uri, rest, revision)
    raise invalid(f"unsupported adapter URI scheme '{scheme}' in '{uri}': use file://, s3:// or hf://")


def _parse_file(uri: str, rest: str, is_plain: bool, revision: str | None) -> ParsedUri:
    if revision:
        raise invalid(f"local adapter '{uri}' has no revisions, but revision '{revision}' was requested")
    if is_plain:
        return ParsedUri("file", "", rest)
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost") or not slash:
        raise invalid(f"file URI '{uri}' must name an absolute path: file:///abs/path")
    return ParsedUri("file", "", "/" + path)


def _parse_s3(uri: str, rest: str, revision: str | None) -> ParsedUri:
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise invalid(f"S3 URI '{uri}' names no bucket: use s3://bucket/prefix")
    return ParsedUri("s3", bucket, prefix.strip("/"), revision)


def _parse_hf(uri: str, rest: str, revision: str | None) -> ParsedUri:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    location, at, uri_revision = rest.partition("@")
    if at and not uri_revision:
        raise invalid(f"Hugging Face URI '{uri}' has an empty revision after '@'")
    if at and revision and uri_revision != revision:
        raise invalid(f"Hugging Face URI '{uri}' pins revision '{uri_revision}' but '{revision}' was requested")
    parts = location.strip("/").split("/")
    if len(parts) < 2:
        raise invalid(f"Hugging Face URI '{uri}' must name a repo as hf://org/name[/folder][@revision]")
    repo_id, folder = "/".join(parts[:2]), parts[2:]
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise invalid(f"Hugging Face URI '{uri}' has an invalid repo id '{repo_id}': {exc}") from None
    if any(p in ("", ".", "..") for p in folder):
        raise invalid(f"Hugging Face URI '{uri}' has an empty, '.' or '..' folder segment")
    return ParsedUri("hf", repo_id, "/".join(folder), uri_revision or revision)


# ---------------------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------------------


def fetch(uri: str, revision: str | None, cfg: SourceConfig, staging: Path) -> FetchedAdapter:
    """Copies the adapter's files into `staging`, which the caller creates and deletes
    (on error it may hold part of the files). Raises StatusError naming the URI and file."""
    parsed = parse_uri(uri, revision)
    start_s = time.perf_counter()
    fetcher = {"file": _fetch_file, "s3": _fetch_s3, "hf": _fetch_hf}[parsed.scheme]
    fetched = fetcher(parsed, cfg, staging)
    n_bytes = sum(p.stat().st_size for p in staging.iterdir())
    log.info(
        "fetched %s (revision %r): %s, %d bytes in %.2f s",
        fetched.uri,
        fetched.revision,
        sorted(p.name for p in staging.iterdir()),
        n_bytes,
        time.perf_counter() - start_s,
    )
    return fetched


def _pick_weights(uri: str, has_file: Callable[[str], bool], cfg: SourceConfig) -> str:
    if has_file(SAFETENSORS_FILE):
        return SAFETENSORS_FILE
    if has_file(PICKLE_FILE):
        if cfg.allow_pickle:
            log.warning("%s has only pickled weights (%s); accepted because of --allow-pickle", uri, PICKLE_FILE)
            return PICKLE_FILE
        raise invalid(
            f"{uri} has only pickled weights ({PICKLE_FILE}); pickled weights are refused because "
            f"loading them can run arbitrary code: convert them to {SAFETENSORS_FILE} or start "
            "the store with --allow-pickle"
        )
    raise not_found(f"adapter {uri} has no weights file: {SAFETENSORS_FILE} is missing")


def _check_config(uri: str, has_file: Callable[[str], bool]) -> None:
    """A folder with weights but no config exists and is not a valid adapter (INVALID_ARGUMENT);
    one with neither is not there (NOT_FOUND)."""
    if has_file(CONFIG_FILE):
        return
    weights = next((f for f in (SAFETENSORS_FILE, PICKLE_FILE) if has_file(f)), None)
    if weights is not None:
        raise invalid(f"adapter {uri} has {weights} but no {CONFIG_FILE}: not a valid PEFT adapter without it")
    raise not_found(f"adapter {uri} has no {CONFIG_FILE}")


def _check_size(uri: str, name: str, size_bytes: int | None, cfg: SourceConfig) -> None:
    if size_bytes is not None and size_bytes > cfg.max_file_bytes:
        raise invalid(
            f"{uri}/{name} is {size_bytes} bytes, over the store's limit of {cfg.max_file_bytes} bytes per file (max_file_bytes)"
        )


# --- file:// ---------------------------------------------------------------------------


def _fetch_file(parsed: ParsedUri, cfg: SourceConfig, staging: Path) -> FetchedAdapter:
    directory = _resolve_local_dir(parsed.path, cfg.local_roots)
    uri = f"file://{directory}"

    def has_file(name: str) -> bool:
        return (directory / name).exists()

    _check_config(uri, has_file)
    weights = _pick_weights(uri, has_file, cfg)
    for name in (CONFIG_FILE, weights):
        source = _resolve_inside_roots(directory / name, cfg.local_roots)
        if not source.is_file():
            raise invalid(f"{uri}/{name} is not a regular file")
        _check_size(uri, name, source.stat().st_size, cfg)
        shutil.copyfile(source, staging / name)
    return FetchedAdapter(staging, uri, "")


def _resolve_local_dir(path_str: str, roots: tuple[Path, ...]) -> Path:
    """Absolute paths as given; relative ones under the first local root that holds them."""
    if not roots:
        raise StatusError(grpc.StatusCode.PERMISSION_DENIED, f"local adapter '{path_str}' refused: the store has no local roots")
    path = Path(path_str)
    if not path.is_absolute():
        candidates = [root / path for root in roots]
        path = next((c for c in candidates if os.path.lexists(c)), candidates[0])
    # Check the lexical path before its existence, so nothing is revealed outside the roots.
    _require_inside(Path(os.path.abspath(path)), path_str, roots)
    if not path.exists():
        raise not_found(f"local adapter path '{path_str}' does not exist")
    directory = _resolve_inside_roots(path, roots)
    if not directory.is_dir():
        raise invalid(f"local adapter path '{path_str}' is not a directory")
    return directory


def _resolve_inside_roots(path: Path, roots: tuple[Path, ...]) -> Path:
    resolved = path.resolve(strict=True)  # symlinks followed: their target must be inside too
    _require_inside(resolved, str(path), roots)
    return resolved


def _require_inside(path: Path, shown: str, roots: tuple[Path, ...]) -> None:
    allowed = {Path(os.path.abspath(r)) for r in roots} | {r.resolve() for r in roots}
    if not any(path == root or path.is_relative_to(root) for root in allowed):
        raise StatusError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"path '{shown}' is outside the store's allowed local roots ({', '.join(map(str, roots))})",
        )


# --- s3:// -----------------------------------------------------------------------------


def _fetch_s3(parsed: ParsedUri, cfg: SourceConfig, staging: Path) -> FetchedAdapter:
    bucket, prefix = parsed.root, parsed.path
    uri = str(parsed)
    client = _s3_client(cfg)
    with _s3_errors(uri):
        objects = _list_s3_dir(client, bucket, prefix)  # file name -> (size_bytes, etag)
    if not objects:
        raise not_found(f"no objects under {uri}/ (bucket '{bucket}', prefix '{prefix}/')")
    _check_config(uri, objects.__contains__)
    weights = _pick_weights(uri, objects.__contains__, cfg)
    for name in (CONFIG_FILE, weights):
        _check_size(uri, name, objects[name][0], cfg)
    listed_etag = objects[weights][1]
    if parsed.revision and parsed.revision != listed_etag:
        raise not_found(f"revision '{parsed.revision}' of {uri} not found: {weights} has ETag '{listed_etag}'")
    keys = {name: f"{prefix}/{name}" if prefix else name for name in (CONFIG_FILE, weights)}
    with _s3_errors(uri):
        etags = _download_s3(client, bucket, keys, staging, cfg)
    return FetchedAdapter(staging, uri, etags[weights] or listed_etag)


def _s3_client(cfg: SourceConfig):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        max_pool_connections=max(10, cfg.s3_max_concurrency + 2),
    )
    return boto3.session.Session().client("s3", endpoint_url=cfg.s3_endpoint_url, region_name=cfg.s3_region, config=config)


def _list_s3_dir(client, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """The objects directly under the prefix: name -> (size_bytes, etag without quotes)."""
    key_prefix = f"{prefix}/" if prefix else ""
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            objects[obj["Key"][len(key_prefix) :]] = (obj["Size"], obj["ETag"].strip('"'))
    return objects


def _download_s3(client, bucket: str, keys: dict[str, str], staging: Path, cfg: SourceConfig) -> dict[str, str]:
    """Downloads each key (large ones as parallel ranged GETs); returns name -> ETag downloaded."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    ranged_gets = []  # one entry per ranged GET; list.append is thread-safe
    client.meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: "Range" in params and ranged_gets.append(1)
    )
    transfer = TransferConfig(
        max_concurrency=cfg.s3_max_concurrency,
        multipart_threshold=cfg.s3_multipart_threshold_bytes,
        multipart_chunksize=cfg.s3_multipart_threshold_bytes,
    )
    with create_transfer_manager(client, transfer) as manager:
        futures = {name: manager.download(bucket, key, str(staging / name)) for name, key in keys.items()}
        for future in futures.values():
            future.result()
    log.info("downloaded s3://%s/{%s} with %d ranged GETs", bucket, ",".join(keys.values()), len(ranged_gets))
    return {name: (f.meta.etag or "").strip('"') for name, f in futures.items()}


@contextlib.contextmanager
def _s3_errors(uri: str):
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    try:
        yield
    except ClientError as exc:
        raise _s3_status(uri, exc) from exc
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StatusError(grpc.StatusCode.UNAUTHENTICATED, f"no usable AWS credentials to read {uri}: {exc}") from exc
    except BotoCoreError as exc:  # endpoint unreachable, timeouts, closed connections
        raise unavailable(f"S3 endpoint unreachable while reading {uri}: {exc}") from exc


def _s3_status(uri: str, exc) -> StatusError:
    error = exc.response.get("Error", {})
    code, message = error.get("Code", ""), error.get("Message", str(exc))
    http_status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    if code in ("NoSuchBucket", "NoSuchKey", "404", "NotFound"):
        return not_found(f"{uri}: {code}: {message}")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or http_status == 403:
        return StatusError(grpc.StatusCode.PERMISSION_DENIED, f"access to {uri} denied: {code}: {message}")
    return unavailable(f"S3 error reading {uri}: {code}: {message}")


# --- hf:// -----------------------------------------------------------------------------


def _fetch_hf(parsed: ParsedUri, cfg: SourceConfig, staging: Path) -> FetchedAdapter:
    from huggingface_hub import hf_hub_download

    uri = str(parsed)
    config_info = _hf_probe(parsed, parsed.revision, CONFIG_FILE, cfg)
    if config_info is None:
        if _hf_probe(parsed, parsed.revision, SAFETENSORS_FILE, cfg) is not None:
            raise invalid(
                f"adapter {uri}@{parsed.revision or 'main'} has {SAFETENSORS_FILE} but no {CONFIG_FILE}: "
                "not a valid PEFT adapter without it"
            )
        where = f"in the offline Hugging Face cache ({cfg.hf_cache_dir or 'default'})" if cfg.hf_offline else ""
        raise not_found(f"adapter {uri}@{parsed.revision or 'main'} has no {CONFIG_FILE} {where}".rstrip())
    commit_sha = config_info.commit_hash  # every file comes from this one commit
    infos = {CONFIG_FILE: config_info}

    def has_file(name: str) -> bool:
        if name not in infos:
            infos[name] = _hf_probe(parsed, commit_sha, name, cfg)
        return infos[name] is not None

    weights = _pick_weights(uri, has_file, cfg)
    for name in (CONFIG_FILE, weights):
        _check_size(uri, name, infos[name].file_size, cfg)
        with _hf_errors(uri, cfg):
            cached = hf_hub_download(**_hf_args(parsed, commit_sha, name, cfg))
        _check_size(uri, name, os.path.getsize(cached), cfg)
        shutil.copyfile(cached, staging / name)  # follows the cache's symlink to its blob
    return FetchedAdapter(staging, uri, commit_sha)


def _hf_args(parsed: ParsedUri, revision: str | None, name: str, cfg: SourceConfig) -> dict:
    return dict(
        repo_id=parsed.root,
        filename=name,
        subfolder=parsed.path or None,
        revision=revision,
        endpoint=cfg.hf_endpoint,
        token=cfg.hf_token,
        cache_dir=cfg.hf_cache_dir,
        local_files_only=cfg.hf_offline,
    )


def _hf_probe(parsed: ParsedUri, revision: str | None, name: str, cfg: SourceConfig):
    """The file's DryRunFileInfo (commit sha, size), or None when the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    try:
        with _hf_errors(str(parsed), cfg):
            return hf_hub_download(**_hf_args(parsed, revision, name, cfg), dry_run=True)
    except StatusError as exc:
        missing = (RemoteEntryNotFoundError, LocalEntryNotFoundError) if cfg.hf_offline else RemoteEntryNotFoundError
        if isinstance(exc.__cause__, missing):
            return None
        raise


@contextlib.contextmanager
def _hf_errors(uri: str, cfg: SourceConfig):
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = cfg.hf_endpoint or "the Hugging Face hub"
    try:
        yield
    except GatedRepoError as exc:
        raise StatusError(grpc.StatusCode.PERMISSION_DENIED, f"{uri} is gated on {hub}: {exc}") from exc
    except RepositoryNotFoundError as exc:
        raise not_found(f"repo of {uri} not found on {hub} (private repos need a token)") from exc
    except RevisionNotFoundError as exc:
        raise not_found(f"revision of {uri} not found on {hub}: {exc}") from exc
    except RemoteEntryNotFoundError as exc:
        raise not_found(f"file of {uri} not found on {hub}: {exc}") from exc
    except LocalEntryNotFoundError as exc:
        if cfg.hf_offline:
            cache = cfg.hf_cache_dir or "default"
            raise not_found(f"{uri} is not in the offline Hugging Face cache ({cache})") from exc
        raise unavailable(f"{hub} unreachable and {uri} is not in the local cache: {exc}") from exc
    except HfHubHTTPError as exc:
        if exc.response is not None and exc.response.status_code in (401, 403):
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED, f"access to {uri} denied by {hub}: {exc}") from exc
        raise unavailable(f"{hub} failed while fetching {uri}: {exc}") from exc
