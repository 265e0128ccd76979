"""Native CPU operators, built with the system compilers at first use and loaded into torch:

- ``sluice::paged_decode_attention``: the decode attention in C (``kernels/paged_decode_attention.c``),
  bound to torch by a thin C++ file (``kernels/paged_decode_attention_op.cpp``);
- ``sluice::prepacked_linear``: a product with a weight oneDNN laid out at load
  (``kernels/prepacked_linear_op.cpp``; the module is ``engine_service.model.prepacked``);
- ``sluice::dequantize_int4`` and ``sluice::dequantize_int8``: a quantized layer's weights as a
  dense matrix, in one pass, for products of many rows (``kernels/dequantize.c``, bound by
  ``kernels/dequantize_op.cpp``; used by ``engine_service.model.quantization``).

Why not ``torch.utils.cpp_extension``: code that includes ATen's headers takes long to compile
and needs ninja. The bindings use torch's stable C ABI instead (``torch/csrc/stable``: the shim's C
declarations and a few header-only templates), so the build is quick and needs nothing but gcc and
g++ (which inductor needs too). Why operators in C++ rather than Python functions (ctypes, as at
first): they run once per layer (and per projection) per step, where the Python layer's cost per call
was a large share of the kernel's own (the figures: docs/performance.md).

The shared object links ``libgomp.so.1``, the soname of the OpenMP runtime torch has already loaded,
so the kernel runs on torch's thread pool (a second pool would fight it for the cores). Built
objects are cached under ``$SLUICE_CACHE_DIR/kernels``, keyed by the sources, the compilers, torch's
version and the CPU's flags (the C builds for ``-march=native``). No compiler, a failed build or a
non-CPU device: ``paged_decode_attention_kernel()`` returns None with the reason logged once, and
the engine runs the plain-torch attention, and a bfloat16 model with prepacked weights runs
eagerly (``prepacked.compile_unavailable``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sluice.cpuinfo import cpuinfo_field
from sluice.paths import cache_dir

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
C_SOURCES = [KERNELS / "paged_decode_attention.c", KERNELS / "dequantize.c", KERNELS / "packed_gemv.c",
             KERNELS / "q4_gemv.c", KERNELS / "decode_stack.c", KERNELS / "q8_gemv.c"]
HEADERS = sorted(KERNELS.glob("*.h"))  # every header: a change to any of them rebuilds the library
CXX_SOURCES = [KERNELS / "paged_decode_attention_op.cpp", KERNELS / "prepacked_linear_op.cpp",
               KERNELS / "dequantize_op.cpp", KERNELS / "q4_linear_op.cpp", KERNELS / "q8_linear_op.cpp"]
LIBRARY_NAME = "sluice_ops"
# The oldest torch whose stable C ABI has what the bindings call (torch::stable::contiguous and
# torch_call_dispatcher are 2.10's). pyproject.toml states the same lower bound; the build targets
# it (TORCH_TARGET_VERSION), so a newer call fails the build here, not on a user's older torch.
MIN_TORCH = (2, 10)
TORCH_TARGET_VERSION = f"0x{MIN_TORCH[0]:02x}{MIN_TORCH[1]:02x}000000000000"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC"]
CXXFLAGS = ["-O2", "-std=c++17", "-fPIC", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
# The C kernels are x86-64 code (kernels/packed_gemv.c includes immintrin.h): elsewhere the build
# is refused before anything is compiled, and the engine runs torch's own paths.
ARCHITECTURES = ("x86_64", "AMD64")

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class NativeKernelError(RuntimeError):
    """The native kernel cannot be built or loaded here (the message says why)."""


def _cpu_flags() -> str:
    return cpuinfo_field("flags") or platform.processor()


def _compiler(env: str, *names: str) -> str:
    found = os.environ.get(env) or next((p for p in map(shutil.which, names) if p), None)
    if found is None:
        raise NativeKernelError(f"no {names[0]} on PATH (the native kernel needs gcc and g++)")
    return found


def check_architecture(machine: str | None = None) -> None:
    """Raise NativeKernelError unless this is an architecture the kernels are written for."""
    machine = machine or platform.machine()
    if machine not in ARCHITECTURES:
        raise NativeKernelError(f"the native kernels are x86-64 code (AVX2/AVX-512 intrinsics); on {machine} "
                                "the engine runs torch's own attention and products")


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NativeKernelError(f"{cmd[0]} failed to build {what}: {result.stderr.strip()[-2000:]}")


def _build() -> Path:
    cc, cxx = _compiler("CC", "gcc", "cc"), _compiler("CXX", "g++", "c++")
    torch_dir = Path(torch.__file__).parent
    versions = [subprocess.run([c, "--version"], capture_output=True, text=True, check=False).stdout
                for c in (cc, cxx)]
    key = hashlib.sha256("\0".join([
        *(src.read_text() for src in C_SOURCES + CXX_SOURCES + HEADERS), cc, cxx, *versions, " ".join(CFLAGS + CXXFLAGS),
        torch.__version__, str(torch_dir), _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{LIBRARY_NAME}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a scratch directory and renamed into place: engines starting together never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        work = Path(scratch)
        jobs = [([cc, *CFLAGS, "-c", str(src), "-o", str(work / f"{src.stem}.o")], src.name) for src in C_SOURCES]
        jobs += [([cxx, *CXXFLAGS, f"-I{torch_dir / 'include'}", "-c", str(src), "-o", str(work / f"{src.stem}.o")],
                  src.name) for src in CXX_SOURCES]
        objects = [Path(cmd[-1]) for cmd, _ in jobs]
        # One compiler a CPU, the slowest file first (paged_decode_attention.c: ~27 of the ~43 s
        # the files take one after the other on the development machine): a first start's build
        # takes about as long as that file instead of the sum.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), cpus))) as pool:
            for future in [pool.submit(_run, cmd, what) for cmd, what in jobs]:
                future.result()
        _run([cxx, "-shared", "-fopenmp", "-o", str(work / "ops.so"), *map(str, objects),
              f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}", "-lm"],
             target.name)
        os.replace(work / "ops.so", target)
    return target


def load_native_ops() -> None:
    """Build (once per machine) and load the native operators into torch (once per process);
    raises NativeKernelError saying why not."""
    with _lock:
        cached = _loaded.get(LIBRARY_NAME)
        if isinstance(cached, NativeKernelError):
            raise cached
        if cached is not None:
            return
        try:
            check_architecture()
            # the schemas the library implements are defined in Python (here and in prepacked)
            from engine_service.model import prepacked  # noqa: F401
            try:
                path = _build()
                torch.ops.load_library(str(path))
            except NativeKernelError:
                raise
            except (OSError, RuntimeError) as exc:  # a missing source, an unwritable cache, a failed dlopen
                raise NativeKernelError(f"could not build or load the kernel: {exc}") from exc
        except NativeKernelError as exc:
            _loaded[LIBRARY_NAME] = exc
            raise
        _loaded[LIBRARY_NAME] = path


def native_library() -> ctypes.CDLL:
    """The loaded library as ctypes sees it, for the C entry points called once a step
    (``engine_service.model.native_decode``); raises NativeKernelError saying why not."""
    load_native_ops()
    with _lock:
        lib = _loaded.get("ctypes")
        if lib is None:
            lib = _loaded["ctypes"] = ctypes.CDLL(str(_loaded[LIBRARY_NAME]))
        return lib


def native_ops_unavailable() -> str | None:
    """None when the native operators are loaded (building them if need be), else why not."""
    try:
        load_native_ops()
    except NativeKernelError as exc:
        return str(exc)
    return None


# The operator's schema and its shape function are Python's; its CPU kernel comes from the built
# library (torch.ops.load_library). Registered with torch.library's low-level API: behind
# ``torch.library.custom_op`` each call paid tens of µs more inside a compiled graph
# (engine_service.model.prepacked).
_library = torch.library.Library("sluice", "FRAGMENT")
_library.define("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                "Tensor context_lens, float scale) -> Tensor")


def _paged_decode_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


_library.impl("paged_decode_attention", _paged_decode_attention_fake, "Meta")
paged_decode_attention_op = torch.ops.sluice.paged_decode_attention
# the same attention, a bfloat16 cache's rows of one sequence never scored together by AMX tiles: every
# row's output the same as a lone row's bit for bit (a deterministic engine's)
_library.define("paged_decode_attention_exact(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                "Tensor context_lens, float scale) -> Tensor")
_library.impl("paged_decode_attention_exact", _paged_decode_attention_fake, "Meta")
paged_decode_attention_exact_op = torch.ops.sluice.paged_decode_attention_exact

_library.define("dequantize_int4(Tensor packed, Tensor scales_zeros, int group_size) -> Tensor")
_library.define("dequantize_int8(Tensor q, Tensor scales) -> Tensor")


def _dequantize_int4_fake(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    return scales_zeros.new_empty((packed.shape[0], packed.shape[1] * 2))


def _dequantize_int8_fake(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return scales.new_empty(q.shape)


_library.define("q4_linear(Tensor x, Tensor codes, Tensor scales_zeros, int out_features) -> Tensor")
_library.define("dequantize_q4(Tensor codes, Tensor scales_zeros, bool to_float32) -> Tensor")
_library.define("q4_supported() -> bool")


def _q4_linear_fake(x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor,
                    out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _dequantize_q4_fake(codes: torch.Tensor, scales_zeros: torch.Tensor, to_float32: bool) -> torch.Tensor:
    return scales_zeros.new_empty((codes.shape[0] * 16, codes.shape[1] * 8),
                                  dtype=torch.float32 if to_float32 else torch.bfloat16)


_library.define("q8_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor")
_library.define("dequantize_q8(Tensor codes, Tensor scales, bool to_float32) -> Tensor")
_library.define("q8_supported() -> bool")


def _q8_linear_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _dequantize_q8_fake(codes: torch.Tensor, scales: torch.Tensor, to_float32: bool) -> torch.Tensor:
    return scales.new_empty((codes.shape[0] * 16, codes.shape[1] * 4),
                            dtype=torch.float32 if to_float32 else torch.bfloat16)


_library.impl("q8_linear", _q8_linear_fake, "Meta")
_library.impl("dequantize_q8", _dequantize_q8_fake, "Meta")
_library.impl("q4_linear", _q4_linear_fake, "Meta")
_library.impl("dequantize_q4", _dequantize_q4_fake, "Meta")
_library.impl("dequantize_int4", _dequantize_int4_fake, "Meta")
_library.impl("dequantize_int8", _dequantize_int8_fake, "Meta")


class PagedDecodeAttention:
    """The native decode attention: ``op(q, k_cache, v_cache, block_tables, context_lens, scale) ->
    out`` on CPU tensors is the attention of ``engine_service.model.attention.
    decode_attention_reference``, reading the paged cache in place (``kernels/paged_decode_attention.c``).
    The operator checks its arguments itself and refuses, with the reason, what it cannot run; the
    engine asks ``supports`` once at start so that it can fall back to the torch path instead."""

    # the kernel's limits (PDA_MAX_HEADS, PDA_MAX_HEAD_DIM in kernels/paged_decode_attention.h)
    MAX_HEADS = 128
    MAX_HEAD_DIM = 256
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    op = paged_decode_attention_op
    exact_op = paged_decode_attention_exact_op

    def supports(self, cache_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel runs a cache of this dtype for this attention shape."""
        return (cache_dtype in self.DTYPES and kv_heads > 0 and heads % kv_heads == 0
                and heads <= self.MAX_HEADS and 0 < head_dim <= self.MAX_HEAD_DIM)


_KERNEL = PagedDecodeAttention()


def load_paged_decode_attention() -> PagedDecodeAttention:
    """Build (once per machine) and load the kernel; raises NativeKernelError saying why not."""
    load_native_ops()
    return _KERNEL


def paged_decode_attention_kernel(device: torch.device) -> PagedDecodeAttention | None:
    """The kernel for ``device``, or None (logged) where it cannot run."""
    if device.type != "cpu":
        return None
    try:
        return load_paged_decode_attention()
    except NativeKernelError as exc:
        logger.warning("native decode attention unavailable, using the torch path: %s", exc)
        return None
