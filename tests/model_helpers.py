"""Shared helpers for tests that run the real model."""

from __future__ import annotations

from dataclasses import dataclass

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
