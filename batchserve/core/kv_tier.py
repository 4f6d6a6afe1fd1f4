"""The disk tier under the block pool: one file per full block, named by a digest of the block's hash chain.

Torch-free: a block's K/V arrive here as bytes (worker/kv_offload.py turns tensors into bytes and back). The store is
a directory per fingerprint (model, dtype, KV format, block size, layer shapes), so engines of another model never
read these files, and engines of the same model (a restart, another replica on the host) share them.

Every file is a header then the payload: magic, format version, retention priority, expiry, fingerprint, the block's
digest, the payload's length and a CRC-32 over header and payload (zlib's polynomial, computed by ISA-L's folding
code, a dozen times zlib's own speed; a check against torn and flipped bytes, not against a forger: a forger who can
write the directory can write anything). A file is written to a temporary name and
renamed into place, so a reader sees a whole file or none; two writers of one block each rename a whole file, and
either one is the block. A file that fails any check (torn, truncated, another model's, a flipped byte) is deleted
and counted, and its tokens are recomputed: a bad block is never served.

Eviction keeps the directory within its byte cap: lowest retention priority first (an expired priority counts as the
default), then blocks no waiting request needs, then least recently used.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import struct
import threading
import time
import uuid
from array import array
from dataclasses import dataclass
from pathlib import Path

from isal import isal_zlib

logger = logging.getLogger(__name__)

MAGIC = b"BSKVBLK1"
VERSION = 2  # 1: a blake2b checksum; its files fail the version check and are recomputed
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority: blocks with no retention config
# magic, version, priority, expires_at (unix seconds, 0: never), fingerprint, digest, payload length
_HEADER = struct.Struct("<8sHHd16s16sQ")
_CHECKSUM = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CHECKSUM.size
SUFFIX = ".kvb"
STALE_TEMP_S = 600.0  # a temporary file older than this is a crashed writer's, not a live one's


class TierConfigError(ValueError):
    """The tier's directory or cap cannot work: refused at start, naming the option."""


def block_digest(parent: bytes | None, key) -> bytes:
    """A digest of a block's whole hash chain that every process computes alike (Python's hash() of None is not):
    the parent block's digest (for the first block, the key's salt) and every other field of the key (tokens, and
    whatever else a key carries)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else repr(key.parent_hash).encode())
    for f in dataclasses.fields(key):
        if f.name == "parent_hash":
            continue
        value = getattr(key, f.name)
        if f.name == "token_ids":
            h.update(array("q", value).tobytes())
        else:
            h.update(f.name.encode() + b"=" + repr(value).encode())
    return h.digest()


def fingerprint_of(description: str) -> bytes:
    return hashlib.blake2b(description.encode(), digest_size=16).digest()


@dataclass
class TierStats:
    """Counts since start (this process's): what the metrics export."""

    hits: int = 0  # blocks served from the tier (read back instead of recomputed)
    blocks_read: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    blocks_written: int = 0
    bytes_written: int = 0
    write_s: float = 0.0
    corrupt_dropped: int = 0  # files that failed a check: deleted, their tokens recomputed
    write_errors: int = 0  # writes that failed (a full disk): the block is simply not in the tier
    evicted: int = 0  # files deleted to stay within the cap
    bytes_used: int = 0


@dataclass
class _Entry:
    size: int
    priority: int
    expires_at: float  # 0: never
    last_used: float


@dataclass(frozen=True)
class Retention:
    priority: int = DEFAULT_PRIORITY
    expires_at: float = 0.0  # unix seconds; 0: never


class TierStore:
    """Files of one fingerprint under `root`, within `max_bytes`. Thread-safe: the scheduler looks up and reads,
    the worker's writer thread writes."""

    def __init__(self, root: str | Path, description: str, max_bytes: int, block_bytes: int) -> None:
        check_tier_options(root, max_bytes, block_bytes)
        self.fingerprint = fingerprint_of(description)
        self.dir = Path(root) / self.fingerprint.hex()
        self.dir.mkdir(exist_ok=True)
        (self.dir / "FINGERPRINT").write_text(description + "\n")  # for a person listing the directory
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.protected: frozenset[bytes] = frozenset()  # digests waiting requests will need: evicted after others
        self._index: dict[bytes, _Entry] = {}
        self._pending: set[bytes] = set()  # claimed for writing, not yet written (or failed)
        self._lock = threading.Lock()
        self._buffers = threading.local()  # read_block's and read_into's buffers, one set per reading thread
        self._rebuild_index()

    # ---- lookups and reads ---------------------------------------------------------------------------------
    def path_of(self, digest: bytes) -> Path:
        return self.dir / (digest.hex() + SUFFIX)

    def contains(self, digest: bytes) -> bool:
        """In the index, or written since by another engine sharing the directory (then adopted)."""
        with self._lock:
            if digest in self._index:
                return True
        try:
            size = self.path_of(digest).stat().st_size
        except OSError:
            return False
        with self._lock:
            self._adopt(digest, size, Retention(), time.time())
        return True

    def get(self, digest: bytes) -> memoryview | None:
        """The block's payload (a view of the file's bytes, no copy), checked; None when it is absent or fails a
        check (then it is deleted and counted)."""
        start = time.perf_counter()
        path = self.path_of(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(digest)
            return None
        except OSError as exc:
            logger.warning("KV tier: cannot read %s (%s): its tokens are recomputed", path.name, exc)
            return None
        payload, why = self._check(digest, data)
        if payload is None:
            self.drop_corrupt(digest, why)
            return None
        self._read_done(digest, len(data), start)
        return payload

    def read_into(self, digest: bytes, views: list) -> bool:
        """Read the block straight into `views` (writable byte buffers, in payload order: the pool block's rows of
        each layer part) by one readv, the header into this thread's own small buffer, and check it there: one CRC
        over the header and the views. A block read into a staging buffer and then copied into the rows moved its
        bytes twice, and the copy (60 slices a block, held under the GIL) cost more than the read. False when the
        file is absent or fails a check (then it is deleted and counted); the views then hold whatever was read,
        which is harmless: they are a fresh block of the pool that nobody finds and its tokens are recomputed."""
        start = time.perf_counter()
        dests = [v if isinstance(v, memoryview) and v.format == "B" and v.ndim == 1 else memoryview(v).cast("B")
                 for v in views]  # fmt: skip
        length = sum(d.nbytes for d in dests)
        head, tail = self._read_buffers()
        got = self._readv(digest, [head, *dests, tail])  # the byte past the block: a file longer than its block
        if got is None:
            return False
        why = self._check_header(digest, head, got, length)
        if not why and _checksum(head[: _HEADER.size], *dests) != head[_HEADER.size :]:
            why = "checksum mismatch"
        if why:
            self.drop_corrupt(digest, why)
            return False
        self._read_done(digest, got, start)
        return True

    def read_block(self, digest: bytes, length: int) -> memoryview | None:
        """The block's payload (`length` bytes), read by one readv into this thread's own reusable buffer and checked
        there by one CRC call: valid until this thread reads again. None when the file is absent or fails a check
        (then it is deleted and counted)."""
        start = time.perf_counter()
        buffers = self._buffers.__dict__
        buffer = buffers.get("whole")
        if buffer is None or len(buffer) != HEADER_BYTES + length + 1:  # + a byte: a file longer than its block
            buffer = buffers["whole"] = memoryview(bytearray(HEADER_BYTES + length + 1))
        got = self._readv(digest, [buffer])
        if got is None:
            return None
        why = self._check_header(digest, buffer, got, length)
        if (
            not why
            and _checksum(buffer[: _HEADER.size], buffer[HEADER_BYTES:got]) != buffer[_HEADER.size : HEADER_BYTES]
        ):
            why = "checksum mismatch"
        if why:
            self.drop_corrupt(digest, why)
            return None
        self._read_done(digest, got, start)
        return buffer[HEADER_BYTES:got]

    def _readv(self, digest: bytes, buffers: list) -> int | None:
        """Bytes read from the block's file into `buffers` by one readv; None when it cannot be read (absent:
        forgotten; another error: logged)."""
        path = self.path_of(digest)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(digest)
            return None
        except OSError as exc:
            logger.warning("KV tier: cannot read %s (%s): its tokens are recomputed", path.name, exc)
            return None
        try:
            return os.readv(fd, buffers)
        except OSError as exc:
            logger.warning("KV tier: cannot read %s (%s): its tokens are recomputed", path.name, exc)
            return None
        finally:
            os.close(fd)

    def _read_buffers(self) -> tuple[memoryview, memoryview]:
        """This reading thread's header buffer and its one byte past a block, made once."""
        buffers = self._buffers.__dict__
        if "head" not in buffers:
            buffers["head"], buffers["tail"] = memoryview(bytearray(HEADER_BYTES)), memoryview(bytearray(1))
        return buffers["head"], buffers["tail"]

    def _read_done(self, digest: bytes, nbytes: int, start: float) -> None:
        """A block read and checked: its use recorded for eviction, the read counted."""
        self._touch(digest, nbytes)
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += nbytes
            self.stats.read_s += time.perf_counter() - start

    def count_hits(self, blocks: int) -> None:
        with self._lock:
            self.stats.hits += blocks

    def _check(self, digest: bytes, data: bytes) -> tuple[memoryview | None, str]:
        why = self._check_header(digest, data, len(data))
        if why:
            return None, why
        view = memoryview(data)
        if _checksum(view[: _HEADER.size], view[HEADER_BYTES:]) != view[_HEADER.size : HEADER_BYTES]:
            return None, "checksum mismatch"
        return view[HEADER_BYTES:], ""

    def _check_header(self, digest: bytes, head, size: int, payload_bytes: int | None = None) -> str:
        """Why a file of `size` bytes starting with `head` is not this block ('' when its header says it is);
        `payload_bytes`: the payload's length the reader expects (None: any)."""
        if size < HEADER_BYTES:
            return f"truncated header ({size} bytes)"
        magic, version, _priority, _expires, fingerprint, stored, length = _HEADER.unpack_from(head)
        if magic != MAGIC or version != VERSION:
            return "not a KV block file of this format"
        if fingerprint != self.fingerprint:
            return "written for another model or KV layout"
        if stored != digest:
            return "holds another block"
        if payload_bytes is not None and length != payload_bytes:
            return f"a payload of {length} bytes where a block has {payload_bytes}"
        if size < HEADER_BYTES + length:
            return f"truncated: {size - HEADER_BYTES} of {length} payload bytes"
        return "longer than its header says" if size > HEADER_BYTES + length else ""

    def drop_corrupt(self, digest: bytes, why: str) -> None:
        logger.warning("KV tier: dropped %s (%s): its tokens are recomputed", self.path_of(digest).name, why)
        with self._lock:
            self.stats.corrupt_dropped += 1
        self._remove(digest)

    # ---- writes ---------------------------------------------------------------------------------------------
    def claim(self, digest: bytes) -> bool:
        """True when the caller should write this block: it is neither in the index nor being written. put() (or
        release()) ends the claim, so a block evicted or dropped later is written again when it is computed again.
        No file system call here (the scheduler's thread asks): put() finds a file another engine wrote."""
        with self._lock:
            if digest in self._pending or digest in self._index:
                return False
            self._pending.add(digest)
            return True

    def release(self, digests) -> None:
        """Claims given up (a writer that skipped them)."""
        with self._lock:
            self._pending.difference_update(digests)

    def put(self, digest: bytes, payload, retention: Retention = Retention()) -> bool:
        """Write one block (atomic: temporary file, then rename); `payload` is a bytes-like object, or a list of
        them written one after the other (no joined copy). False when it was not written: a block larger than the cap, or an OS error such as a full
        disk (logged and counted; the engine keeps serving)."""
        try:
            return self._put(digest, payload, retention)
        finally:
            self.release((digest,))

    def _put(self, digest: bytes, payload, retention: Retention) -> bool:
        if self._refresh_if_present(digest, retention) or self.contains(digest):  # another engine may have written it
            return True
        start = time.perf_counter()
        parts = [memoryview(p).cast("B") for p in (payload if isinstance(payload, list) else [payload])]
        length = sum(len(p) for p in parts)
        header = _HEADER.pack(
            MAGIC, VERSION, retention.priority, retention.expires_at, self.fingerprint, digest, length
        )
        size = HEADER_BYTES + length
        if size > self.max_bytes:
            return False
        self._make_room(size)
        temp = self.dir / f".{digest.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            _write_file(temp, [header, _checksum(header, *parts), *parts], size)
            os.replace(temp, self.path_of(digest))
        except OSError as exc:
            self._write_failed(temp, exc)
            return False
        with self._lock:
            self._adopt(digest, size, retention, time.time())
            self.stats.blocks_written += 1
            self.stats.bytes_written += size
            self.stats.write_s += time.perf_counter() - start
        return True

    def _write_failed(self, temp: Path, exc: OSError) -> None:
        with self._lock:
            self.stats.write_errors += 1
            first = self.stats.write_errors == 1
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        if first or self.stats.write_errors % 1000 == 0:  # a full disk fails every write: log the first and a count
            logger.warning(
                "KV tier: write failed (%s%s; %d so far): the block stays in the pool only, serving goes on",
                "disk full: " if full else "",
                exc,
                self.stats.write_errors,
            )
        try:
            temp.unlink()
        except OSError:
            pass

    def _refresh_if_present(self, digest: bytes, retention: Retention) -> bool:
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:
                return False
            entry.last_used = time.time()
            if (
                retention.priority > entry.priority
            ):  # the index ranks it higher; the file keeps what it was written with
                entry.priority, entry.expires_at = retention.priority, retention.expires_at
            return True

    # ---- the cap --------------------------------------------------------------------------------------------
    def _make_room(self, size: int) -> None:
        with self._lock:
            if self.stats.bytes_used + size <= self.max_bytes:
                return
            now = time.time()
            protected = self.protected
            order = sorted(self._index.items(), key=lambda kv: _eviction_rank(kv[0], kv[1], now, protected))
            victims = []
            for digest, entry in order:
                if self.stats.bytes_used + size <= self.max_bytes:
                    break
                victims.append(digest)
                self.stats.bytes_used -= entry.size
                del self._index[digest]
                self.stats.evicted += 1
        for digest in victims:
            _unlink(self.path_of(digest))

    def eviction_order(self) -> list[bytes]:
        """The indexed blocks, first to be evicted first (tests and the docs' examples read it)."""
        now = time.time()
        with self._lock:
            items = sorted(self._index.items(), key=lambda kv: _eviction_rank(kv[0], kv[1], now, self.protected))
        return [digest for digest, _ in items]

    # ---- the index ------------------------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        """From the directory as a previous engine (or another one now) left it: each file's size, last use (mtime:
        reads touch it) and retention from its header. Temporary files of crashed writers go."""
        now = time.time()
        for entry in os.scandir(self.dir):
            name = entry.name
            try:
                stat = entry.stat()
            except OSError:
                continue
            if name.endswith(".tmp"):
                if now - stat.st_mtime > STALE_TEMP_S:
                    _unlink(Path(entry.path))
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                digest = bytes.fromhex(name[: -len(SUFFIX)])
            except ValueError:
                continue
            with self._lock:
                self._adopt(digest, stat.st_size, _read_retention(Path(entry.path)), stat.st_mtime)

    def _adopt(self, digest: bytes, size: int, retention: Retention, last_used: float) -> None:
        old = self._index.get(digest)
        self.stats.bytes_used += size - (old.size if old else 0)
        self._index[digest] = _Entry(size, retention.priority, retention.expires_at, last_used)

    def _touch(self, digest: bytes, size: int) -> None:
        now = time.time()
        with self._lock:
            if digest in self._index:
                self._index[digest].last_used = now
            else:
                self._adopt(digest, size, Retention(), now)
        try:
            os.utime(self.path_of(digest))  # the next engine's index ranks it as recently used too
        except OSError:
            pass

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            entry = self._index.pop(digest, None)
            if entry is not None:
                self.stats.bytes_used -= entry.size

    def _remove(self, digest: bytes) -> None:
        self._forget(digest)
        _unlink(self.path_of(digest))

    def __len__(self) -> int:
        return len(self._index)


def _eviction_rank(digest: bytes, entry: _Entry, now: float, protected: frozenset[bytes]) -> tuple:
    priority = entry.priority if not entry.expires_at or entry.expires_at > now else DEFAULT_PRIORITY
    return (priority, digest in protected, entry.last_used)


def _checksum(*parts) -> bytes:
    crc = 0
    for part in parts:
        crc = isal_zlib.crc32(part, crc)
    return _CHECKSUM.pack(crc)


def _write_file(path: Path, parts, size: int) -> None:
    """One writev of header, checksum and payload (no joined copy); a short write is a full disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        written = os.writev(fd, parts)
        if written != size:
            raise OSError(errno.ENOSPC, f"short write ({written} of {size} bytes)")
    finally:
        os.close(fd)


def _read_retention(path: Path) -> Retention:
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        magic, _v, priority, expires_at, *_ = _HEADER.unpack(head)
    except (OSError, struct.error):
        return Retention()
    return Retention(priority, expires_at) if magic == MAGIC and 1 <= priority <= 100 else Retention()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def check_tier_options(root: str | Path, max_bytes: int, block_bytes: int) -> None:
    """Refuse, naming the option, a directory that is missing or not writable and a cap below one block."""
    path = Path(root)
    if not path.is_dir():
        raise TierConfigError(f"kv_offload_dir {str(root)!r} is not an existing directory")
    probe = path / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:  # os.access says yes to root on a read-only mount: try a write
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TierConfigError(f"kv_offload_dir {str(root)!r} is not writable ({exc.strerror})") from None
    if max_bytes < HEADER_BYTES + block_bytes:
        raise TierConfigError(
            f"kv_offload_max_bytes {max_bytes} is smaller than one KV block ({HEADER_BYTES + block_bytes} bytes)"
        )
