"""llama.cpp's own server, ``llama-server``, the served anchor of ``sluice bench anchor --served``.

The binary is ``--llama-server PATH``, else ``$SLUICE_LLAMA_SERVER``, else the one this module built
into the cache. Building it (``build``) takes the llama-cpp-python sdist of the installed binding's
version (``pip download``), and compiles its vendored llama.cpp with cmake for this CPU (native
kernels, static libraries): about 10 minutes on 2 cores, once. It is never a test or CI dependency.

``command`` gives the server its best footing for a served comparison: continuous batching (its
default), one slot per concurrent request (``--parallel``) with the context to hold each, the
compute threads of the machine, and as many HTTP threads as requests in flight plus a few
(``--threads-http``), so that it refuses no connection the client opens.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

BINARY_ENV = "SLUICE_LLAMA_SERVER"
SDIST = "llama-cpp-python"
FALLBACK_VERSION = "0.3.36"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TOOLS=ON"]
HTTP_THREADS_SPARE = 4


class LlamaServerError(RuntimeError):
    """No llama-server to run, or its build failed; the message says what to do."""


def version() -> str:
    """The llama-cpp-python version whose vendored llama.cpp the server is built from."""
    try:
        return importlib.metadata.version(SDIST)
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_VERSION


def cached_binary() -> Path:
    from sluice.paths import cache_dir

    return cache_dir() / "anchor" / f"llama-server-{version()}" / "llama-server"


def find(explicit: Path | None) -> Path | None:
    """The binary to run, or None when none is built yet."""
    for candidate in (explicit, os.environ.get(BINARY_ENV)):
        if candidate:
            path = Path(candidate).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise LlamaServerError(f"llama-server {path} is not an executable file")
            return path
    cached = cached_binary()
    return cached if cached.is_file() else None


def build(jobs: int | None = None, log=print) -> Path:
    """Build llama-server from the sdist's vendored llama.cpp into the cache; returns its path."""
    for tool in ("cmake", "cc", "c++"):
        if shutil.which(tool) is None:
            raise LlamaServerError(f"building llama-server needs {tool} (apt-get install cmake build-essential)")
    dest = cached_binary()
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        work = Path(tmp)
        log(f"downloading the {SDIST}=={version()} sdist")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"{SDIST}=={version()}",
              "-d", str(work)], "pip download")
        archive = next(work.glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("*/vendor/llama.cpp"))
        log(f"building llama-server with cmake ({jobs} jobs; about 10 minutes on 2 cores)")
        _run(["cmake", "-S", str(source), "-B", str(work / "build"), *CMAKE_FLAGS], "cmake configure")
        _run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)], "cmake build")
        built = work / "build" / "bin" / "llama-server"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, dest.with_suffix(".tmp"))
        os.replace(dest.with_suffix(".tmp"), dest)
    log(f"built {dest}")
    return dest


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise LlamaServerError(f"{what} failed ({done.returncode}): " + " | ".join(tail))


def command(binary: Path, gguf: Path, port: int, *, slots: int, ctx_per_slot: int, threads: int) -> list[str]:
    """llama-server serving ``gguf`` on 127.0.0.1:``port`` (the module docstring says why each flag)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot), "--threads", str(threads),
            "--threads-batch", str(threads), "--threads-http", str(slots + HTTP_THREADS_SPARE), "--no-webui"]
