"""Values that cross between the notebook and the ranks, and how they cross.

``pack`` turns any object into ``[header, buffer, ...]``: a cloudpickle header plus the
raw bytes of every tensor and array, out of band (pickle protocol 5). ipyparallel sends
top-level bytes and memoryviews without copying, so tensors avoid torch's default
in-band pickling (about 20x slower here). Tensors arrive on the CPU, bfloat16 included.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import struct
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cloudpickle

from .errors import TransferError
from .phrases import COMPACT_FROM, alike, rank_list

SHM_MIN_BYTES = 1 << 20


def _rebuild_tensor(buf, dtype_name: str, shape: tuple, requires_grad: bool, parameter: bool):
    import torch

    dtype = getattr(torch, dtype_name)
    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        if mv.readonly:
            # one copy into memory torch may own and write
            mv = memoryview(bytearray(mv))
        t = torch.frombuffer(mv, dtype=torch.uint8).view(dtype).reshape(shape)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with plain dense tensors sent as raw bytes: out of band, or through
    a shared-memory file when the other side is on this machine (``shm_dir``); memoryviews
    (the frames of a value packed already) out of band."""

    shm_dir: str | None = None
    shm_min_bytes = SHM_MIN_BYTES
    #: True: the one reader deletes each file; False: several readers (a push to many
    #: ranks), and the writer deletes ``shm_files`` once all of them have read
    shm_consume = True
    shm_files: list[str] = []
    #: how a function the notebook defined (its module ``__main__``) is sent: None, by
    #: value with the values of the names it reads (cloudpickle's way), else its reduction
    own_functions: Callable[[Any], tuple] | None = None

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(torch, obj, self.shm_dir, self.shm_min_bytes, self.shm_consume)
            if reduced is not None:
                if reduced[0] is _rebuild_tensor_from_file:
                    self.shm_files.append(reduced[1][0])
                return reduced
        if (
            self.own_functions is not None
            and type(obj) is types.FunctionType
            and (obj.__module__ or "__main__").startswith("__")
        ):
            return self.own_functions(obj)
        if type(obj) is memoryview and obj.format == "B" and obj.ndim == 1:  # (a frame)
            return (memoryview, (pickle.PickleBuffer(obj),))
        return super().reducer_override(obj)


def _reduce_tensor(
    torch, t, shm_dir: str | None = None, shm_min_bytes: int = SHM_MIN_BYTES, consume: bool = True
):
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    if getattr(t, "is_nested", False) or t.is_complex() and t.is_conj():
        return None
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    arr = data.reshape(-1).view(torch.uint8).numpy()
    meta = (
        str(data.dtype).removeprefix("torch."),
        tuple(data.shape),
        bool(t.requires_grad),
        isinstance(t, torch.nn.Parameter),
    )
    if shm_dir is not None and arr.nbytes >= shm_min_bytes:
        path = _write_shm(shm_dir, arr)
        if path is not None:
            return (_rebuild_tensor_from_file, (path, arr.nbytes, *meta, consume))
    return (_rebuild_tensor, (pickle.PickleBuffer(arr), *meta))


def _write_shm(shm_dir: str, *parts, prefix: str = "t-") -> str | None:
    """One copy of ``parts`` (buffers) into a tmpfs file, one after the other; None (use
    the socket) when there is no room."""
    nbytes = frames_size(parts)
    try:
        st = os.statvfs(shm_dir)
        if st.f_bavail * st.f_frsize < 2 * nbytes:  # Docker's /dev/shm is often 64 MB
            return None
        fd, path = tempfile.mkstemp(dir=shm_dir, prefix=prefix)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(memoryview(part))
    except OSError:
        os.unlink(path)
        return None
    return path


#: the first of the two frames that stand for frames written to a file
#: (:func:`frames_to_file`); a packed value's first frame is a pickle's, never this
FRAMES_FILE = b"notebook_dist: frames in a file"


def frames_size(frames) -> int:
    """How many bytes ``frames`` (bytes-like) hold together."""
    return sum(memoryview(f).nbytes for f in frames)


def through_file(frames: list, shm_dir: str | None, files: list[str] | None = None) -> list | None:
    """``frames`` for a process on this machine: as they are under ``SHM_MIN_BYTES``, and
    from that size through one tmpfs file in ``shm_dir`` (:func:`frames_to_file`), its
    path added to ``files`` when the caller removes it once read; None when they are
    that large and there is no shared memory, or no room in it."""
    if frames_size(frames) < SHM_MIN_BYTES:
        return frames
    filed = frames_to_file(shm_dir, frames) if shm_dir else None
    if filed is not None and files is not None:
        files.append(filed[1].decode())
    return filed


def frames_to_file(shm_dir: str, frames: list) -> list | None:
    """``frames`` written to one tmpfs file in ``shm_dir``, for a process on this machine:
    the two frames that name the file (one copy, none through a socket, nothing to seal),
    or None when there is no room."""
    sizes = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<{len(sizes) + 1}Q", len(sizes), *sizes)
    path = _write_shm(shm_dir, head, *frames, prefix="f-")
    return None if path is None else [FRAMES_FILE, path.encode()]


def frames_from(frames: list, consume: bool = True) -> list:
    """The frames :func:`frames_to_file` wrote, read from their file (a private mapping:
    no copy), which is removed when ``consume``; any other frames as they are."""
    if len(frames) != 2 or memoryview(frames[0]) != FRAMES_FILE:
        return frames
    path = bytes(frames[1]).decode()
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    finally:
        if consume:
            with contextlib.suppress(OSError):
                os.unlink(path)
    view = memoryview(mapped)
    (count,) = struct.unpack_from("<Q", view)
    at, out = 8 * (count + 1), []
    for size in struct.unpack_from(f"<{count}Q", view, 8):
        out.append(view[at : at + size])
        at += size
    return out


def _rebuild_tensor_from_file(
    path: str,
    nbytes: int,
    dtype_name: str,
    shape: tuple,
    requires_grad: bool,
    parameter: bool,
    consume: bool = True,
):
    import torch

    try:
        # a private mapping of the file: no copy now, and the pages stay ours once unlinked
        raw = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    finally:
        if consume:
            os.unlink(path)
    t = raw.view(getattr(torch, dtype_name)).reshape(shape)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


def pack(
    obj: Any,
    shm_dir: str | None = None,
    files: list[str] | None = None,
    own_functions: Callable[[Any], tuple] | None = None,
) -> list:
    """Serialise ``obj`` to ``[header, *buffers]`` (buffers are memoryviews, not copies).

    With ``shm_dir`` (a tmpfs folder both sides can read), tensors of 1 MiB and more
    travel as files there instead: one copy, no socket, no relay through the controller.
    """
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    pickler = _Pickler(f, protocol=5, buffer_callback=buffers.append)
    pickler.shm_dir = shm_dir
    pickler.shm_files = files if files is not None else []
    pickler.shm_consume = files is None  # a caller that keeps the list deletes the files
    pickler.own_functions = own_functions
    pickler.dump(obj)
    return [f.getvalue(), *(b.raw() for b in buffers)]


def unpack(frames: list, consume: bool = True) -> Any:
    """Inverse of :func:`pack`, its frames read from their file where they came through
    one (:func:`through_file`; the file removed when ``consume``, its one reader)."""
    header, *buffers = frames_from(frames, consume)
    return pickle.loads(header, buffers=buffers)


#: the start of every cluster's shared-memory folder's name (:func:`shm_dir_for`)
SHM_PREFIX = "notebook_dist-"


def discard(frames: list) -> None:
    """Packed frames nobody will read (the reply to a call given up on): the files in
    shared memory that they came through, or that their tensors did, removed, as reading
    them would have; frames that name no such file cost a search of their header."""
    if memoryview(frames[0]) != FRAMES_FILE and SHM_PREFIX.encode() not in bytes(frames[0]):
        return
    with contextlib.suppress(Exception):  # (what cannot be read here: left to the folder's end)
        unpack(frames)


def describe_unpicklable(obj: Any, exc: BaseException) -> str:
    return f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be pickled ({type(exc).__name__}: {exc})"


def shm_dir_for(cluster_id: str) -> str | None:
    """A private tmpfs folder for one cluster's transfers, or None where there is none."""
    base = "/dev/shm"
    if not os.path.isdir(base) or not os.access(base, os.W_OK):
        return None
    path = os.path.join(base, f"{SHM_PREFIX}{cluster_id}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def pack_named(
    name: str, obj: Any, where: str, shm_dir: str | None = None, files: list[str] | None = None
) -> list:
    """:func:`pack`, with an error naming the variable and where it lives."""
    try:
        return pack(obj, shm_dir, files)
    except Exception as exc:  # pickling raises many types
        raise TransferError(f"{name!r} on {where}: {describe_unpicklable(obj, exc)}") from None


class RankValues(Mapping):
    """A read-only mapping rank -> value, one entry per rank that ran.

    For example::

        In [3]: %%distributed
           ...: dist.get_rank() * 10
        Out[3]: RankValues({0: 0, 1: 10})

        In [4]: _[1]
        Out[4]: 10
    """

    __slots__ = ("_data", "_name")

    def __init__(self, data: Mapping[int, Any], name: str | None = None):
        self._data = dict(sorted(data.items()))
        self._name = name

    def __getitem__(self, rank: int) -> Any:
        try:
            return self._data[rank]
        except KeyError:
            have = ", ".join(map(str, self._data)) or "none"
            raise KeyError(f"no value from rank {rank} (ranks here: {have})") from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def ranks(self) -> list[int]:
        return list(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankValues):
            return self.ranks == other.ranks and all(
                _same(self._data[r], other._data[r]) for r in self._data
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def compare(self, atol: float = 0.0, rtol: float = 0.0):
        """Which entries differ across ranks (tensors, modules, optimizers, containers).

        >>> params.compare().agree
        True
        """
        from .compare import compare_local

        return compare_local(self._data, atol=atol, rtol=rtol)

    def __repr__(self) -> str:
        inner = ", ".join(f"{r}: {_short_repr(v)}" for r, v in self._data.items())
        return f"RankValues({{{inner}}})"

    def _repr_pretty_(self, p, cycle) -> None:
        if cycle:
            p.text("RankValues(...)")
            return
        title = f"RankValues {self._name}" if self._name else "RankValues"
        p.text(f"{title} ({len(self)} {'rank' if len(self) == 1 else 'ranks'})")
        for ranks, text in self._shown():
            lines = text.splitlines() or [""]
            p.break_()
            p.text(f"[{ranks}] {lines[0]}")
            for line in lines[1:]:
                p.break_()
                p.text(" " * (len(f"[{ranks}] ")) + line)

    def _repr_html_(self) -> str:
        import html

        title = html.escape(f"RankValues {self._name}" if self._name else "RankValues")
        rows = "".join(
            f"<tr><td style='text-align:right'><b>{html.escape(ranks.split(' ', 1)[1])}</b></td>"
            f"<td style='text-align:left'><pre style='margin:0'>{html.escape(text)}</pre></td></tr>"
            for ranks, text in self._shown()
        )
        return (
            f"<table class='notebook-dist-rankvalues'><caption style='text-align:left'>{title}</caption>"
            f"<thead><tr><th>rank</th><th style='text-align:left'>value</th></tr></thead><tbody>{rows}</tbody></table>"
        )

    def _shown(self) -> list[tuple[str, str]]:
        """(the ranks, 'rank 3' or 'ranks 0-31'; the value's repr) as the notebook shows
        them: from ``phrases.COMPACT_FROM`` ranks, the ranks whose values read the same share
        one entry, in the order of their first rank (32 copies of 'ok' are one line)."""
        texts = [(r, repr(v)) for r, v in self._data.items()]
        if len(texts) < COMPACT_FROM:
            return [(rank_list([r]), text) for r, text in texts]
        same = alike(texts, key=lambda rt: rt[1])
        return [(rank_list(r for r, _ in rts), text) for text, rts in same.items()]


def _short_repr(v: Any, limit: int = 80) -> str:
    text = repr(v).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return a is b
