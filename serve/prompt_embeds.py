"""vLLM's `prompt_embeds` on the wire: base64 of a `torch.save`d tensor, read without torch.

`torch.save` writes a zip archive: `<name>/data.pkl`, a pickle whose only object is a call of
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])` with the
storage a persistent id ('storage', torch.<Kind>Storage, key, location, numel) naming the entry
`<name>/data/<key>` (raw elements, in `<name>/byteorder`'s order), and `collections.OrderedDict()` for
the hooks. The unpickler here resolves exactly those names to its own functions, which build numpy arrays;
any other global (anything that would run code: `os.system`, a module's class, a sparse or quantized
tensor's rebuild) is refused, so no object of the client's choosing is ever made. Zip entries must be
stored (uncompressed, as torch writes them): sizes are known before a byte is read.

vLLM reads the same bytes with `torch.load(..., weights_only=True)`; then, as there, a leading axis of
size 1 is dropped and the engine checks the rest (2-D, floating-point, the model's hidden size,
`jaxpaged/core/prompt_embeds.py`).
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
import zipfile

import numpy as np

# torch.<Kind>Storage -> numpy dtype ("bfloat16": read as the upper halves of float32)
_STORAGES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
             "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
             "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


class BadTensor(ValueError):
    """The bytes are not a tensor this reader takes; the message says why."""


class _Storage:
    def __init__(self, kind: str):
        self.dtype = kind


class _Tensor:
    """What the pickle's rebuild call makes (never a numpy array itself: the pickle may BUILD on it)."""
    def __init__(self, array: np.ndarray):
        self.array = array


def _ordered_dict(*args):
    if args:
        raise BadTensor("a tensor with backward hooks")
    return {}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, read_storage):
        super().__init__(io.BytesIO(data))
        self.read_storage = read_storage

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return _ordered_dict
        raise BadTensor(f"the pickle names {module}.{name}: only a dense tensor (torch.save of a torch.Tensor) is "
                        "read")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)
                and isinstance(pid[2], str)):
            raise BadTensor("a persistent id that is no tensor storage")
        return self.read_storage(pid[1].dtype, pid[2])


def _rebuild(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """A copy of the tensor's elements: `size` and `stride` (in elements) from `offset` in the storage."""
    if not isinstance(storage, np.ndarray):
        raise BadTensor("the tensor's storage is not a storage")
    ints = (isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(isinstance(v, int) for v in (*size, *stride)))
    if not ints or offset < 0 or min((*size, *stride), default=0) < 0:
        raise BadTensor("the tensor's offset, size or stride is not made of non-negative integers")
    n = int(np.prod(size, dtype=np.int64)) if size else 1
    last = offset + sum((k - 1) * s for k, s in zip(size, stride)) if n else offset - 1
    if last >= storage.size or n > storage.size:
        raise BadTensor(f"size {size} with stride {stride} from {offset} overruns its storage of {storage.size} "
                        "elements")
    if n == 0:
        return _Tensor(np.zeros(size, storage.dtype))
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride],
                                           writeable=False)
    return _Tensor(np.array(view))


def load_tensor(data: bytes) -> np.ndarray:
    """The numpy array of a `torch.save`d dense tensor (bfloat16 as float32); BadTensor if it is not one."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = {i.filename: i for i in archive.infolist()}
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise BadTensor(f"not a torch.save zip archive ({e})") from None
    pkl = [name for name in entries if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pkl) != 1:
        raise BadTensor("not a torch.save zip archive (no single <name>/data.pkl)")
    prefix = pkl[0][:-len("data.pkl")]
    if any(i.compress_type != zipfile.ZIP_STORED for i in entries.values()):
        raise BadTensor("a compressed zip entry (torch.save stores its entries uncompressed)")
    order = archive.read(prefix + "byteorder").decode("ascii", "replace") if prefix + "byteorder" in entries \
        else "little"
    if order not in ("little", "big"):
        raise BadTensor(f"byteorder {order!r}")
    read = set()

    def read_storage(kind: str, key: str) -> np.ndarray:
        name = f"{prefix}data/{key}"
        if name not in entries or key in read:
            raise BadTensor(f"storage {key!r} is missing or used twice")
        read.add(key)
        raw = archive.read(name)
        width = 2 if kind == "bfloat16" else np.dtype(kind).itemsize
        if len(raw) % width:
            raise BadTensor(f"storage {key!r} holds {len(raw)} bytes, not whole {kind} elements")
        if kind == "bfloat16":
            bits = np.frombuffer(raw, ("<" if order == "little" else ">") + "u2").astype(np.uint32) << 16
            return bits.view(np.float32)
        return np.frombuffer(raw, np.dtype(kind).newbyteorder("<" if order == "little" else ">"))

    try:
        tensor = _Unpickler(archive.read(pkl[0]), read_storage).load()
    except BadTensor:
        raise
    except Exception as e:  # noqa: BLE001 -- a malformed pickle raises many kinds; all are the client's bytes
        raise BadTensor(f"its data.pkl is not a tensor's pickle ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(tensor, _Tensor) or not isinstance(getattr(tensor, "array", None), np.ndarray):
        raise BadTensor(f"the archive holds a {type(tensor).__name__}, not a tensor")
    return tensor.array


def decode(text: str) -> np.ndarray:
    """One `prompt_embeds` string -> its tensor as a numpy array; BadTensor naming what is wrong."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadTensor(f"not valid base64 ({e})") from None
    return load_tensor(data)
