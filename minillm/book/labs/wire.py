"""The grader's wire: the values a check sends to the learner's process and those that come back.

A message is a JSON header and raw byte blobs (a tensor's bytes), framed by lengths. Nothing is
unpickled: the grading process reads JSON, bytes of a tensor of a known dtype, numbers, and instances of
the lab classes registered here (``register_class``). Any other value comes back as an ``Opaque`` that
only describes it ("a numpy.ndarray"), so a check reports it as a value of the wrong kind.

Objects keep their identity across a call: each list, dict, tensor, random generator (its state) or lab
object the grader sends gets an id, and when the learner's code returns it, or changes it in place, the
reply names that id with its new state. The grader then updates its own object in place (a cache tensor
written by ``write_kv``, a list of sequences that ``admit`` returns, a generator that drew numbers), exactly
as if the function had run in the grader's process.
Expensive shared objects (a model) travel by name: both processes build them the same way
(``shared``).
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import json
import math
import numbers
import socket
import struct
import time
from collections.abc import Callable

import numpy
import torch

MAX_BYTES = 512 * 2**20  # the largest message either side accepts
_HEAD = struct.Struct("!QI")  # header bytes, number of blobs
_BLOB = struct.Struct("!Q")


class WireError(Exception):
    """A message that breaks the protocol (too large, malformed, of an unknown kind)."""


class Opaque:
    """A value the wire does not carry: its description and a short repr, for the check's messages."""

    def __init__(self, described_as: str, text: str):
        self.described_as, self._text = described_as, text

    def __repr__(self) -> str:
        return self._text


# --- framing ----------------------------------------------------------------------------------------------

def send(sock: socket.socket, header: dict, blobs: list[bytes] = ()) -> None:
    """Write one message: the JSON header, then each blob, with their lengths."""
    text = json.dumps(header, allow_nan=True).encode()
    parts = [_HEAD.pack(len(text), len(blobs)), text]
    for blob in blobs:
        parts += [_BLOB.pack(len(blob)), blob]
    sock.sendall(b"".join(parts))


def _read(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
        else:
            sock.settimeout(None)
        chunk = sock.recv(min(left, 1 << 20))  # TimeoutError past the deadline
        if not chunk:
            raise EOFError("the other process closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket, deadline: float | None = None) -> tuple[dict, list[bytes]]:
    """Read one message; TimeoutError past ``deadline`` (time.monotonic()), EOFError when the channel
    closes, WireError when the message breaks the protocol."""
    size, count = _HEAD.unpack(_read(sock, _HEAD.size, deadline))
    if size > MAX_BYTES or count > 1_000_000:
        raise WireError(f"a message of {size:,} bytes and {count:,} blobs (the limit is {MAX_BYTES:,} bytes)")
    try:
        header = json.loads(_read(sock, size, deadline))
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"a header that is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("a header that is not a JSON object")
    blobs, total = [], size
    for _ in range(count):
        (n,) = _BLOB.unpack(_read(sock, _BLOB.size, deadline))
        total += n
        if total > MAX_BYTES:
            raise WireError(f"a message over {MAX_BYTES:,} bytes")
        blobs.append(_read(sock, n, deadline))
    return header, blobs


# --- what travels ---------------------------------------------------------------------------------------

_CLASSES: dict[str, type] = {}  # "minillm.book.labs.batching.Seq" -> Seq
_SHARED: dict[str, Callable] = {}  # name -> the factory both processes call
_SHARED_IDS: dict[int, tuple[str, object]] = {}  # id(object) -> (name, object), for objects made here
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_NUMPY_SCALARS = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                  "uint32", "uint64", "bool"}
_EXCEPTIONS = {name for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, BaseException)}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_class(cls: type) -> type:
    """Let instances of a dataclass travel (by their fields) and come back as instances of it."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    _CLASSES[class_name(cls)] = cls
    return cls


def shared(name: str) -> Callable[[Callable], Callable]:
    """Decorate a zero-argument factory that builds one object, once (``functools.lru_cache``): that
    object travels by ``name``, and the other process calls its own factory (a model both processes
    build the same way, instead of its tensors)."""
    def register(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def made():
            value = factory()
            _SHARED_IDS[id(value)] = (name, value)
            return value
        _SHARED[name] = made
        return made
    return register


def exception_name(exc: BaseException) -> str:
    """The name of the nearest built-in exception class of ``exc`` (a learner's own class: its base)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _EXCEPTIONS and getattr(builtins, cls.__name__) is cls:
            return cls.__name__
    return "Exception"


def exception_of(name: str) -> BaseException:
    """An instance of the built-in exception class ``name`` (Exception for anything else)."""
    cls = getattr(builtins, name, None) if name in _EXCEPTIONS else None
    try:
        return cls() if cls is not None else Exception()
    except TypeError:  # a class that needs arguments (UnicodeDecodeError...)
        return Exception()


class Encoder:
    """Turns values into JSON and blobs. ``theirs`` maps id(object) -> the id the other process gave it
    (objects that came from there): they are sent with that id, so the other side updates its own."""

    def __init__(self, describe: Callable[[object], str], theirs: dict[int, int] | None = None):
        self.describe, self.theirs = describe, theirs or {}
        self.blobs: list[bytes] = []
        self._memo: dict[int, int] = {}  # id(object) -> its id in this message
        self.objects: list = []  # the objects given an id, in order (so that their ids stay unique)

    def encode(self, value):
        if value is None or isinstance(value, (bool, str)):
            return value
        if type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"float": repr(value)}
        if isinstance(value, numpy.generic) and value.dtype.name in _NUMPY_SCALARS:
            return {"numpy": value.dtype.name, "value": value.item()}
        if id(value) in _SHARED_IDS and _SHARED_IDS[id(value)][1] is value:
            return {"shared": _SHARED_IDS[id(value)][0]}
        if isinstance(value, tuple):
            return {"tuple": [self.encode(v) for v in value]}
        if id(value) in self._memo:
            return {"ref": self._memo[id(value)]}
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, torch.Generator) and value.device.type == "cpu":  # its state travels, both ways
            out = self._start(value, "generator")
            self.blobs.append(value.get_state().numpy().tobytes())
            out["generator"] = len(self.blobs) - 1
            return out
        if type(value) is list:
            out = self._start(value, "list")
            out["list"] = [self.encode(v) for v in value]
            return out
        if type(value) is dict:
            out = self._start(value, "dict")
            out["dict"] = [[self.encode(k), self.encode(v)] for k, v in value.items()]
            return out
        if class_name(type(value)) in _CLASSES:
            out = self._start(value, "object")
            out["object"] = class_name(type(value))
            out["fields"] = {f.name: self.encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return out
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return {"opaque": self.describe(value), "repr": repr(value)[:200], "int": int(value)}
        return {"opaque": self.describe(value), "repr": _short_repr(value)}

    def _start(self, value, kind: str) -> dict:
        local = len(self.objects)
        self._memo[id(value)] = local
        self.objects.append(value)
        out = {"id": local, "kind": kind}
        if id(value) in self.theirs:
            out["theirs"] = self.theirs[id(value)]
        return out

    def _tensor(self, value: torch.Tensor) -> dict:
        if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
            return {"opaque": self.describe(value), "repr": f"a {value.layout} tensor"}
        out = self._start(value, "tensor")
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8) if flat.numel() else flat
        self.blobs.append(data.numpy().tobytes() if flat.numel() else b"")
        out.update(tensor=len(self.blobs) - 1, dtype=str(value.dtype).removeprefix("torch."),
                   shape=list(value.shape))
        return out


def _short_repr(value) -> str:
    try:
        text = repr(value)
    except Exception:  # a learner's object whose repr raises
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


class Decoder:
    """Turns JSON and blobs back into values. ``mine`` maps the ids this process gave its objects to the
    objects: an incoming value with ``theirs`` set updates that object in place and decodes to it."""

    def __init__(self, blobs: list[bytes], mine: dict[int, object] | None = None):
        self.blobs, self.mine = blobs, mine or {}
        self.objects: dict[int, object] = {}  # this message's ids -> the decoded objects
        self.received: dict[int, int] = {}  # id(decoded object) -> its id in this message

    def decode(self, data):
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if isinstance(data, list):
            raise WireError("a bare list on the wire")
        if not isinstance(data, dict):
            raise WireError(f"an unknown value {type(data).__name__}")
        if "float" in data:
            return float(data["float"])
        if "numpy" in data:
            if data["numpy"] not in _NUMPY_SCALARS:
                raise WireError(f"an unknown numpy type {data['numpy']!r}")
            return numpy.dtype(data["numpy"]).type(data["value"])
        if "shared" in data:
            if data["shared"] not in _SHARED:
                raise WireError(f"an unknown shared object {data['shared']!r}")
            return _SHARED[data["shared"]]()
        if "tuple" in data:
            return tuple(self.decode(v) for v in data["tuple"])
        if "ref" in data:
            if data["ref"] not in self.objects:
                raise WireError(f"a reference to object {data['ref']} before it")
            return self.objects[data["ref"]]
        if "opaque" in data:
            return Opaque(str(data["opaque"]), str(data.get("repr", "")))
        kind = data.get("kind")
        if kind == "tensor":
            return self._register(data, self._tensor(data))
        if kind == "generator":
            target = self._target(data, torch.Generator)
            target.set_state(torch.frombuffer(bytearray(self.blobs[int(data["generator"])]), dtype=torch.uint8))
            return self._register(data, target)
        if kind == "list":
            target = self._target(data, list)
            self._register(data, target)
            items = [self.decode(v) for v in data["list"]]
            target[:] = items
            return target
        if kind == "dict":
            target = self._target(data, dict)
            self._register(data, target)
            pairs = [(self.decode(k), self.decode(v)) for k, v in data["dict"]]
            target.clear()
            target.update(pairs)
            return target
        if kind == "object":
            cls = _CLASSES.get(data["object"])
            if cls is None:
                raise WireError(f"an unknown class {data['object']!r}")
            target = self._target(data, cls)
            self._register(data, target)
            names = {f.name for f in dataclasses.fields(cls)}
            for name, value in data["fields"].items():
                if name in names:
                    object.__setattr__(target, name, self.decode(value))
            return target
        raise WireError(f"an unknown value {sorted(data)[:3]}")

    def _target(self, data: dict, cls: type):
        """The object this process sent (to update in place) or a new, empty one."""
        theirs = data.get("theirs")
        if theirs is not None:
            target = self.mine.get(theirs)
            if target is None or type(target) is not cls:
                raise WireError(f"a reply naming object {theirs}, which was not sent as a {cls.__name__}")
            return target
        return cls() if cls in (list, dict, torch.Generator) else cls.__new__(cls)

    def _register(self, data: dict, value):
        self.objects[data["id"]] = value
        self.received[id(value)] = data["id"]
        return value

    def _tensor(self, data: dict) -> torch.Tensor:
        dtype = _DTYPES.get(data.get("dtype"))
        if dtype is None:
            raise WireError(f"a tensor of unknown dtype {data.get('dtype')!r}")
        shape = [int(n) for n in data["shape"]]
        raw = self.blobs[int(data["tensor"])]
        count = math.prod(shape)
        if len(raw) != count * dtype.itemsize:
            raise WireError(f"a tensor of shape {shape} in {len(raw)} bytes")
        value = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if count
                 else torch.empty(shape, dtype=dtype))
        theirs = data.get("theirs")
        if theirs is None:
            return value
        target = self.mine.get(theirs)
        if not isinstance(target, torch.Tensor):
            raise WireError(f"a reply naming object {theirs}, which was not sent as a tensor")
        if target.shape == value.shape and target.dtype == value.dtype:
            if not torch.equal(target, value):
                # an inference tensor (made under torch.inference_mode) changes only inside that mode
                with torch.inference_mode() if target.is_inference() else torch.no_grad():
                    target.copy_(value)
            return target
        return value  # resized or retyped in place: the learner's tensor is a new one
