"""grpolens.run.storage against a real local S3 server (moto, with signature and IAM checks)."""

from __future__ import annotations

import pytest

from grpolens.run import storage
from grpolens.run.storage import StorageError, location

pytestmark = pytest.mark.slow  # starts the S3 server subprocess (~5 s once per session)


def _keys(s3, prefix: str) -> list[str]:
    """Object keys under ``prefix``, less the empty ``dir/`` markers pyarrow leaves when it deletes
    the last key of a "directory" (they hold no data)."""
    objs = s3.client().list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in objs if not o["Key"].endswith("/"))


def test_parse_storage_options():
    assert storage.parse_storage_options(["endpoint_url=http://h:1", "anonymous=true"]) == {
        "endpoint_url": "http://h:1", "anonymous": "true"}
    with pytest.raises(storage.UserError, match="unknown key 'endpoint'"):
        storage.parse_storage_options(["endpoint=x"])
    with pytest.raises(storage.UserError, match="expected key=value"):
        storage.parse_storage_options(["region"])


def test_write_read_list_roundtrip(s3_env):
    root = location("s3://runs/rt")
    (root / "a" / "x.bin").write_bytes(b"abc")
    (root / "a" / "y.bin").write_bytes(b"defg")
    names = {e.name: e.size for e in (root / "a").list_dir()}
    assert names == {"x.bin": 3, "y.bin": 4}  # no temporary key is left behind or listed
    assert _keys(s3_env, "rt/") == ["rt/a/x.bin", "rt/a/y.bin"]
    assert (root / "a" / "y.bin").read_bytes() == b"defg"
    assert [e.name for e in root.list_dir(dirs=True)] == ["a"]
    assert (root / "nothing").list_dir() == []


def test_failed_write_leaves_old_object_and_no_temporary_key(s3_env):
    loc = location("s3://runs/atomic/metrics.parquet")
    loc.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with loc.atomic_writer() as f:
            f.write(b"half of the new")
            raise RuntimeError("boom")
    assert loc.read_bytes() == b"old"
    assert _keys(s3_env, "atomic/") == ["atomic/metrics.parquet"]


def test_pyarrow_publishes_what_a_failed_producer_wrote(s3_env):
    """Why the atomic writer goes through a temporary key: a pyarrow output stream cannot be
    aborted from Python, and leaving its ``with`` block on an exception completes the upload, so
    writing straight to the final key would publish the fragment (Location.atomic_writer's
    docstring). Should pyarrow ever abort instead, this fails and the COPY can go."""
    loc = location("s3://runs/direct/metrics.parquet")
    with pytest.raises(RuntimeError, match="producer failed"):
        with loc.fs.open_output_stream(loc.path) as f:
            f.write(b"PAR1 and half of a file")
            raise RuntimeError("producer failed")
    assert loc.read_bytes() == b"PAR1 and half of a file"  # visible under the final key
    assert not hasattr(f, "abort")


def test_atomic_write_costs(s3_env):
    """A small file: one PUT of the temporary key (no multipart upload), one COPY, one DELETE, and
    pyarrow's check of the parent after the delete (a HEAD, a directory-marker PUT)."""
    loc = location("s3://runs/costs/metrics.parquet")
    s3_env.reset_counts()
    loc.write_bytes(b"x" * 100_000)
    counts = s3_env.counts()
    assert counts.get("POST", 0) == 0, counts
    assert counts["COPY"] == 1 and counts["DELETE"] == 1 and sum(counts.values()) <= 5, counts
    assert loc.read_bytes() == b"x" * 100_000


def test_fingerprint_changes_when_object_is_rewritten(s3_env):
    loc = location("s3://runs/fp/f.bin")
    loc.write_bytes(b"1")
    before = location("s3://runs/fp").list_dir()[0].fingerprint()
    loc.write_bytes(b"22")
    after = location("s3://runs/fp").list_dir()[0].fingerprint()
    assert before[0] == after[0] == "f.bin" and before != after


def test_missing_bucket_is_one_line(s3_env):
    with pytest.raises(StorageError) as e:
        location("s3://no-such-bucket/run").list_dir()
    assert str(e.value) == "s3://no-such-bucket/run: no such bucket"


def test_permission_denied(s3_env, monkeypatch):
    s3_env.client().put_object(Bucket="runs", Key="pd/x.bin", Body=b"1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.lister[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.lister[1])
    assert [e.name for e in location("s3://runs/pd").list_dir()] == ["x.bin"]  # listing is allowed
    with pytest.raises(StorageError) as e:
        location("s3://runs/pd/x.bin").read_bytes()
    assert str(e.value) == "s3://runs/pd/x.bin: permission denied"


def test_wrong_secret(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=r"^s3://runs/x: credentials rejected or missing"):
        location("s3://runs/x").list_dir()


def test_missing_credentials_fail_at_once(s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match=r"^no S3 credentials: set AWS_ACCESS_KEY_ID"):
        location("s3://runs/x")


def test_profile_and_storage_options(s3_env, monkeypatch, tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text(f"[team]\naws_access_key_id = {s3_env.admin[0]}\naws_secret_access_key = {s3_env.admin[1]}\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    opts = {"profile": "team", "endpoint_url": s3_env.endpoint}
    loc = location("s3://runs/prof/p.bin", opts)
    loc.write_bytes(b"via profile")
    assert loc.read_bytes() == b"via profile"
    with pytest.raises(StorageError, match="no such profile"):
        location("s3://runs/prof", {"profile": "nope", "endpoint_url": s3_env.endpoint})


def test_object_removed_before_read(s3_env):
    loc = location("s3://runs/gone/x.bin")
    loc.write_bytes(b"1")
    s3_env.client().delete_object(Bucket="runs", Key="gone/x.bin")
    with pytest.raises(StorageError) as e:
        loc.read_bytes()
    assert str(e.value).startswith("s3://runs/gone/x.bin: no such file or object")


def test_local_locations(tmp_path):
    root = location(tmp_path)
    (root / "d" / "f.bin").write_bytes(b"x")
    assert [e.name for e in (root / "d").list_dir()] == ["f.bin"]
    assert not root.remote
    with pytest.raises(StorageError, match="no such file"):
        (root / "missing").read_bytes()
