"""Count what would stop a GPU worker's host until its device catches up, while the worker's code
runs on CPU tensors: reads of a device tensor's values on the host, operations whose output size
depends on them, and tensors made from Python data (copied to the device on a GPU).

Seen by a `TorchDispatchMode` (every ATen call): `_local_scalar_dense` (`.item()`, `float(t)`,
`int(t)`, `bool(t)`), `equal`, `nonzero`, boolean-mask indexing (`t[mask]`, `masked_select`), `unique`,
and `lift_fresh` (`torch.tensor(python data)`). Not seen by it on CPU tensors, where they do not
reach ATen (or, under `torch.inference_mode`, take a path around it), so counted by wrapping the
Tensor methods: `.tolist()`, `.numpy()` and `.cpu()`, each a copy to the host on a GPU, and
`.item()`, `int()`, `float()`, `bool()`, each a scalar read (what ATen shows of them while a
wrapper runs is not counted again). (`.to(device)` is not counted: on CPU tensors a copy to the host
cannot be told from one to the worker's device; the handlers copy to the host with `.cpu()`.)

What a copy to the host returns is host data: the operations on it, and on what is computed from
it, are the host's own and not counted (a DCT over samples read back in one copy, say). On CPU
tensors `.cpu()` returns the tensor itself; here it returns a copy, so that only the copy is
host data.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

SYNCHRONISING = {
    "aten._local_scalar_dense.default": "scalar read",
    "aten.equal.default": "scalar read",
    "aten.is_nonzero.default": "scalar read",
    "aten.nonzero.default": "nonzero",
    "aten.masked_select.default": "boolean mask",
    "aten.unique_dim.default": "unique",
    "aten._unique2.default": "unique",
    "aten._unique.default": "unique",
    "aten.unique_consecutive.default": "unique",
    "aten.lift_fresh.default": "tensor from Python data",
}
READS = ("tolist", "numpy")           # host values from a tensor
SCALARS = ("item", "__int__", "__float__", "__bool__", "__index__")   # one host value
COPIES = ("cpu",)                     # a host tensor from a tensor


class HostData:
    """The ids of live tensors that hold host data (forgotten when the tensor is freed)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def __contains__(self, tensor: object) -> bool:
        return id(tensor) in self.ids

    def mark(self, value: Any) -> None:
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in self.ids:
                self.ids.add(id(tensor))
                weakref.finalize(tensor, self.ids.discard, id(tensor))


class _Dispatches(TorchDispatchMode):
    def __init__(self, counts: Counter[str], host: HostData) -> None:
        super().__init__()
        self.counts, self.host = counts, host
        self.wrapped = 0       # > 0 while a Tensor method wrapper (which counts itself) runs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        inputs = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(tensor in self.host for tensor in inputs):
            self.host.mark(output)
            return output
        if self.wrapped:
            return output
        name = str(func)
        if name in SYNCHRONISING:
            self.counts[SYNCHRONISING[name]] += 1
        elif name.startswith("aten.index.Tensor") and _has_mask(args[1]):
            self.counts["boolean mask"] += 1
        return output


def _has_mask(indices: Any) -> bool:
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
               for index in indices)


@contextlib.contextmanager
def counted_round_trips() -> Iterator[Counter[str]]:
    """Within the block: what would synchronise a GPU worker, by kind (see the module docstring)."""
    counts: Counter[str] = Counter()
    host = HostData()
    dispatches = _Dispatches(counts, host)
    originals = {name: getattr(torch.Tensor, name) for name in (*READS, *SCALARS, *COPIES)}

    def counting(kind: str, method: Callable[..., Any], copies: bool) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self not in host:
                counts[kind] += 1
            dispatches.wrapped += 1
            try:
                result = method(self, *args, **kwargs)
                if copies and result is self:
                    result = self.clone()
            finally:
                dispatches.wrapped -= 1
            if copies:
                host.mark(result)
            return result
        return wrapper

    for name in READS:
        setattr(torch.Tensor, name, counting(f"copy to host ({name})", originals[name], copies=False))
    for name in SCALARS:
        setattr(torch.Tensor, name, counting("scalar read", originals[name], copies=False))
    for name in COPIES:
        setattr(torch.Tensor, name, counting(f"copy to host ({name})", originals[name], copies=True))
    try:
        with dispatches:
            yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
