"""Regenerate the Python modules from proto/ (``python -m sluice.wire.generate``).

The .proto files sit at proto/sluice/wire/ so that protoc, run with ``-I proto``, writes
``sluice/wire/*_pb2*.py`` with package-qualified imports between them. The generated files are
committed; tests/unit/test_wire.py fails when they are stale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = sorted((PROTO_ROOT / "sluice" / "wire").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir`` and return the files it wrote."""
    from grpc_tools import protoc  # test/dev dependency only

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    for grpc_module in (out_dir / "sluice" / "wire").glob("*_pb2_grpc.py"):
        if "Stub" not in grpc_module.read_text():  # no `class XStub`: no service in that file
            grpc_module.unlink()  # a .proto without services: its grpc module would be an empty shell
    return sorted((out_dir / "sluice" / "wire").glob("*_pb2*.py*"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = REPO_ROOT / "sluice" / "wire" / path.name
            target.write_bytes(path.read_bytes())
            print(f"wrote {target.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
