"""Adapter sources against real parts: local files, moto's S3 server, a real HF cache layout."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from loraserve.adapter_store.sources import SourceConfig, fetch, parse_uri
from loraserve.errors import StatusError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def assert_status(excinfo, code: grpc.StatusCode, fragment: str) -> None:
    assert excinfo.value.code == code, excinfo.value
    assert fragment in excinfo.value.message, excinfo.value.message


def assert_same_files(fetched_dir: Path, source_dir: Path, names=ADAPTER_FILES) -> None:
    assert sorted(p.name for p in fetched_dir.iterdir()) == sorted(names)
    for name in names:
        assert (fetched_dir / name).read_bytes() == (source_dir / name).read_bytes(), name


@pytest.fixture
def staging(tmp_path) -> Path:
    directory = tmp_path / "staging"
    directory.mkdir()
    return directory


@pytest.fixture
def local_root(tmp_path, peft_adapter) -> Path:
    """An allowed local root holding one real adapter in `root/my-adapter`."""
    root = tmp_path / "adapters"
    root.mkdir()
    shutil.copytree(peft_adapter(), root / "my-adapter")
    return root


# ---------------------------------------------------------------------------------------
# parse_uri
# ---------------------------------------------------------------------------------------


def test_parse_uri_splits_each_scheme():
    assert parse_uri("/a/b", None) == parse_uri("file:///a/b", "")
    assert parse_uri("rel/path", None).path == "rel/path"
    s3 = parse_uri("s3://bucket/some/prefix/", None)
    assert (s3.scheme, s3.root, s3.path, str(s3)) == ("s3", "bucket", "some/prefix", "s3://bucket/some/prefix")
    hf = parse_uri("hf://org/name/sub@refs/pr/1", None)
    assert (hf.root, hf.path, hf.revision, str(hf)) == ("org/name", "sub", "refs/pr/1", "hf://org/name/sub")
    assert parse_uri("hf://org/name", "v1").revision == "v1"


def test_parse_uri_rejects_unknown_scheme():
    with pytest.raises(StatusError) as excinfo:
        parse_uri("ftp://host/x", None)
    assert_status(excinfo, grpc.StatusCode.INVALID_ARGUMENT, "unsupported adapter URI scheme 'ftp' in 'ftp://host/x'")


@pytest.mark.parametrize(
    "uri, revision, fragment",
    [
        ("hf://org/name@a", "b", "pins revision 'a' but 'b'"),
        ("hf://name", None, "hf://org/name"),
        ("hf://org/name/../x", None, "'..' folder"),
        ("s3:///prefix", None, "names no bucket"),
        ("file://host/x", None, "absolute path"),
        ("/a/b", "v1", "has no revisions"),
        ("", None, "empty"),
    ],
)
def test_parse_uri_rejects_malformed(uri, revision, fragment):
    with pytest.raises(StatusError) as excinfo:
        parse_uri(uri, revision)
    assert_status(excinfo, grpc.StatusCode.INVALID_ARGUMENT, fragment)


# ---------------------------------------------------------------------------------------
# file://
# ---------------------------------------------------------------------------------------


def test_file_inside_roots_copies_only_adapter_files(local_root, staging):
    fetched = fetch(f"file://{local_root}/my-adapter", None, SourceConfig((local_root,)), staging)
    assert fetched.directory == staging and fetched.revision == ""
    assert fetched.uri == f"file://{(local_root / 'my-adapter').resolve()}"
    assert_same_files(staging, local_root / "my-adapter")  # README.md is left behind


def test_relative_path_resolves_under_the_roots(local_root, staging):
    fetched = fetch("my-adapter", None, SourceConfig((local_root,)), staging)
    assert fetched.uri.endswith("/adapters/my-adapter")


def test_dotdot_outside_roots_is_denied(local_root, staging, peft_adapter):
    outside = peft_adapter()
    uri = f"{local_root}/../{os.path.relpath(outside, local_root.parent)}"
    with pytest.raises(StatusError) as excinfo:
        fetch(uri, None, SourceConfig((local_root,)), staging)
    assert_status(excinfo, grpc.StatusCode.PERMISSION_DENIED, "outside the store's allowed local roots")
    assert not list(staging.iterdir())


def test_symlinked_dir_outside_roots_is_denied(local_root, staging, peft_adapter):
    (local_root / "sneaky").symlink_to(peft_adapter())
    with pytest.raises(StatusError) as excinfo:
        fetch("sneaky", None, SourceConfig((local_root,)), staging)
    assert_status(excinfo, grpc.StatusCode.PERMISSION_DENIED, "outside the store's allowed local roots")


def test_symlinked_weights_outside_roots_are_denied(local_root, staging, peft_adapter):
    weights = local_root / "my-adapter" / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(peft_adapter() / "adapter_model.safetensors")
    with pytest.raises(StatusError) as excinfo:
        fetch("my-adapter", None, SourceConfig((local_root,)), staging)
    assert_status(excinfo, grpc.StatusCode.PERMISSION_DENIED, "adapter_model.safetensors")


def test_missing_path_and_missing_files_are_not_found(local_root, staging):
    cfg = SourceConfig((local_root,))
    with pytest.raises(StatusError) as excinfo:
        fetch(f"{local_root}/nope", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, f"'{local_root}/nope' does not exist")
    (local_root / "my-adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(StatusError) as excinfo:
        fetch("my-adapter", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, "adapter_model.safetensors is missing")
    (local_root / "my-adapter" / "adapter_config.json").unlink()
    with pytest.raises(StatusError) as excinfo:
        fetch("my-adapter", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, "has no adapter_config.json")


def test_weights_without_config_are_invalid_argument(local_root, staging):
    (local_root / "my-adapter" / "adapter_config.json").unlink()
    with pytest.raises(StatusError) as excinfo:
        fetch("my-adapter", None, SourceConfig((local_root,)), staging)
    assert_status(
        excinfo,
        grpc.StatusCode.INVALID_ARGUMENT,
        "has adapter_model.safetensors but no adapter_config.json: not a valid PEFT adapter without it",
    )


def test_pickled_weights_refused_unless_allowed(tmp_path, staging, peft_adapter):
    pickled = peft_adapter(safe_serialization=False)
    root = pickled.parent
    with pytest.raises(StatusError) as excinfo:
        fetch(str(pickled), None, SourceConfig((root,)), staging)
    assert_status(excinfo, grpc.StatusCode.INVALID_ARGUMENT, "--allow-pickle")
    fetch(str(pickled), None, SourceConfig((root,), allow_pickle=True), staging)
    assert_same_files(staging, pickled, ("adapter_config.json", "adapter_model.bin"))


def test_file_over_size_limit_is_refused(local_root, staging):
    with pytest.raises(StatusError) as excinfo:
        fetch("my-adapter", None, SourceConfig((local_root,), max_file_bytes=100), staging)
    assert_status(excinfo, grpc.StatusCode.INVALID_ARGUMENT, "over the store's limit of 100 bytes")


# ---------------------------------------------------------------------------------------
# s3:// (moto's HTTP server)
# ---------------------------------------------------------------------------------------


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the moto server: (boto3 client, bucket name)."""
    import uuid

    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def upload_dir(client, bucket: str, prefix: str, directory: Path) -> None:
    for path in directory.iterdir():
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def test_s3_fetch_downloads_the_adapter(s3_server, s3_bucket, peft_adapter, staging):
    client, bucket = s3_bucket
    adapter = peft_adapter()
    upload_dir(client, bucket, "team/my-adapter", adapter)
    cfg = SourceConfig((), s3_endpoint_url=s3_server, s3_region="us-east-1")
    fetched = fetch(f"s3://{bucket}/team/my-adapter/", None, cfg, staging)
    assert fetched.uri == f"s3://{bucket}/team/my-adapter"
    assert fetched.revision == hashlib.md5((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert_same_files(staging, adapter)


def test_s3_large_file_uses_parallel_ranged_gets(s3_server, s3_bucket, tmp_path, staging, caplog):
    client, bucket = s3_bucket
    source = tmp_path / "big"
    source.mkdir()
    (source / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((768, 1024), dtype=np.float32)}, source / "adapter_model.safetensors")
    upload_dir(client, bucket, "big", source)  # ~3 MiB of weights
    cfg = SourceConfig((), s3_endpoint_url=s3_server, s3_multipart_threshold_bytes=256 * 1024, s3_max_concurrency=4)
    with caplog.at_level(logging.INFO, logger="loraserve.adapter_store.sources"):
        fetch(f"s3://{bucket}/big", None, cfg, staging)
    assert_same_files(staging, source)
    n_ranges = math.ceil((source / "adapter_model.safetensors").stat().st_size / (256 * 1024))
    assert n_ranges > 4 and f"with {n_ranges} ranged GETs" in caplog.text


def test_s3_revision_pins_the_weights_etag(s3_server, s3_bucket, peft_adapter, staging, tmp_path):
    client, bucket = s3_bucket
    adapter = peft_adapter()
    upload_dir(client, bucket, "a", adapter)
    etag = client.head_object(Bucket=bucket, Key="a/adapter_model.safetensors")["ETag"].strip('"')
    cfg = SourceConfig((), s3_endpoint_url=s3_server)
    # The weights' current ETag is a pin that holds: the files come, the revision is that ETag.
    fetched = fetch(f"s3://{bucket}/a", etag, cfg, staging)
    assert fetched.revision == etag
    assert_same_files(staging, adapter)
    with pytest.raises(StatusError) as excinfo:
        fetch(f"s3://{bucket}/a", "0123abcd", cfg, tmp_path / "other-staging")
    assert_status(
        excinfo,
        grpc.StatusCode.NOT_FOUND,
        f"revision '0123abcd' of s3://{bucket}/a not found: adapter_model.safetensors has ETag '{etag}'",
    )
    # New weights under the same key: the old pin no longer holds, the new ETag does.
    other = peft_adapter(seed=3)
    client.upload_file(str(other / "adapter_model.safetensors"), bucket, "a/adapter_model.safetensors")
    new_etag = client.head_object(Bucket=bucket, Key="a/adapter_model.safetensors")["ETag"].strip('"')
    assert new_etag != etag
    with pytest.raises(StatusError) as excinfo:
        fetch(f"s3://{bucket}/a", etag, cfg, tmp_path / "stale-staging")
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, f"revision '{etag}' of s3://{bucket}/a not found")
    (tmp_path / "new-staging").mkdir()
    assert fetch(f"s3://{bucket}/a", new_etag, cfg, tmp_path / "new-staging").revision == new_etag
    assert_same_files(tmp_path / "new-staging", other)


def test_s3_missing_prefix_and_bucket_are_not_found(s3_server, s3_bucket, staging):
    _, bucket = s3_bucket
    cfg = SourceConfig((), s3_endpoint_url=s3_server)
    with pytest.raises(StatusError) as excinfo:
        fetch(f"s3://{bucket}/nothing/here", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, f"no objects under s3://{bucket}/nothing/here/")
    with pytest.raises(StatusError) as excinfo:
        fetch("s3://no-such-bucket-xyz/a", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, "s3://no-such-bucket-xyz/a: NoSuchBucket")


def test_s3_unreachable_endpoint_is_unavailable(s3_server, staging, closed_port):
    cfg = SourceConfig((), s3_endpoint_url=f"http://127.0.0.1:{closed_port}")
    with pytest.raises(StatusError) as excinfo:
        fetch("s3://bucket/adapter", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.UNAVAILABLE, "S3 endpoint unreachable while reading s3://bucket/adapter")


# ---------------------------------------------------------------------------------------
# hf:// (a real Hugging Face cache layout, offline)
# ---------------------------------------------------------------------------------------

COMMIT_SHA = "0123456789abcdef0123456789abcdef01234567"


def build_hf_cache(cache_dir: Path, repo_id: str, adapter: Path, commit_sha: str = COMMIT_SHA) -> None:
    """The hub cache layout: blobs/<sha256>, snapshots/<commit>/<file> -> blob, refs/main."""
    repo_dir = cache_dir / f"models--{repo_id.replace('/', '--')}"
    for sub in ("blobs", f"snapshots/{commit_sha}", "refs"):
        (repo_dir / sub).mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        data = (adapter / name).read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        snapshot_file = repo_dir / "snapshots" / commit_sha / name
        snapshot_file.symlink_to(os.path.relpath(blob, snapshot_file.parent))
    (repo_dir / "refs" / "main").write_text(commit_sha)


@pytest.fixture
def hf_cache(tmp_path, peft_adapter):
    adapter = peft_adapter()
    build_hf_cache(tmp_path / "hf-cache", "org/name", adapter)
    return SourceConfig((), hf_cache_dir=tmp_path / "hf-cache", hf_offline=True), adapter


def test_hf_offline_fetch_resolves_main_to_the_commit(hf_cache, staging):
    cfg, adapter = hf_cache
    fetched = fetch("hf://org/name", None, cfg, staging)
    assert (fetched.uri, fetched.revision) == ("hf://org/name", COMMIT_SHA)
    assert_same_files(staging, adapter)


def test_hf_offline_fetch_by_commit_sha(hf_cache, staging):
    cfg, adapter = hf_cache
    assert fetch(f"hf://org/name@{COMMIT_SHA}", None, cfg, staging).revision == COMMIT_SHA
    assert_same_files(staging, adapter)


def test_hf_offline_missing_repo_is_not_found(hf_cache, staging):
    cfg, _ = hf_cache
    with pytest.raises(StatusError) as excinfo:
        fetch("hf://org/other", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, "hf://org/other@main has no adapter_config.json in the offline")


def test_hf_offline_missing_weights_are_not_found(hf_cache, staging):
    cfg, _ = hf_cache
    snapshot = cfg.hf_cache_dir / "models--org--name" / "snapshots" / COMMIT_SHA
    (snapshot / "adapter_model.safetensors").unlink()
    with pytest.raises(StatusError) as excinfo:
        fetch("hf://org/name", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.NOT_FOUND, "adapter_model.safetensors is missing")


def test_hf_unreachable_hub_is_unavailable(tmp_path, staging, closed_port):
    # Slow (~23 s): huggingface_hub retries a refused connection with backoff before giving up.
    cfg = SourceConfig((), hf_endpoint=f"http://127.0.0.1:{closed_port}", hf_cache_dir=tmp_path / "empty-cache")
    with pytest.raises(StatusError) as excinfo:
        fetch("hf://org/name", None, cfg, staging)
    assert_status(excinfo, grpc.StatusCode.UNAVAILABLE, "unreachable")
