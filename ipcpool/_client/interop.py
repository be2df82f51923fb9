"""Named objects as torch tensors, CuPy arrays and numpy arrays, zero-copy.

The libraries are imported only when used (``ipcpool.optional``): ipcpool depends on none of them. An
object's bytes are viewed as its metadata's dtype and shape; the lease stays with the client until
``Client.release_all(name)`` or close, however long the tensor lives.

A lease is used through its public face (``name``, ``meta``, ``free``, DLPack and the array
interfaces) and its memory through the memory protocol (``backend.base.ImportedMemory``): the
lease table passes both.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from ..backend.base import ImportedMemory
from ..errors import InvalidRequest, MissingDependency
from ..meta import dtype_name
from ..optional import require
from .rangetensors import RangeTensors

log = logging.getLogger(__name__)

# Per-object work of a thousand-object attach, done once: torch dtypes by name, strides by shape,
# the array modules, their dtypes by name.
_TORCH_DTYPES: dict[str, Any] = {}
_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}
_MODULES: dict[str, Any] = {}
_XP_DTYPES: dict[tuple[str, str], Any] = {}
_UNIT = (1,)


def _module(kind: str) -> Any:
    """``require(kind)``, looked up once."""
    module = _MODULES.get(kind)
    if module is None:
        module = _MODULES[kind] = require(kind)
    return module


def _xp_dtype(xp: Any, kind: str, dtype: str, name: str = "") -> Any:
    found = _XP_DTYPES.get((kind, dtype))
    if found is None:
        try:
            found = xp.dtype(dtype)   # (an unknown name raises here, and is not kept)
        except TypeError:
            found = _ml_dtype(kind, dtype, name)
        if len(_XP_DTYPES) < 256:
            _XP_DTYPES[(kind, dtype)] = found
    return found


def _ml_dtype(kind: str, dtype: str, name: str) -> Any:
    """A dtype numpy does not have (bfloat16, float8_*: torch's names): ml_dtypes' where it is
    installed (numpy arrays of it work), else an error saying what to use."""
    what = f"object {name!r}: " if name else ""
    if kind == "numpy":
        try:
            import ml_dtypes
        except ModuleNotFoundError:
            ml_dtypes = None
        found = getattr(ml_dtypes, dtype, None) if ml_dtypes is not None else None
        if found is not None:
            return _module("numpy").dtype(found)
        if ml_dtypes is None:
            raise MissingDependency(
                f"{what}numpy has no dtype {dtype!r}: pip install ml_dtypes (numpy then reads it), or read "
                "it as a torch tensor with get_tensor(), or as raw bytes with Client.get()") from None
    raise MissingDependency(
        f"{what}{'CuPy' if kind == 'cupy' else 'numpy'} has no dtype {dtype!r}: read it as a torch tensor "
        "with get_tensor() (pip install 'ipcpool[torch]'), or as raw bytes with Client.get()") from None


def _kind(obj: Any) -> str:
    module = type(obj).__module__.split(".")[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    raise TypeError(f"put_tensor takes a torch tensor, a CuPy or a numpy array, not {type(obj).__name__}")


def _contiguous_bytes(obj: Any, kind: str) -> tuple[Any, int]:
    """A flat uint8 view of a C-contiguous copy (no copy where it already is) and its size."""
    if kind == "torch":
        flat = obj.detach().contiguous().reshape(-1).view(__import__("torch").uint8)
    else:
        xp = __import__(kind)
        flat = xp.ascontiguousarray(obj).reshape(-1).view(xp.uint8)
    return flat, int(flat.numel() if kind == "torch" else flat.size)


def put(client: Any, name: str, obj: Any, *, on_gpu: bool, pool: str, stream: Any, user: dict | None) -> None:
    """Store ``obj`` as a new sealed object through ``client``'s public API (``create``,
    ``backend``); ``on_gpu``: where the client's memory lives."""
    kind = _kind(obj)
    obj_on_gpu = kind == "cupy" or (kind == "torch" and obj.is_cuda)
    if obj_on_gpu != on_gpu:
        where = "GPU" if obj_on_gpu else "host"
        raise InvalidRequest(f"a {where} {kind} object cannot go into a {client.backend}-backend broker")
    flat, nbytes = _contiguous_bytes(obj, kind)
    meta = {"dtype": dtype_name(obj.dtype), "shape": list(obj.shape)}
    if user:
        meta["user"] = user
    buf = client.create(name, max(nbytes, 1), pool=pool, meta=meta, stream=stream)
    try:
        if not obj_on_gpu:
            if nbytes:
                buf.view[:nbytes] = memoryview(flat.numpy() if kind == "torch" else flat).cast("B")
            buf.seal()
            return
        if kind == "torch":
            torch = _module("torch")

            torch_stream = _torch_stream(stream, obj.device)
            with torch.cuda.stream(torch_stream):   # (cuda.core exports bytes as int8: view them)
                torch.from_dlpack(buf).view(torch.uint8)[:nbytes].copy_(flat, non_blocking=True)
            buf.seal(stream=torch_stream)
        else:
            cupy = require("cupy")

            cupy_stream = stream if stream is not None else cupy.cuda.get_current_stream()
            with cupy_stream:
                cupy.asarray(buf)[:nbytes] = flat
            buf.seal(stream=cupy_stream)
    except BaseException:
        buf.free()   # (never sealed: that aborts the object, and its name is free again)
        raise


def _torch_stream(stream: Any, device: Any) -> Any:
    torch = _module("torch")

    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    raise TypeError("put_tensor/get_tensor take a torch.cuda.Stream (or None) as stream")


def _torch_dtype(name: str, dtype: str) -> Any:
    torch_dtype = _TORCH_DTYPES.get(dtype)
    if torch_dtype is None:
        torch = _module("torch")

        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise InvalidRequest(f"object {name!r}: torch has no dtype {dtype!r}")
        _TORCH_DTYPES[dtype] = torch_dtype
    return torch_dtype


class Views:
    """One client's tensors and arrays over its leases. On CUDA a slab range is a strided view
    of one tensor over the whole slab, made once per slab and dtype and kept here until close."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu   # memory on a GPU: torch tensors are made by DLPack
        self._bases: dict = {}
        self._ranges = RangeTensors()
        self.asked = False     # a tensor was asked for: the hand-off makes the next ones ahead

    def clear(self) -> None:
        """Drop the slab tensors (before the pools they view are closed)."""
        self._bases.clear()
        self._ranges.clear()

    def tensor(self, buf: Any, memory: ImportedMemory) -> Any:
        """A buffer as a torch tensor of its metadata's dtype and shape (else its bytes, uint8)."""
        self.asked = True
        meta = buf.meta
        if not meta and self.on_gpu:   # bytes of a slab range (a carved hand-off): one view
            base = memory.slab()
            raw = self._bases.get(id(base[0])) if base is not None else None
            if raw is not None:   # (as_strided: 3.4 µs on an H100 host warm, narrow or a slice 4.5)
                size, offset = memory.size, base[1]
                key = (id(raw), offset, size)
                made = self._ranges.get(key, memory.ptr, (size,), _UNIT, raw.dtype)
                return made if made is not None else self._ranges.keep(key, raw.as_strided((size,), _UNIT, offset))
        torch = _module("torch")

        dtype, shape = meta.get("dtype"), meta.get("shape")
        if dtype is None or shape is None:
            return self._torch_typed(buf, memory, torch.uint8, [buf.size])
        return self._torch_typed(buf, memory, _torch_dtype(buf.name, dtype), shape)

    def ahead(self, buf: Any, memory: ImportedMemory) -> Any:
        """``tensor``, or None where it fails (asked for later, it raises then)."""
        try:
            return self.tensor(buf, memory)
        except Exception as exc:   # (a dtype torch lacks, say: the caller's own call says so)
            log.debug("no tensor made ahead for %r: %s", buf.name, exc)
            return None

    def typed(self, lease: Any, memory: ImportedMemory, kind: str) -> Any:
        """A lease's bytes as its metadata's dtype and shape, as a ``kind`` ("torch", "cupy",
        "numpy") object (the lease is freed if that fails)."""
        name = lease.name
        dtype, shape = lease.meta.get("dtype"), lease.meta.get("shape")
        if dtype is None or shape is None:
            lease.free()
            raise InvalidRequest(f"object {name!r} has no dtype/shape metadata; use Client.get() for raw bytes")
        count = math.prod(shape)
        if kind == "torch":
            try:
                return self._torch_typed(lease, memory, _torch_dtype(name, dtype), shape)
            except BaseException:
                lease.free()
                raise
        try:
            xp = _module(kind)
            np_dtype = _xp_dtype(xp, kind, dtype, name)
        except BaseException:
            lease.free()
            raise
        if kind == "numpy" and not lease.freed:
            fast = self._host_array(lease, memory, xp, np_dtype, shape, count)
            if fast is not None:
                return fast
        arr = xp.asarray(lease)
        return arr[: count * np_dtype.itemsize].view(np_dtype).reshape(shape)

    def typed_many(self, leases: list[Any], memories: list[ImportedMemory], kind: str) -> dict[str, Any]:
        """``typed`` of each lease, by name. Host numpy arrays and torch tensors over slab ranges
        are made in one loop (``_host_array``, ``_torch_many``); anything else, or what that does
        not apply to, goes through ``typed``."""
        typed = self.typed
        if kind == "torch":
            return self._torch_many(leases, memories)
        if kind != "numpy":
            return {lease.name: typed(lease, memory, kind) for lease, memory in zip(leases, memories)}
        np, prod, dtypes, bases = _module(kind), math.prod, {}, self._bases
        out: dict[str, Any] = {}
        for lease, memory in zip(leases, memories):
            meta = lease.meta
            dtype, shape = meta.get("dtype"), meta.get("shape")
            base = memory.slab()
            if dtype is None or shape is None or base is None or lease.freed:
                out[lease.name] = typed(lease, memory, kind)
                continue
            np_dtype = dtypes.get(dtype)
            if np_dtype is None:
                np_dtype = dtypes[dtype] = _xp_dtype(np, kind, dtype, lease.name)
            slab, offset = base
            whole = bases.get((id(slab), np_dtype, lease.readonly))
            count, itemsize = prod(shape), np_dtype.itemsize
            if whole is None or offset % itemsize or count * itemsize > memory.size:
                out[lease.name] = typed(lease, memory, kind)   # (makes ``whole`` where it applies)
                continue
            start = offset // itemsize
            out[lease.name] = whole[start : start + count].reshape(shape)
        return out

    def _torch_many(self, leases: list[Any], memories: list[ImportedMemory]) -> dict[str, Any]:
        """Torch tensors by name, slab ranges made here in one loop (a strided view each, see
        ``_slab_tensor``); a dtype not seen yet, or what that does not apply to, goes through
        ``typed`` (which checks and reports what is wrong)."""
        typed, slab_tensor, prod, dtypes = self.typed, self._slab_tensor, math.prod, _TORCH_DTYPES
        out: dict[str, Any] = {}
        for lease, memory in zip(leases, memories):
            meta = lease.meta
            dtype, shape = meta.get("dtype"), meta.get("shape")
            # (metadata is the user's: a dtype that is no name goes to typed, which frees and reports)
            torch_dtype = dtypes.get(dtype) if isinstance(dtype, str) and shape is not None else None
            fast = None
            if torch_dtype is not None:
                fast = slab_tensor(memory, torch_dtype, shape, prod(shape) * torch_dtype.itemsize)
            out[lease.name] = fast if fast is not None else typed(lease, memory, "torch")
        return out

    def _host_array(self, lease: Any, memory: ImportedMemory, np: Any, dtype: Any, shape: list[int], count: int) -> Any:
        """Host memory as a numpy array: a slice of one array over the pool's whole mapping (made
        once per pool, dtype and writability), as ``numpy.asarray(lease)`` would give it but
        without building an array interface per object. None where that does not apply."""
        base = memory.slab()
        itemsize = dtype.itemsize
        if base is None or base[0].view is None or base[1] % itemsize or count * itemsize > memory.size:
            return None
        whole_memory, offset = base
        readonly = lease.readonly
        bases = self._bases
        key = (id(whole_memory), dtype, readonly)
        whole = bases.get(key)
        if whole is None:
            raw = np.frombuffer(whole_memory.view, dtype=np.uint8)
            if readonly:
                raw.flags.writeable = False
            whole = bases[key] = raw[: raw.size // itemsize * itemsize].view(dtype)
        start = offset // itemsize
        return whole[start : start + count].reshape(shape)

    def _torch_typed(self, lease: Any, memory: ImportedMemory, dtype: Any, shape: list[int]) -> Any:
        nbytes = math.prod(shape) * dtype.itemsize
        fast = self._slab_tensor(memory, dtype, shape, nbytes, again=True)
        if fast is not None:
            return fast
        return self._torch_bytes(lease)[:nbytes].view(dtype).reshape(shape)

    def _torch_bytes(self, lease: Any) -> Any:
        """A flat uint8 tensor over a lease."""
        torch = _module("torch")

        if self.on_gpu:
            return torch.from_dlpack(lease).view(torch.uint8)
        import numpy

        with warnings.catch_warnings():   # a lease is read-only by contract, not by page bits
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(numpy.asarray(lease).view(numpy.uint8))

    def _slab_tensor(self, memory: ImportedMemory, dtype: Any, shape: list[int], nbytes: int,
                     again: bool = False) -> Any:
        """A CUDA slab range as one strided view of a tensor over its whole slab (made once per
        slab and dtype): one call per object instead of an import, slices and reshapes. None
        where that does not apply (not a slab range, or an offset the dtype does not divide).
        ``again``: the range's last tensor where it may be handed out again (``RangeTensors``:
        one object's tensor; a batch's objects lie each in a range of its own)."""
        base = memory.slab() if self.on_gpu else None   # (host memory: numpy's, _torch_bytes)
        itemsize = dtype.itemsize
        if base is None or base[1] % itemsize or nbytes > memory.size:
            return None
        torch = _module("torch")

        bases = self._bases
        slab, offset = base
        whole = bases.get((id(slab), dtype))
        if whole is None:
            raw = bases.get(id(slab))
            if raw is None:
                raw = bases[id(slab)] = torch.from_dlpack(slab.dlpack()).view(torch.uint8)
            whole = bases[(id(slab), dtype)] = raw[: raw.numel() // itemsize * itemsize].view(dtype)
        key = tuple(shape)
        strides = _STRIDES.get(key)
        if strides is None:
            strides, step = [], 1
            for dim in reversed(key):   # C-contiguous
                strides.append(step)
                step *= dim
            if len(_STRIDES) > 4096:   # bounded: a worker sees a few hundred shapes at most
                _STRIDES.clear()
            strides = _STRIDES[key] = tuple(strides[::-1])
        if not again:
            return whole.as_strided(key, strides, offset // itemsize)
        at = (id(whole), offset, key)
        made = self._ranges.get(at, memory.ptr, key, strides, dtype)
        return made if made is not None else self._ranges.keep(at, whole.as_strided(key, strides, offset // itemsize))
