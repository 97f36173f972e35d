"""Where a run lives: a local directory or an ``s3://bucket/prefix`` on S3-compatible storage.

One small layer between grpolens and the bytes. Everything that lists, reads or writes run files
asks for a :class:`Location` and goes through it, so a command that works on a local run works on
object storage unchanged. Both kinds are :mod:`pyarrow.fs` filesystems: the local one for
directories, :class:`pyarrow.fs.S3FileSystem` for ``s3://``: C++ reads with ranged GETs, and
already part of pyarrow, which the core depends on, so object storage needs no extra install.
fsspec/s3fs, the alternative, lists and reads more slowly on the same run and would add
aiobotocore (``benchmarks/bench_s3_layers.py``; docs/distributed.md).

Credentials and endpoint, first found wins:

1. ``--storage-option`` keys: ``endpoint_url``, ``region``, ``anonymous``, ``profile``,
   ``access_key_id``, ``secret_access_key``, ``session_token``;
2. the standard environment variables ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
   ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), ``AWS_ENDPOINT_URL``
   (or ``AWS_ENDPOINT_URL_S3``);
3. the profile named by ``profile`` or ``AWS_PROFILE`` (default ``default``) in
   ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
   ``AWS_CONFIG_FILE``);
4. otherwise the AWS SDK's own chain (instance roles, web identity), unless
   ``AWS_EC2_METADATA_DISABLED=true``: then "no credentials" is reported at once.

Writes are atomic as far as the store allows: an object is written under a temporary key beside
its final one and then copied onto the final key (S3 has no rename; a copy makes the new object
appear whole or not at all), and the temporary key is deleted. A reader never sees a half-written
object under a final key. Every storage failure becomes one :class:`StorageError` line naming the
URL and the cause (missing bucket, missing credentials, permission denied, missing object).
"""

from __future__ import annotations

import configparser
import contextlib
import io
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from grpolens.errors import UserError

S3_SCHEME = "s3://"
#: ``--storage-option`` keys understood for ``s3://`` locations.
OPTION_KEYS = ("endpoint_url", "region", "anonymous", "profile", "access_key_id", "secret_access_key", "session_token")
#: Prefix of the temporary key an atomic write goes through (list_dir never reports these).
TMP_PREFIX = ".grpolens-tmp-"


class StorageError(UserError):
    """A storage operation failed for a reason the user fixes (bucket, credentials, permissions)."""


def is_remote(path: os.PathLike | str) -> bool:
    return isinstance(path, str) and path.startswith(S3_SCHEME)


#: The parsed ``--storage-option`` pairs of the running command (see :func:`set_default_options`).
_DEFAULT_OPTIONS: dict[str, str] = {}


def set_default_options(options: dict[str, str] | None) -> None:
    """Make ``options`` the settings of every ``s3://`` location opened without options of its
    own in this process: the command's ``--storage-option`` pairs, set once by the shared option
    (``grpolens/commands/options.py``) so that every reader below the command sees them."""
    _DEFAULT_OPTIONS.clear()
    _DEFAULT_OPTIONS.update(options or {})


def parse_storage_options(items: list[str] | None) -> dict[str, str]:
    """``--storage-option key=value`` pairs, keys checked against :data:`OPTION_KEYS`."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--storage-option: expected key=value, got {item!r}")
        if key not in OPTION_KEYS:
            raise UserError(f"--storage-option: unknown key {key!r}; known: {', '.join(OPTION_KEYS)}")
        out[key] = value.strip()
    return out


def _truthy(v: str | None) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def _profile_values(profile: str) -> dict[str, str]:
    """Keys of ``profile`` from the shared credentials and config files (credentials file wins)."""
    out: dict[str, str] = {}
    cfg_file = Path(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")).expanduser()
    cred_file = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")).expanduser()
    for path, section in ((cfg_file, profile if profile == "default" else f"profile {profile}"), (cred_file, profile)):
        if not path.is_file():
            continue
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error as e:
            raise StorageError(f"{path}: not a valid AWS config file: {e}".splitlines()[0]) from None
        if parser.has_section(section):
            out.update({k: v for k, v in parser.items(section)})
    return out


@dataclass(frozen=True)
class S3Settings:
    """Resolved connection settings for one S3 endpoint (what :func:`s3_filesystem` needs)."""

    endpoint_url: str | None = None
    region: str | None = None
    anonymous: bool = False
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)  # never in a traceback or a log
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def resolve(cls, options: dict[str, str] | None = None) -> "S3Settings":
        o = dict(options or {})
        env = os.environ
        anonymous = _truthy(o.get("anonymous"))
        profile_name = o.get("profile") or env.get("AWS_PROFILE") or "default"
        prof = _profile_values(profile_name)
        if o.get("profile") and not prof:
            raise StorageError(f"--storage-option profile={profile_name}: no such profile in ~/.aws/credentials or ~/.aws/config")
        key = o.get("access_key_id") or env.get("AWS_ACCESS_KEY_ID") or prof.get("aws_access_key_id")
        secret = o.get("secret_access_key") or env.get("AWS_SECRET_ACCESS_KEY") or prof.get("aws_secret_access_key")
        token = o.get("session_token") or env.get("AWS_SESSION_TOKEN") or prof.get("aws_session_token")
        if o.get("access_key_id") or env.get("AWS_ACCESS_KEY_ID"):
            # a key from the options or the environment never pairs with a profile's secret
            secret = o.get("secret_access_key") or env.get("AWS_SECRET_ACCESS_KEY")
        if bool(key) != bool(secret) and not anonymous:
            raise StorageError("S3 credentials incomplete: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                               "(or --storage-option access_key_id=... secret_access_key=...)")
        if not anonymous and not key and _truthy(env.get("AWS_EC2_METADATA_DISABLED")) \
                and not env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and not env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI") \
                and not env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
            raise StorageError("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                               "or pass --storage-option anonymous=true for a public bucket")
        endpoint = (o.get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                    or prof.get("endpoint_url"))
        region = o.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or prof.get("region")
        return cls(endpoint, region, anonymous, None if anonymous else key, None if anonymous else secret,
                   None if anonymous else token)

    def storage_options(self) -> dict[str, str]:
        """The same settings as ``--storage-option`` pairs (shipped to Ray workers, never logged)."""
        out = {k: v for k, v in (("endpoint_url", self.endpoint_url), ("region", self.region),
                                 ("access_key_id", self.access_key_id), ("secret_access_key", self.secret_access_key),
                                 ("session_token", self.session_token)) if v}
        if self.anonymous:
            out["anonymous"] = "true"
        return out


_FS_CACHE: dict[tuple[S3Settings, bool], pafs.FileSystem] = {}


def s3_filesystem(settings: S3Settings, delayed_open: bool = False) -> pafs.FileSystem:
    """A pyarrow S3 filesystem for ``settings`` (one per settings per process: connections are reused).

    ``delayed_open``: the one :meth:`Location.atomic_writer` writes through. pyarrow then sends an
    object smaller than its 10 MiB upload part as one PUT when the stream is closed, instead of a
    multipart upload's three requests (create, part, complete); a failure (no such bucket) is
    reported at the close, which the writer wraps like the rest. Reads keep the immediate open, so
    that a missing object is reported where it is opened."""
    fs = _FS_CACHE.get((settings, delayed_open))
    if fs is None:
        kw: dict = {"region": settings.region or "us-east-1", "anonymous": settings.anonymous,
                    "connect_timeout": 10, "request_timeout": 60, "allow_delayed_open": delayed_open}
        if settings.endpoint_url:
            m = re.match(r"^(https?)://(.+?)/?$", settings.endpoint_url)
            if not m:
                raise StorageError(f"endpoint_url {settings.endpoint_url!r}: expected http://host[:port] or https://host[:port]")
            kw.update(scheme=m.group(1), endpoint_override=m.group(2))
        if settings.access_key_id:
            kw.update(access_key=settings.access_key_id, secret_key=settings.secret_access_key,
                      session_token=settings.session_token)
        fs = _FS_CACHE[(settings, delayed_open)] = pafs.S3FileSystem(**kw)
    return fs


@dataclass(frozen=True)
class Entry:
    """A listed file: its name (last path component), size and modification time.
    :meth:`fingerprint` is what the per-step cache compares. No ETag: pyarrow's listing does not
    carry it, and S3's LastModified has one-second resolution, so an object rewritten with the
    same size within the second of the version a recompute read looks unchanged. grpolens' writer
    never writes a key twice (docs/distributed.md, "Which S3 layer, and what the cache compares")."""

    name: str
    size: int
    mtime_ns: int | None

    @property
    def st_size(self) -> int:  # the os.stat_result fields readers compare
        return self.size

    @property
    def st_mtime_ns(self) -> int:
        return self.mtime_ns or 0

    def fingerprint(self) -> list:
        return [self.name, self.size, self.mtime_ns]


@dataclass(frozen=True)
class Location:
    """A file or directory of a run: ``fs`` and the filesystem ``path`` in it; ``url`` is how the
    user wrote it (every message names that)."""

    fs: pafs.FileSystem = field(repr=False, compare=False)
    path: str
    url: str
    settings: S3Settings | None = field(default=None, repr=False, compare=False)
    #: "file" or "dir" when a listing already said which (saves a request per entry)
    kind: str | None = field(default=None, repr=False, compare=False)

    @property
    def remote(self) -> bool:
        return self.settings is not None

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        return Location(self.fs, self.path.rstrip("/").rpartition("/")[0], self.url.rstrip("/").rpartition("/")[0],
                        self.settings, "dir")

    def __truediv__(self, part: str) -> "Location":
        part = str(part).strip("/")
        return Location(self.fs, f"{self.path.rstrip('/')}/{part}", f"{self.url.rstrip('/')}/{part}", self.settings)

    def __str__(self) -> str:
        return self.url

    def __lt__(self, other: "Location") -> bool:  # sorted() listings, as sorted(Path.iterdir())
        return self.path < other.path

    def relative_to(self, root: "Location") -> str:
        """This location's path below ``root``, with ``/`` (what messages name)."""
        base = root.path.rstrip("/")
        return self.path[len(base) + 1:] if self.path.startswith(base + "/") else self.path

    def __reduce__(self):
        # pyarrow filesystems pickle, but the settings are enough to rebuild one on a worker
        # (and keep one per process there)
        return (_rebuild, (self.path, self.url, self.settings))

    # -- reads --------------------------------------------------------------------------------

    def exists(self) -> bool:
        with storage_errors(self):
            return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        if self.kind is not None:
            return self.kind == "file"
        with storage_errors(self):
            return self.fs.get_file_info(self.path).type == pafs.FileType.File

    def is_dir(self) -> bool:
        if self.kind is not None:
            return self.kind == "dir"
        with storage_errors(self):
            return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def stat(self) -> Entry:
        """Size and modification time (``st_size``, ``st_mtime_ns``, as :meth:`pathlib.Path.stat`);
        FileNotFoundError when there is no such object."""
        with storage_errors(self):
            info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(self.url)
        return Entry(info.base_name, info.size or 0, info.mtime_ns)

    def iterdir(self) -> list["Location"]:
        """Direct children, files and sub-directories, temporary keys of interrupted writes
        included (``grpolens validate`` reports them), each knowing its kind. One LIST request
        per 1,000 keys on S3."""
        sel = pafs.FileSelector(self.path, allow_not_found=True, recursive=False)
        with storage_errors(self):
            infos = self.fs.get_file_info(sel)
        kinds = {pafs.FileType.File: "file", pafs.FileType.Directory: "dir"}
        return [Location(self.fs, i.path, f"{self.url.rstrip('/')}/{i.base_name}", self.settings, kinds.get(i.type))
                for i in infos if i.type in kinds]

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def list_dir(self, dirs: bool = False) -> list[Entry]:
        """Direct children (files, or sub-directories with ``dirs``); [] when there is no such
        directory. One LIST request per 1,000 keys on S3."""
        sel = pafs.FileSelector(self.path, allow_not_found=True, recursive=False)
        with storage_errors(self):
            infos = self.fs.get_file_info(sel)
            if not infos and self.remote:
                self._check_bucket()
        want = pafs.FileType.Directory if dirs else pafs.FileType.File
        return [Entry(i.base_name, i.size or 0, i.mtime_ns) for i in infos
                if i.type == want and not i.base_name.startswith(TMP_PREFIX)]

    def _check_bucket(self) -> None:
        """An empty listing of a missing bucket is an error, not an empty run (one HEAD request)."""
        bucket = self.path.split("/", 1)[0]
        if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise StorageError(f"{self.url}: no such bucket")

    def walk(self) -> list[tuple[str, Entry]]:
        """Every file below this prefix, recursively, as (path relative to it, entry); [] when
        there is none. One LIST request per 1,000 keys on S3."""
        sel = pafs.FileSelector(self.path, allow_not_found=True, recursive=True)
        with storage_errors(self):
            infos = self.fs.get_file_info(sel)
            if not infos and self.remote:
                self._check_bucket()
        n = len(self.path.rstrip("/")) + 1
        return [(i.path[n:], Entry(i.base_name, i.size or 0, i.mtime_ns)) for i in infos
                if i.type == pafs.FileType.File and not i.base_name.startswith(TMP_PREFIX)]

    def read_bytes(self) -> bytes:
        with storage_errors(self), self.fs.open_input_stream(self.path) as f:
            return f.read()

    def open_input(self) -> pa.NativeFile:
        """A random-access file (what :class:`pyarrow.parquet.ParquetFile` wants: ranged GETs on S3)."""
        with storage_errors(self):
            return self.fs.open_input_file(self.path)

    # -- writes -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def atomic_writer(self) -> Iterator[io.RawIOBase]:
        """Write this file so that readers see the old object or the whole new one, never a part.

        Local: :func:`grpolens.run.atomic.atomic_file` (temp file, fsync, rename). S3: the bytes go to
        a temporary key beside the final one, which is then copied onto the final key and deleted;
        an error on the way deletes the temporary key and leaves the final key untouched.

        Why not upload straight to the final key, as one PUT or a multipart upload that S3 makes
        visible only when it is completed: pyarrow's Python streams cannot abort. Its C++ stream
        has ``Abort()`` (AbortMultipartUpload), but ``NativeFile`` does not expose it, and closing
        the stream, which leaving a ``with`` block does on an exception and which the stream's
        destructor does too, *completes* the upload with whatever was written. A producer that
        fails half-way (a Parquet writer error, a KeyboardInterrupt) would publish a truncated
        object under the final key; ``tests/distributed/test_storage.py`` shows it on the local
        server. Under a temporary key such a fragment is harmless (deleted here, or reported by
        ``validate`` when the process died), and only the server-side COPY of a whole file touches
        the final key. The price: a COPY and a DELETE per file (and pyarrow's HEAD and directory
        marker PUT after a delete), on top of the upload, a single PUT for files under 10 MiB
        (:func:`s3_filesystem` with ``delayed_open``)."""
        if not self.remote:
            from grpolens.run.atomic import atomic_file

            with atomic_file(self.path) as f:
                yield f
            return
        parent, _, name = self.path.rpartition("/")
        tmp = f"{parent}/{TMP_PREFIX}{uuid.uuid4().hex}-{name}"
        try:
            with storage_errors(self):
                with s3_filesystem(self.settings, delayed_open=True).open_output_stream(tmp) as f:
                    yield f
                self.fs.copy_file(tmp, self.path)
        finally:
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)

    def write_bytes(self, data: bytes) -> None:
        with self.atomic_writer() as f:
            f.write(data)

    def delete(self) -> None:
        with storage_errors(self):
            self.fs.delete_file(self.path)

    # -- what the shard writer does to a local run directory, on object storage ------------------

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing: an object store has no directories (a key's prefix appears with the key)."""

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.delete()

    def rmtree(self) -> None:
        """Every key below this prefix (as :func:`shutil.rmtree` with ``ignore_errors``: a prefix
        that holds nothing is no error)."""
        with storage_errors(self):
            self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
            with contextlib.suppress(OSError):  # the empty "directory" marker object, if any
                self.fs.delete_dir(self.path)

    def rename(self, target: "Location") -> None:
        """Copy onto ``target``, then delete this key (S3 has no rename: for a moment both exist;
        the shard writer renames only within a step that has no completion marker yet)."""
        with storage_errors(self):
            self.fs.copy_file(self.path, target.path)
            self.fs.delete_file(self.path)


def _rebuild(path: str, url: str, settings: S3Settings | None) -> Location:
    fs = s3_filesystem(settings) if settings is not None else pafs.LocalFileSystem()
    return Location(fs, path, url, settings)


def location(path: os.PathLike | str | Location, options: dict[str, str] | None = None) -> Location:
    """The :class:`Location` of a local path or an ``s3://bucket/key`` URL (``options`` are the
    parsed ``--storage-option`` pairs; they apply to ``s3://`` only)."""
    if isinstance(path, Location):
        return path
    if is_remote(path):
        rest = str(path)[len(S3_SCHEME):].strip("/")
        if not rest or rest.startswith("/"):
            raise StorageError(f"{path}: expected s3://bucket[/prefix]")
        settings = S3Settings.resolve(_DEFAULT_OPTIONS if options is None else options)
        return Location(s3_filesystem(settings), rest, f"{S3_SCHEME}{rest}", settings)
    if options:
        raise UserError(f"--storage-option applies to s3:// locations only, not {path}")
    p = Path(path).absolute()
    return Location(pafs.LocalFileSystem(), p.as_posix(), str(path), None)


# ---------------------------------------------------------------------------------------------
# Errors: one line each
# ---------------------------------------------------------------------------------------------

_CAUSES = (
    (re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|bucket does not exist", re.I), "no such bucket"),
    (re.compile(r"INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SignatureDoesNotMatch|SIGNATURE_DOES_NOT_MATCH|"
                r"No credentials|credentials.*not.*found|Unable to locate credentials", re.I),
     "credentials rejected or missing (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE)"),
    (re.compile(r"ACCESS_DENIED|AccessDenied|Forbidden|HTTP response code: 403|Permission denied", re.I), "permission denied"),
    (re.compile(r"NO_SUCH_KEY|NoSuchKey|Path does not exist|No such file|HTTP response code: 404|not found", re.I),
     "no such file or object (removed while being read?)"),
    (re.compile(r"Could not connect|Couldn't connect|Connection refused|curlCode: 7|Timeout was reached|"
                r"Failed to resolve|Name or service not known", re.I), "cannot reach the storage endpoint"),
)


def describe(exc: BaseException) -> str:
    """The cause of a storage exception in a few words (the first matching known cause)."""
    text = str(exc)
    for pattern, cause in _CAUSES:
        if pattern.search(text):
            return cause
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


@contextlib.contextmanager
def storage_errors(loc: Location | str) -> Iterator[None]:
    """Turn an OSError from the filesystem into one :class:`StorageError` line naming ``loc``."""
    try:
        yield
    except StorageError:
        raise
    except (OSError, pa.ArrowException) as e:
        if isinstance(e, FileNotFoundError) and not getattr(loc, "remote", False):
            raise StorageError(f"{loc}: no such file or directory") from None
        if isinstance(e, PermissionError) and not getattr(loc, "remote", False):
            raise StorageError(f"{loc}: permission denied") from None
        raise StorageError(f"{loc}: {describe(e)}") from None
