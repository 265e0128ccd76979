"""Shared helpers for tests that run the real model."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine_service.core.request import Request

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine-making. "
    "Within fifty years, presses were running in more than two hundred cities across Europe, and "
    "an estimated twenty million volumes had been printed. Scholars argue about the consequences: "
    "some credit the press with the Reformation, the Scientific Revolution and the rise of "
    "vernacular literature; others point out that manuscript culture persisted for centuries. "
    "In 1620, Francis Bacon listed printing, gunpowder and the compass as the three inventions "
    "that had changed the world. Today, the same debates recur about the internet. "
)

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 5, 8, 13,",
    "Les élèves ont étudié le 日本語 et les émojis 🙂 pendant   trois heures —",
    "Hi",
    LONG_TEXT * 3 + "\nSummary:",  # ~500 tokens
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 times 7?"},
     {"role": "assistant", "content": "12 times 7 is 84."},
     {"role": "user", "content": "And divided by 2?"}],
    [{"role": "user", "content": "Summarise this text in two sentences:\n\n" + LONG_TEXT * 7}],  # ~1000 tokens
]


def parity_prompts(tokenizer) -> list[list[int]]:
    """Ten varied prompts as token ids: plain and chat, from a couple of tokens to ~1,000."""
    prompts = [tokenizer.encode(p) for p in PLAIN_PROMPTS]
    for conv in CHAT_CONVERSATIONS:
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(conv, add_generation_prompt=True)))
    return prompts


@dataclass
class Chunk:
    """A scheduled chunk as the model runner reads it (the scheduler's ScheduledChunk shape)."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens


def shallow_copy(model_dir: Path, dest: Path, layers: int) -> Path:
    """The model in ``model_dir`` cut to its first ``layers`` decoder layers, written to ``dest``:
    its real embeddings, norms, tokenizer and chat template, so prompts and outputs stay the real
    model's kind of tokens. For tests whose subject is a code path rather than the model's quality
    (compilation cost grows with the layers traced; a graph of four layers exercises what one of
    thirty does)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"layers must be in 1..{config['num_hidden_layers']}, got {layers}")
    config["num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    def kept(name: str) -> bool:  # "model.layers.7.mlp.up_proj.weight" is layer 7's
        parts = name.split(".")
        return "layers" not in parts or int(parts[parts.index("layers") + 1]) < layers

    tensors = load_file(model_dir / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if kept(n)}, dest / "model.safetensors", metadata={"format": "pt"})
    for other in model_dir.iterdir():
        if other.is_file() and other.name not in ("config.json", "model.safetensors"):
            shutil.copy2(other, dest / other.name)
    return dest
