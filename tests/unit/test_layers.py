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
