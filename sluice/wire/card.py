"""The model card: what an engine publishes about its model, so that gateways need no model files.

``ModelCard`` is the one definition of the card; :meth:`ModelCard.encode` writes the Redis hash
``sluice:model:{model}`` (``contract.model_card_key``) and :meth:`ModelCard.decode` reads it back.
Nothing else spells out the hash's fields. :meth:`ModelCard.from_model_dir` builds it from a
Hugging Face directory, taking the chat template from wherever the directory keeps it (see
``sluice.text.tokenizer.read_chat_template``) and the sampling defaults from
``generation_config.json``.

A card written by an engine of another contract version is refused by :meth:`decode` with
:class:`ContractMismatch`, whose message says which side to upgrade: a gateway never misreads it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.wire import contract, dialects, limits

# The hash's fields, each written by encode() and read by decode() only.
F_NAME = "name"
F_MAX_MODEL_LEN = "max_model_len"
F_VOCAB_SIZE = "vocab_size"
F_EOS_TOKEN_IDS = "eos_token_ids"  # JSON list
F_TOKENIZER_JSON = "tokenizer_json"  # the tokenizer.json text
F_TOKENIZER_CONFIG = "tokenizer_config"  # the tokenizer_config.json text
F_CHAT_TEMPLATE = "chat_template"  # JSON: null, a template string, or {name: template}
F_GENERATION_CONFIG = "generation_config"  # JSON: the generation_config.json object ({} when absent)
F_CONTRACT_VERSION = "contract_version"
F_TOOL_CALL_PARSER = "tool_call_parser"  # sluice.wire.dialects' name (vLLM's)
F_REASONING_PARSER = "reasoning_parser"  # a dialects name, "" for none
F_QUEUE_SHARDS = "queue_shards"  # the queue's shard count (sluice.wire.shards)
F_BLOCK_SIZE = "block_size"  # tokens per KV block: the unit of the shard key
F_SHARD_PREFIX_BLOCKS = "shard_prefix_blocks"  # how many leading full blocks choose the shard
F_FINGERPRINT = "fingerprint"  # a hash of the other fields: readers refetch the card only when it changes

# generation_config.json keys that are sampling defaults (vLLM's ``--generation-config auto``).
GENERATION_DEFAULT_KEYS = tuple(limits.MODEL_DEFAULTS)


class CardError(ValueError):
    """The card in Redis is malformed."""


class ContractMismatch(CardError):
    """The card was written by an engine that speaks another contract version."""


def _s(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, float | int]:
    """The sampling defaults a ``generation_config.json`` sets (temperature, top_p, top_k, min_p,
    repetition_penalty), as vLLM reads them. ``do_sample: false`` means greedy."""
    out: dict[str, float | int] = {}
    for key in GENERATION_DEFAULT_KEYS:
        value = generation_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = int(value) if key == "top_k" else float(value)
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


@dataclass(frozen=True)
class ModelCard:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_json: str
    tokenizer_config: str = "{}"
    chat_template: str | dict[str, str] | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    contract_version: int = contract.CONTRACT_VERSION
    tool_call_parser: str = dialects.DEFAULT_TOOL_CALL_PARSER
    reasoning_parser: str | None = None
    queue_shards: int = contract.DEFAULT_QUEUE_SHARDS
    block_size: int = 16
    shard_prefix_blocks: int = contract.DEFAULT_SHARD_PREFIX_BLOCKS

    # -- building -------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, name: str, max_model_len: int, vocab_size: int,
                       eos_token_ids: list[int], tool_call_parser: str | None = None,
                       reasoning_parser: str | None = None,
                       queue_shards: int = contract.DEFAULT_QUEUE_SHARDS, block_size: int = 16,
                       shard_prefix_blocks: int = contract.DEFAULT_SHARD_PREFIX_BLOCKS) -> ModelCard:
        """``tool_call_parser`` / ``reasoning_parser``: the engine's flags (None: detected from the
        chat template, ``sluice.wire.dialects``); an unknown name is a ``ValueError`` listing the known."""
        from sluice.text.tokenizer import read_chat_template

        root = Path(model_dir)

        def text(filename: str, default: str = "") -> str:
            path = root / filename
            return path.read_text(encoding="utf-8") if path.is_file() else default

        gen_text = text("generation_config.json")
        chat_template = read_chat_template(root)
        tools, reasoning = dialects.resolve(chat_template, tool_call_parser, reasoning_parser)
        return cls(
            name=name,
            max_model_len=int(max_model_len),
            vocab_size=int(vocab_size),
            eos_token_ids=[int(t) for t in eos_token_ids],
            tokenizer_json=text("tokenizer.json"),
            tokenizer_config=text("tokenizer_config.json", "{}"),
            chat_template=chat_template,
            generation_config=json.loads(gen_text) if gen_text.strip() else {},
            tool_call_parser=tools,
            reasoning_parser=reasoning,
            queue_shards=int(queue_shards),
            block_size=int(block_size),
            shard_prefix_blocks=int(shard_prefix_blocks),
        )

    def tokenizer(self):
        """The ``sluice.text.tokenizer.Tokenizer`` the card describes (with its chat template)."""
        from sluice.text.tokenizer import Tokenizer

        return Tokenizer.from_strings(self.tokenizer_json, self.tokenizer_config,
                                      json.dumps(self.generation_config), self.chat_template)

    def sampling_defaults(self) -> dict[str, float | int]:
        return sampling_defaults(self.generation_config)

    # -- the Redis hash -------------------------------------------------------------------------

    def encode(self) -> dict[str, str]:
        """The fields of the Redis hash ``contract.model_card_key(name)``."""
        fields = {
            F_NAME: self.name,
            F_MAX_MODEL_LEN: str(self.max_model_len),
            F_VOCAB_SIZE: str(self.vocab_size),
            F_EOS_TOKEN_IDS: json.dumps(list(self.eos_token_ids)),
            F_TOKENIZER_JSON: self.tokenizer_json,
            F_TOKENIZER_CONFIG: self.tokenizer_config,
            F_CHAT_TEMPLATE: json.dumps(self.chat_template),
            F_GENERATION_CONFIG: json.dumps(self.generation_config, sort_keys=True),
            F_CONTRACT_VERSION: str(self.contract_version),
            F_TOOL_CALL_PARSER: self.tool_call_parser,
            F_REASONING_PARSER: self.reasoning_parser or "",
            F_QUEUE_SHARDS: str(self.queue_shards),
            F_BLOCK_SIZE: str(self.block_size),
            F_SHARD_PREFIX_BLOCKS: str(self.shard_prefix_blocks),
        }
        digest = hashlib.sha256()
        for key in sorted(fields):
            digest.update(key.encode() + b"\0" + fields[key].encode() + b"\0")
        fields[F_FINGERPRINT] = digest.hexdigest()[:32]
        return fields

    @classmethod
    def decode(cls, raw: Mapping[Any, Any]) -> ModelCard:
        """From the Redis hash (bytes or str keys and values). Raises :class:`ContractMismatch`
        for another contract version and :class:`CardError` for a malformed card."""
        fields = {_s(k): _s(v) for k, v in raw.items()}
        check_version(fields.get(F_CONTRACT_VERSION), fields.get(F_NAME, "?"))
        try:
            chat_template = json.loads(fields.get(F_CHAT_TEMPLATE) or "null")
            # a card without the fields (an older engine): what its chat template shows
            tools, reasoning = dialects.resolve(chat_template, fields.get(F_TOOL_CALL_PARSER),
                                                fields.get(F_REASONING_PARSER) or dialects.NO_REASONING) \
                if F_TOOL_CALL_PARSER in fields else dialects.resolve(chat_template)
            return cls(
                name=fields[F_NAME],
                max_model_len=int(fields[F_MAX_MODEL_LEN]),
                vocab_size=int(fields[F_VOCAB_SIZE]),
                eos_token_ids=[int(t) for t in json.loads(fields.get(F_EOS_TOKEN_IDS) or "[]")],
                tokenizer_json=fields[F_TOKENIZER_JSON],
                tokenizer_config=fields.get(F_TOKENIZER_CONFIG) or "{}",
                chat_template=chat_template,
                generation_config=json.loads(fields.get(F_GENERATION_CONFIG) or "{}"),
                contract_version=int(fields[F_CONTRACT_VERSION]),
                tool_call_parser=tools,
                reasoning_parser=reasoning,
                queue_shards=_bounded(fields.get(F_QUEUE_SHARDS), 1, 1, contract.MAX_QUEUE_SHARDS),
                block_size=_bounded(fields.get(F_BLOCK_SIZE), 16, 1, 1 << 16),
                shard_prefix_blocks=_bounded(fields.get(F_SHARD_PREFIX_BLOCKS),
                                             contract.DEFAULT_SHARD_PREFIX_BLOCKS, 0, 1 << 16),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CardError(f"the model card in Redis is malformed ({type(exc).__name__}: {exc})") from exc


def _bounded(raw: str | None, default: int, low: int, high: int) -> int:
    """An int field of the card; absent: ``default`` (a card without shards has one queue stream)."""
    value = default if raw in (None, "") else int(raw)
    if not low <= value <= high:
        raise ValueError(f"{value} is outside [{low}, {high}]")
    return value


def check_version(version: Any, model: str = "?") -> None:
    """Raise :class:`ContractMismatch` unless ``version`` is this side's ``CONTRACT_VERSION``."""
    try:
        theirs = int(_s(version)) if version is not None else None
    except ValueError:
        theirs = None
    if theirs != contract.CONTRACT_VERSION:
        raise ContractMismatch(
            f"model `{model}` is served by an engine that speaks Sluice contract version "
            f"{theirs if theirs is not None else 'unknown'}, this gateway speaks version "
            f"{contract.CONTRACT_VERSION}: run the same Sluice release on gateways and engines"
        )
