"""The decode-path interface: how a step's forward runs, chosen once at engine start.

A path turns a laid-out step (``ModelRunner.prepare``: token ids, positions, ``AttentionMetadata``)
into the final hidden states of every row, and says what it can do (``DecodeCapabilities``: the
scheduler's whole view of it). Some paths run every step (the eager forward, the compiled step);
others take only the steps they are built for (a decode-only step of a few rows) and hand the rest
to the path they were built over, their ``fallback``. The registry that picks one is
``engine_service.model.decode_paths``; a new path is one module with a ``DecodePath`` subclass and a
``PathSpec``, and one entry in that registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_service.config import DecodeCapabilities
from engine_service.model.attention import AttentionMetadata
from engine_service.model.llama import KVCache, LlamaForCausalLM


@dataclass
class PathSetup:
    """What a decode path is built from: the engine's model and caches, and the facts and knobs that
    decide which paths may run."""

    model: LlamaForCausalLM
    kv_caches: list[KVCache]
    device: torch.device
    block_size: int
    scratch_slot: int  # a cache slot no request owns: warm-ups and padding write only there
    max_batch: int  # the scheduler's most sequences a step (max_num_seqs)
    max_model_len: int
    # the decode attention every path's forward calls (AttentionMetadata.decode_kernel), None: the
    # torch reference; attention_backend says which ("native" or "torch")
    decode_kernel: Callable[..., torch.Tensor] | None = None
    attention_backend: str = "torch"
    reference: bool = False  # eager asked for (--enforce-eager): the reference forward alone
    compile: bool = False  # torch.compile allowed (not enforce_eager)
    cuda_graphs: bool = False  # the cuda_graphs knob
    native_decode: bool = False  # the native_decode knob
    num_scheduler_steps: int = 1
    # a deterministic engine (engine_service.model.determinism): every row a decode of its own
    # length, every step through the path's row-invariant kernels
    deterministic: bool = False


class DecodePath:
    """Callable pieces of a step's forward. Subclasses set ``name`` and override what they take."""

    name = "eager"
    # the fewest block-table columns a step's decode rows must have (the compiled step pads to 2, so
    # that the width never specialises its graph)
    min_table_width = 1

    def __init__(self, setup: PathSetup, fallback: DecodePath | None = None) -> None:
        self.setup = setup
        self.model = setup.model
        self.kv_caches = setup.kv_caches
        self.fallback = fallback
        self.warmup_seconds: float | None = None

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [rows, hidden] of a step."""
        if self.fallback is None:
            raise NotImplementedError(f"the {self.name} path runs no step of its own")
        return self.fallback.hidden(input_ids, positions, meta)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               argmax: torch.Tensor) -> torch.Tensor | None:
        """The logits [rows, vocab] (float32) of a step in which every row samples, computed with the
        step itself, ``argmax`` filled with each row's argmax of them; None where this path does not
        take this step that way (the runner then takes ``hidden`` and the model's head)."""
        return None

    def greedy_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Several greedy decode steps in one call (``capabilities().multi_step_max_rows``)."""
        raise RuntimeError(f"the {self.name} path runs no several decode steps in one call")

    def capabilities(self) -> DecodeCapabilities:
        return DecodeCapabilities(path=self.name)

    def describe(self) -> str:
        """The path for the start-up line: its name, and what runs the steps it does not take."""
        return self.name if self.fallback is None else f"{self.name} (other steps {self.fallback.describe()})"


@dataclass(frozen=True)
class PathSpec:
    """A registry entry: a path's name, why it cannot run with a given setup (None: it can), and how
    to build it over the path that runs the steps it does not take (None for a path that runs every
    step)."""

    name: str
    unavailable: Callable[[PathSetup], str | None]
    build: Callable[[PathSetup, DecodePath | None], DecodePath]
    runs_every_step: bool  # False: a step path, built over one that runs every step
    # whether the setup asked for this path by name (a knob), so that not running it is a warning
    asked: Callable[[PathSetup], bool] = lambda setup: False
