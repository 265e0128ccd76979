"""The decode paths and the one choice among them, made once at engine start.

``DECODE_PATHS`` is the registry, in order of preference. Paths that run every step (the compiled
step, the eager forward) come last; the first of them that can run here is built, and then the
first step path that can (CUDA graphs, the native decode step) is built over it and takes the steps
it is built for. Each path that cannot run says why (``PathSpec.unavailable``), and a path whose
build fails is logged and passed over: the eager forward always runs. The chosen path hands the
scheduler its ``DecodeCapabilities``.

A new path is one module (a ``DecodePath`` subclass and its ``PathSpec``) and one entry here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine_service.model.decode_paths import compiled, cuda_graphs, eager, native_step
from engine_service.model.decode_paths.base import DecodePath, PathSetup, PathSpec

logger = logging.getLogger(__name__)

__all__ = ["DECODE_PATHS", "DecodePath", "PathChoice", "PathSetup", "PathSpec", "choose_decode_path"]

DECODE_PATHS: tuple[PathSpec, ...] = (cuda_graphs.SPEC, native_step.SPEC, compiled.SPEC, eager.SPEC)


@dataclass
class PathChoice:
    path: DecodePath
    passed_over: dict[str, str] = field(default_factory=dict)  # path name -> why it does not run
    asked: set[str] = field(default_factory=set)  # the paths the setup asked for by a knob

    def summary(self) -> str:
        return self.path.describe()


def _build(spec: PathSpec, setup: PathSetup, fallback: DecodePath | None, passed_over: dict[str, str]) -> DecodePath | None:
    why = spec.unavailable(setup)
    if why is not None:
        passed_over[spec.name] = why
        return None
    try:
        return spec.build(setup, fallback)
    except Exception as exc:  # a failed build must not stop the engine: the eager forward is complete
        logger.exception("the %s path failed to start; passing it over", spec.name)
        passed_over[spec.name] = f"failed to start ({type(exc).__name__}: {exc})"
        return None


def choose_decode_path(setup: PathSetup, specs: tuple[PathSpec, ...] = DECODE_PATHS) -> PathChoice:
    """The decode path for ``setup``: the first step path that can run, over the first path that
    runs every step; why each other one does not run is in ``passed_over``."""
    passed_over: dict[str, str] = {}
    base = None
    for spec in (s for s in specs if s.runs_every_step):
        base = _build(spec, setup, None, passed_over)
        if base is not None:
            break
    if base is None:
        raise RuntimeError(f"no decode path runs every step here: {passed_over}")
    asked = {spec.name for spec in specs if spec.asked(setup)}
    for spec in (s for s in specs if not s.runs_every_step):
        path = _build(spec, setup, base, passed_over)
        if path is not None:
            return PathChoice(path, passed_over, asked)
    return PathChoice(base, passed_over, asked)
