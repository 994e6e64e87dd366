"""An AOTInductor CPU package run through its C interface, with the Python GIL released.

torch's own entry points (`torch._inductor.aoti_load_package(...)(x)`, the loader's `run` and
`boxed_run`, `AOTIModelContainerRunnerCpu.run`; torch 2.14) hold the GIL for the whole forward
pass, so every other thread of the worker (TorchServe's event loop in asynchronous mode, a
decode thread) stands still while a batch runs. The package's shared library exports a C
interface (`AOTInductorModelContainerCreateWithDevice`, `AOTInductorModelContainerRun`; torch's
`torch/csrc/inductor/aoti_runtime/interface.h`), and `ctypes` releases the GIL for the length of
a foreign call. Tensors cross as `AtenTensorHandle`s made and taken back by `torch._C._aoti`.

Only single-input, single-output CPU packages whose weights are inside the shared library (what
the archive builder writes) run this way; `UnsupportedPackage` says why another cannot, and the
caller then loads it with torch's loader. Input checks (`AOTI_RUNTIME_CHECK_INPUTS`) apply as with
torch's loader: a wrong shape, stride or dtype is refused (RuntimeError; the runtime writes the
detail to the worker's stderr). The answers are torch's loader's, bit for bit
(tests/unit/test_gil_free_package.py).
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

import torch
import torch._C._aoti as aoti_handles

# The members of a package that would hold weights outside the shared library.
EXTERNAL_WEIGHT_DIRECTORIES = frozenset({"constants", "weights"})


class UnsupportedPackage(Exception):
    """This package cannot run through the C interface here (the message says why)."""


def shared_library_member(package: zipfile.ZipFile) -> str:
    """The name, inside the `.pt2` archive, of its one model shared library; UnsupportedPackage
    when it has none, several, or weights stored beside it."""
    libraries = [name for name in package.namelist() if name.endswith(".so")
                 and "/data/aotinductor/" in name]
    if len(libraries) != 1:
        raise UnsupportedPackage(f"expected one model library in the package, found {libraries}")
    external = [name for name in package.namelist()
                if EXTERNAL_WEIGHT_DIRECTORIES & set(PurePosixPath(name).parts[1:3])]
    if external:
        raise UnsupportedPackage(f"weights outside the library ({external[:3]})")
    return libraries[0]


def load_library(path: Path) -> ctypes.CDLL:
    """The package's model library, extracted to a private temporary directory, loaded, and the
    copy removed again (the loaded mapping outlives the file)."""
    with zipfile.ZipFile(path) as package:
        member = shared_library_member(package)
        directory = Path(tempfile.mkdtemp(prefix="aoti-"))
        try:
            library_path = directory / "model.so"
            with package.open(member) as source, library_path.open("wb") as target:
                shutil.copyfileobj(source, target)
            return ctypes.CDLL(str(library_path))
        finally:
            shutil.rmtree(directory, ignore_errors=True)


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_Handle = ctypes.c_void_p
_HandleArray = ctypes.c_void_p * 1


class GilFreePackage:
    """`package(x)`: the package's forward pass on `x` (one tensor in, one tensor out), run with
    the GIL released. Concurrent calls are serialised by the container (one model instance)."""

    def __init__(self, path: Path) -> None:
        self._library = library = load_library(path)
        library.AOTInductorModelContainerCreateWithDevice.argtypes = [
            ctypes.POINTER(_Handle), ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p]
        library.AOTInductorModelContainerRun.argtypes = [
            _Handle, ctypes.POINTER(_Handle), ctypes.c_size_t, ctypes.POINTER(_Handle),
            ctypes.c_size_t, _Handle, _Handle]
        library.AOTInductorModelContainerDelete.argtypes = [_Handle]
        self._container = _Handle()
        self._check(library.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._container), 1, b"cpu", None), "creating the model container")
        inputs, outputs = self._count("Inputs"), self._count("Outputs")
        if (inputs, outputs) != (1, 1):
            self.close()
            raise UnsupportedPackage(f"{inputs} inputs and {outputs} outputs (one of each runs here)")

    def _count(self, what: str) -> int:
        count = ctypes.c_size_t()
        function = getattr(self._library, f"AOTInductorModelContainerGetNum{what}")
        function.argtypes = [_Handle, ctypes.POINTER(ctypes.c_size_t)]
        self._check(function(self._container, ctypes.byref(count)), f"counting {what.lower()}")
        return count.value

    @staticmethod
    def _check(code: int, doing: str) -> None:
        if code != 0:
            raise RuntimeError(f"AOTInductor failed {doing} (code {code}; the worker log has the "
                               "runtime's message)")

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        # The run takes ownership of the input handle (a new reference to `batch`) and hands
        # over the output handle, which the returned tensor then owns.
        (capsule,) = aoti_handles.unsafe_alloc_void_ptrs_from_tensors([batch])
        inputs, outputs = _HandleArray(_capsule_pointer(capsule, None)), _HandleArray()
        self._check(self._library.AOTInductorModelContainerRun(
            self._container, inputs, 1, outputs, 1, None, None), "running the model")
        return aoti_handles.alloc_tensor_by_stealing_from_void_ptr(_new_capsule(outputs[0], None, None))

    def close(self) -> None:
        if getattr(self, "_container", None):
            self._library.AOTInductorModelContainerDelete(self._container)
            self._container = _Handle()

    def __del__(self) -> None:
        self.close()
