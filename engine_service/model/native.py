"""Native CPU kernels: small C sources under ``kernels/``, built with the system C compiler at first
use and called through ctypes.

Why not ``torch.utils.cpp_extension``: a kernel that includes torch's headers takes about a minute
to compile on two cores and needs ninja; these kernels take plain pointers, compile in a fraction of
a second and need nothing but gcc (the same compiler inductor needs). The shared object links
``libgomp.so.1``, the soname of the OpenMP runtime torch has already loaded, so the kernels run on
torch's thread pool (a second pool would fight it for the cores).

Built objects are cached under ``$SLUICE_CACHE_DIR/kernels``, keyed by the source, the compiler and
the CPU's flags (the build targets ``-march=native``). No compiler, a failed build or a non-CPU
device: ``paged_decode_attention_kernel()`` returns None with the reason logged once, and the
engine runs the plain-torch attention.
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
from pathlib import Path

import torch

from sluice.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode_attention.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class NativeKernelError(RuntimeError):
    """The native kernel cannot be built or loaded here (the message says why)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build(source: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise NativeKernelError("no C compiler (gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), compiler, version, " ".join(CFLAGS), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: engines starting together never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        result = subprocess.run([compiler, *CFLAGS, "-o", str(partial), str(source), "-lm"],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeKernelError(f"{compiler} failed to build {source.name}: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


class PagedDecodeAttention:
    """``(q, k_cache, v_cache, block_tables, context_lens, scale) -> out`` on CPU tensors: the
    attention of ``engine_service.model.attention.decode_attention_reference``, reading the paged
    cache in place (see ``kernels/paged_decode_attention.c``)."""

    _ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int64] * 5 + [ctypes.c_float]

    def __init__(self, library: ctypes.CDLL) -> None:
        self._by_dtype = {}
        for dtype, name in ((torch.float32, "paged_decode_attention_f32"),
                            (torch.bfloat16, "paged_decode_attention_bf16")):
            fn = getattr(library, name)
            fn.restype = ctypes.c_int
            fn.argtypes = self._ARGTYPES
            self._by_dtype[dtype] = fn

    # the kernel's compile-time bounds (MAX_GROUP, HEAD_DIM_MAX in the C source)
    MAX_GROUP = 16
    MAX_HEAD_DIM = 256

    def supports(self, cache_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether the kernel runs a cache of this dtype for this attention shape."""
        return (cache_dtype in self._by_dtype and kv_heads > 0 and heads % kv_heads == 0
                and heads // kv_heads <= self.MAX_GROUP and 0 < head_dim <= self.MAX_HEAD_DIM)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        batch, heads, head_dim = q.shape
        _, block_size, kv_heads, cache_dim = k_cache.shape
        fn = self._by_dtype.get(k_cache.dtype)
        if fn is None or v_cache.dtype != k_cache.dtype:
            raise NativeKernelError(f"no native decode attention for a {k_cache.dtype} cache")
        if cache_dim != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise NativeKernelError("native decode attention needs contiguous caches of the query's head size")
        if not self.supports(k_cache.dtype, heads, kv_heads, head_dim):
            raise NativeKernelError(f"native decode attention does not run {heads} heads over {kv_heads} kv heads "
                                    f"of size {head_dim}")
        query = q.to(torch.float32).contiguous()
        out = torch.empty_like(query)
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        failed = fn(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                    tables.shape[1], lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, head_dim,
                    block_size, scale)
        if failed == 2:
            raise NativeKernelError("native decode attention refused the shape")
        if failed:
            raise MemoryError("native decode attention could not allocate its score buffer")
        return out.to(q.dtype)


def load_paged_decode_attention() -> PagedDecodeAttention:
    """Build (once per machine) and load the kernel; raises NativeKernelError saying why not."""
    with _lock:
        cached = _loaded.get("paged_decode_attention")
        if isinstance(cached, PagedDecodeAttention):
            return cached
        if isinstance(cached, NativeKernelError):
            raise cached
        try:
            if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
                raise NativeKernelError(f"no native kernels for {platform.machine()}")
            try:
                library = ctypes.CDLL(str(_build(SOURCE)))
            except OSError as exc:  # a missing source, an unwritable cache, a failed dlopen
                raise NativeKernelError(f"could not build or load the kernel: {exc}") from exc
            kernel = PagedDecodeAttention(library)
        except NativeKernelError as exc:
            _loaded["paged_decode_attention"] = exc
            raise
        _loaded["paged_decode_attention"] = kernel
        return kernel


def paged_decode_attention_kernel(device: torch.device) -> PagedDecodeAttention | None:
    """The kernel for ``device``, or None (logged) where it cannot run."""
    if device.type != "cpu":
        return None
    try:
        return load_paged_decode_attention()
    except NativeKernelError as exc:
        logger.warning("native decode attention unavailable, using the torch path: %s", exc)
        return None


# The kernel as a torch operator, so a compiled graph can call it (dynamo cannot trace ctypes): the
# compiled decode step (engine_service.model.compiled) uses this when the kernel is available.
# Registered with torch.library's low-level API: behind ``torch.library.custom_op`` the Python
# implementation cost tens of µs more per call inside the graph (engine_service.model.prepacked).
_library = torch.library.Library("sluice", "FRAGMENT")
_library.define("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                "Tensor context_lens, float scale) -> Tensor")


def _paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return load_paged_decode_attention()(q, k_cache, v_cache, block_tables, context_lens, scale)


def _paged_decode_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


_library.impl("paged_decode_attention", _paged_decode_attention_cpu, "CPU")
_library.impl("paged_decode_attention", _paged_decode_attention_fake, "Meta")
paged_decode_attention_op = torch.ops.sluice.paged_decode_attention
