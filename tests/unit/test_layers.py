"""The layers import one way (docs/architecture.md); what must stay torch-free stays torch-free."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Run in a fresh interpreter where `import torch` fails, so a torch import anywhere on the path
# is an ImportError rather than a silent (and slow) success.
_BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (imported as {name!r})")
            return None
    sys.meta_path.insert(0, _NoTorch())
    """
)


def _run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_the_torch_blocker_works() -> None:
    res = _run_without_torch("import torch")
    assert res.returncode != 0 and "torch is blocked" in res.stderr


def test_cli_gateway_command_needs_no_torch() -> None:
    # The gateway image has no torch: `sluice gateway --help` must parse its options without it.
    res = _run_without_torch(
        """
        from sluice_cli.cli import main
        try:
            main(["gateway", "--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        main(["--help"])
        """
    )
    assert res.returncode == 0, res.stderr
    assert "--redis-url" in res.stdout and "sluice COMMAND" in res.stdout


def test_core_imports_without_torch() -> None:
    # The model-free core: requests, sampling params, block pool, scheduler, stopping, outputs.
    res = _run_without_torch(
        """
        import pkgutil, importlib, sys
        import engine_service.core as core
        names = [m.name for m in pkgutil.iter_modules(core.__path__, "engine_service.core.")]
        for name in names:
            importlib.import_module(name)
        import engine_service.config
        assert "torch" not in sys.modules
        print(len(names))
        """
    )
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip()) >= 7  # every module of the package was imported


def test_gateway_imports_without_torch() -> None:
    res = _run_without_torch("import gateway.app, gateway.routes, gateway.serving_chat, gateway.serving_completion")
    assert res.returncode == 0, res.stderr


def test_import_linter_contracts_hold() -> None:
    # The layer contracts of pyproject.toml ([tool.importlinter]); a wrong arrow fails here.
    import os
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # the environment's own script first: pytest run as .venv/bin/python has no .venv/bin on PATH
    beside = Path(sys.executable).parent / "lint-imports"
    exe = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert exe is not None, "import-linter is a test dependency: pip install import-linter"
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([exe, "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout
