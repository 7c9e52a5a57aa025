"""Read character vectors out of an R lazy-load database without R (pure stdlib).

R packages store their datasets as a lazy-load database: ``Rdata.rdx`` (a gzip-compressed,
serialized index) and ``Rdata.rdb`` (one zlib-compressed, serialized object per variable).
Only the subset of R's XDR serialization format (versions 2 and 3) that plain data vectors
use is implemented; anything else raises ``ValueError`` rather than being guessed at.
"""

from __future__ import annotations

import gzip
import struct
import zlib

# SEXP type codes (R Internals, "Serialization Formats").
_SYMSXP = 1
_LISTSXP = 2
_CHARSXP = 9
_LGLSXP = 10
_INTSXP = 13
_REALSXP = 14
_STRSXP = 16
_VECSXP = 19
_EXPRSXP = 20
_REFSXP = 255
_NILVALUE_SXP = 254
_SINGLETONS = {254, 253, 252, 251, 250, 242, 241}  # NULL, environments, missing markers

_HAS_ATTR = 1 << 9
_HAS_TAG = 1 << 10
_LATIN1 = 1 << 2  # CHARSXP encoding bit, stored in the "levels" field (flags >> 12)

RValue = object  # str | None | int | float | list | dict, as produced by _Reader


class _Reader:
    """Cursor over one serialized R object in XDR (big-endian) form."""

    def __init__(self, data: bytes) -> None:
        if not data.startswith(b"X\n"):
            raise ValueError("not an XDR-serialized R object")
        self._data = data
        self._pos = 2
        self._refs: list[RValue] = []

    def read(self) -> RValue:
        """Parse the header and return the top-level object."""
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader R version
        if version == 3:
            encoding_length = self._int()
            self._pos += encoding_length  # skip the native encoding name
        elif version != 2:
            raise ValueError(f"unsupported serialization version {version}")
        return self._item()

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self._data, self._pos)
        self._pos += 4
        return value

    def _item(self) -> RValue:
        flags = self._int()
        kind = flags & 0xFF
        if kind in _SINGLETONS:
            return None
        if kind == _REFSXP:
            index = flags >> 8 or self._int()
            return self._refs[index - 1]
        if kind == _SYMSXP:
            name = self._item()
            self._refs.append(name)
            return name
        if kind == _LISTSXP:
            return self._pairlist(flags)
        if kind == _CHARSXP:
            length = self._int()
            if length == -1:
                return None  # NA_character_
            raw = self._data[self._pos : self._pos + length]
            self._pos += length
            return raw.decode("latin-1" if (flags >> 12) & _LATIN1 else "utf-8")
        value: list[RValue]
        if kind in (_LGLSXP, _INTSXP):
            length = self._int()
            value = list(struct.unpack_from(f">{length}i", self._data, self._pos))
            self._pos += 4 * length
        elif kind == _REALSXP:
            length = self._int()
            value = list(struct.unpack_from(f">{length}d", self._data, self._pos))
            self._pos += 8 * length
        elif kind in (_STRSXP, _VECSXP, _EXPRSXP):
            value = [self._item() for _ in range(self._int())]
        else:
            raise ValueError(f"unsupported SEXP type {kind}")
        if flags & _HAS_ATTR:
            attributes = self._item()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if kind == _VECSXP and isinstance(names, list) and len(names) == len(value):
                return dict(zip(names, value, strict=True))
        return value

    def _pairlist(self, flags: int) -> dict[RValue, RValue]:
        """Read a (tagged) pairlist, e.g. an attribute list, as an ordered dict."""
        out: dict[RValue, RValue] = {}
        while True:
            if flags & _HAS_ATTR:
                self._item()
            tag = self._item() if flags & _HAS_TAG else None
            out[tag] = self._item()
            flags = self._int()
            if flags & 0xFF == _NILVALUE_SXP:
                return out
            if flags & 0xFF != _LISTSXP:
                raise ValueError("dotted pairlist is not supported")


def read_character_vectors(rdx: bytes, rdb: bytes) -> dict[str, list[str]]:
    """Return every character-vector variable of a lazy-load DB as ``{name: lines}``.

    ``rdx`` and ``rdb`` are the raw bytes of the ``.rdx`` index and ``.rdb`` data files.
    NA entries become empty strings; variables of other types are skipped.
    """
    index = _Reader(gzip.decompress(rdx)).read()
    if not isinstance(index, dict) or index.get("compressed") != [1]:
        raise ValueError("expected a zlib-compressed lazy-load index")
    out: dict[str, list[str]] = {}
    for name, (offset, length) in index["variables"].items():
        # Each record: 4-byte big-endian uncompressed size, then a zlib stream.
        obj = _Reader(zlib.decompress(rdb[offset + 4 : offset + length])).read()
        if isinstance(obj, list) and obj and all(isinstance(x, str | None) for x in obj):
            out[name] = [x or "" for x in obj]
    return out
