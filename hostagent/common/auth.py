"""Per-namespace keyed authentication of KV blocks, end to end: the writer seals a block with a
key its namespace's writers and readers share, the pool node and the switch store and serve the
sealed bytes as they are (they never hold the key), and the reader checks the tag over the
bytes it reassembled before it hands out a single byte. docs/auth.md has the threat model.

A sealed block is ``header || zeros up to the next chunk boundary || data``. The 48-byte header:

    0  magic  b"KVA1"           4  algorithm (1: AES-256-GMAC), 3 bytes zero
    8  data offset (u32 BE)     12 data length (u64 BE)     20 nonce (12 random bytes)
    32 tag (16 bytes)

tag = GMAC_K(nonce; CONTEXT || header[0:32] || ns (u32 BE) || block key (16) || data): AES-GCM
with the whole message as associated data and no plaintext, i.e. GHASH, which OpenSSL runs
with carry-less multiplication at ~2 GB/s. The nonce is drawn at random per seal (96 bits, so
the 2^32 seals per key that NIST allows for random nonces stay far from a collision); GMAC
never sees a nonce twice with different data, whatever the writers do (two writers storing
different bytes under one content-addressed key is what made a nonce derived from the key
unsafe). K is the namespace's key: given per namespace in the key file, or derived from a
master key as HMAC-SHA256(master, "kvswitch ns key" || ns).

The header fills the block's first chunk(s) so the data starts on a chunk boundary: the fetch
engine's zero-copy Block stays aligned, a reader knows the block's chunk count from its data's
(``sealed_chunks``: one more chunk at any chunk size of 48 bytes or more), and the header comes
with the first chunk, so the reader checks the tag as the verified prefix grows
(``StreamCheck``), overlapped with the fetch, not after it.

Configuration: ``load_keyring(path)`` reads a key file (lines ``<ns> <64 hex digits>``, ``*
<64 hex>`` or a lone ``<64 hex>``: the master key for every namespace without its own;
``#`` comments); ``configure(...)`` sets the process's keyring (connectors call it with their
config's key file); without that, ``$KVSWITCH_AUTH_KEY_FILE`` names the key file. Clients take
``auth=DEFAULT`` (that keyring), a ``Keyring`` or ``None`` (off). A namespace the keyring has
a key for is sealed on PUT and checked on GET; other namespaces are not touched, so a connector
refuses at start a key file without a key for its namespace (``keyring_for``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

MAGIC = b"KVA1"
ALG_GMAC = 1
HEADER_LEN = 48
TAG_OFF, TAG_LEN, NONCE_LEN = 32, 16, 12
KEY_LEN = 32
CONTEXT = b"kvswitch block auth v1\0"
ENV = "KVSWITCH_AUTH_KEY_FILE"
_HDR = struct.Struct(">4sB3xIQ12s16s")
assert _HDR.size == HEADER_LEN


class AuthError(ValueError):
    """A block failed its keyed authentication (forged, damaged past its CRC, unsealed, or
    sealed with another key)."""


def refused(ns: int, key: bytes, why: AuthError) -> AuthError:
    """The error a reader fails with once the block failed its check past the switch too."""
    return AuthError(f"block {key.hex()} in namespace {ns} failed authentication ({why}), also "
                     "when fetched past the switch's cache: not handed out")


class KeyFileError(ValueError):
    """The key file cannot be used; the message says why."""


class Keyring:
    """Keys by namespace, and an optional master key for the namespaces without their own."""

    def __init__(self, keys: Mapping[int, bytes] | None = None, master: bytes | None = None):
        self.keys = dict(keys or {})
        for k in [*self.keys.values(), *([master] if master is not None else [])]:
            if len(k) != KEY_LEN:
                raise KeyFileError(f"a key is {KEY_LEN} bytes ({2 * KEY_LEN} hex digits)")
        self.master = master

    def covers(self, ns: int) -> bool:
        return ns in self.keys or self.master is not None

    def key_for(self, ns: int) -> bytes | None:
        """The namespace's key, None when it has none (its blocks are not authenticated)."""
        if ns in self.keys:
            return self.keys[ns]
        if self.master is None:
            return None
        return hmac.new(self.master, b"kvswitch ns key" + ns.to_bytes(4, "big"),
                        hashlib.sha256).digest()


def parse_keys(text: str, where: str = "key file") -> Keyring:
    """A keyring from key-file text (the format in the module doc)."""
    keys, master = {}, None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise KeyFileError(f"{where} line {n}: expected '<ns> <hex key>' or '<hex key>'")
        ns_text, hexkey = ("*", parts[0]) if len(parts) == 1 else parts
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            key = b""
        if len(key) != KEY_LEN:
            raise KeyFileError(f"{where} line {n}: a key is {2 * KEY_LEN} hex digits")
        if ns_text == "*":
            master = key
        elif ns_text.isdigit() and int(ns_text) <= 0xFFFFFFFF:
            keys[int(ns_text)] = key
        else:
            raise KeyFileError(f"{where} line {n}: namespace {ns_text!r} is not 0..4294967295 "
                               "or '*'")
    if not keys and master is None:
        raise KeyFileError(f"{where}: no key in it")
    return Keyring(keys, master)


def load_keyring(path: str | os.PathLike) -> Keyring:
    """The keyring in a key file; refuses one that others may read or write."""
    try:
        st = os.stat(path)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise KeyFileError(f"key file {os.fspath(path)}: readable or writable by others "
                               "(chmod 600 it)")
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError as exc:
        raise KeyFileError(f"key file {os.fspath(path)}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"key file {os.fspath(path)}: not text") from None
    return parse_keys(text, f"key file {os.fspath(path)}")


# ---- the process's keyring -----------------------------------------------------------------------
DEFAULT = object()          # clients' auth= default: the process's keyring
_configured: list = []      # [Keyring | None, where it came from] once configure() or current()


def configure(key_file: str | os.PathLike | None = None,
              keyring: Keyring | None = None) -> Keyring | None:
    """Set the keyring every client of this process uses by default (connectors call this with
    their config's key file); ``configure()`` with neither turns authentication off."""
    ring = load_keyring(key_file) if key_file is not None else keyring
    where = (f"key file {os.fspath(key_file)}" if key_file is not None else
             "the keyring given to hostagent.common.auth.configure")
    _configured[:] = [ring, where]
    return ring


def current() -> Keyring | None:
    """The process's keyring: the configured one, else the one in $KVSWITCH_AUTH_KEY_FILE
    (KeyFileError, naming the variable, when that file cannot be used)."""
    if not _configured:
        path = os.environ.get(ENV)
        try:
            ring = load_keyring(path) if path else None
        except KeyFileError as exc:
            raise KeyFileError(f"${ENV}: {exc}") from None
        _configured[:] = [ring, f"${ENV}: key file {path}"]
    return _configured[0]


def keyring_for(ns: int, key_file: str | os.PathLike | None = None) -> Keyring | None:
    """The keyring a connector of namespace ``ns`` uses, checked when it starts: its key
    file's, else the process's (``current()``); None where no key file is configured at all
    (its blocks are not authenticated). The rule every connector applies: a key file it uses
    must load and must have a key for ``ns`` (a line of its own or a master key), else
    KeyFileError, one line naming the file and ``ns``: a key file that lacks the namespace would
    leave its blocks neither sealed nor checked, without a word."""
    if key_file is not None:
        ring, where = load_keyring(key_file), f"key file {os.fspath(key_file)}"
    else:
        ring, where = current(), _configured[1]
    if ring is not None and not ring.covers(ns):
        raise KeyFileError(f"{where} has no key for namespace {ns} (no '{ns} <hex key>' line "
                           "and no master key): its blocks would be neither sealed nor checked")
    return ring


def resolve(auth) -> Keyring | None:
    """A client's ``auth`` argument as a keyring (DEFAULT: ``current()``)."""
    return current() if auth is DEFAULT else auth


# ---- sealing and checking ------------------------------------------------------------------------
def data_offset(chunk_size: int) -> int:
    """Where the data of a sealed block starts: the first chunk boundary past the header."""
    return -(-HEADER_LEN // chunk_size) * chunk_size


def header_chunks(chunk_size: int) -> int:
    return data_offset(chunk_size) // chunk_size


def sealed_chunks(data_chunks: int, chunk_size: int) -> int:
    """Chunks of a sealed block whose data is ``data_chunks`` chunks."""
    return data_chunks + header_chunks(chunk_size)


def _prefix(header: bytes, ns: int, key: bytes) -> bytes:
    return CONTEXT + header[:TAG_OFF] + ns.to_bytes(4, "big") + key


def seal(k: bytes, ns: int, key: bytes, data, chunk_size: int) -> bytes:
    """The sealed block (header, zeros to the chunk boundary, data) for ``data``."""
    n = memoryview(data).nbytes
    if not n:
        raise ValueError("a block must not be empty")
    off = data_offset(chunk_size)
    head = _HDR.pack(MAGIC, ALG_GMAC, off, n, os.urandom(NONCE_LEN), bytes(TAG_LEN))
    enc = Cipher(algorithms.AES(k), modes.GCM(head[20:TAG_OFF])).encryptor()
    enc.authenticate_additional_data(_prefix(head, ns, key))
    enc.authenticate_additional_data(data)
    enc.finalize()
    return b"".join((head[:TAG_OFF], enc.tag, bytes(off - HEADER_LEN), data))


class StreamCheck:
    """The reader's check of one sealed block, fed in order as its bytes become final:
    ``start(header, stored_chunks)``, ``feed(bytes)`` up to ``data_len``, ``finish()``. Every
    failure raises AuthError."""

    def __init__(self, k: bytes, ns: int, key: bytes, chunk_size: int):
        self.k, self.ns, self.key, self.cs = k, ns, key, chunk_size
        self.data_off = data_offset(chunk_size)
        self.data_len = self.fed = 0
        self._dec = None

    @property
    def started(self) -> bool:
        return self._dec is not None

    def start(self, header, stored_chunks: int | None = None, stored_len: int | None = None):
        """Parse the header (the block's first bytes); the block's size must be the one it says."""
        head = bytes(header[:HEADER_LEN])
        if len(head) < HEADER_LEN or head[:4] != MAGIC:
            raise AuthError("not a sealed block (no authentication header)")
        _, alg, off, n, nonce, tag = _HDR.unpack(head)
        if alg != ALG_GMAC:
            raise AuthError(f"unknown authentication algorithm {alg}")
        if off != self.data_off or n < 1:
            raise AuthError(f"header says data at {off} ({n} bytes), not at {self.data_off} "
                            f"for {self.cs}-byte chunks")
        if stored_chunks is not None and stored_chunks != -(-(off + n) // self.cs):
            raise AuthError(f"header says {n} bytes of data, the block has {stored_chunks} "
                            "chunks")
        if stored_len is not None and stored_len != off + n:
            raise AuthError(f"header says {off + n} bytes, the block has {stored_len}")
        self.data_len = n
        self._dec = Cipher(algorithms.AES(self.k), modes.GCM(nonce, tag)).decryptor()
        self._dec.authenticate_additional_data(_prefix(head, self.ns, self.key))

    def feed(self, data) -> None:
        self._dec.authenticate_additional_data(data)
        self.fed += memoryview(data).nbytes

    def finish(self) -> None:
        if self._dec is None or self.fed != self.data_len:
            raise AuthError("block incomplete at the tag check")
        dec, self._dec = self._dec, None
        try:
            dec.finalize()
        except InvalidTag:
            raise AuthError("tag mismatch: the block is not what a holder of the namespace's "
                            "key wrote") from None


def open_sealed(k: bytes, ns: int, key: bytes, blob, chunk_size: int) -> memoryview:
    """The data of a whole sealed block (a view of ``blob``), or AuthError."""
    mv = memoryview(blob).cast("B")
    check = StreamCheck(k, ns, key, chunk_size)
    check.start(mv, stored_len=mv.nbytes)
    data = mv[check.data_off:]
    check.feed(data)
    check.finish()
    return data
