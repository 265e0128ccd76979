"""The tokenizer shared by the engine, the offline API and the gateway (no torch).

A thin wrapper around ``tokenizers.Tokenizer`` that reads a Hugging Face model directory
(``tokenizer.json`` + ``tokenizer_config.json`` [+ ``generation_config.json``,
``chat_template.jinja``]) or the same texts as strings (gateways receive them through the model
card in Redis), with Hugging Face semantics:

* ``encode(text, add_special_tokens=True)`` runs the ``tokenizer.json`` post-processor, plus a BOS
  when ``tokenizer_config.json`` says ``add_bos_token`` and the post-processor did not add one
  (SmolLM2 adds none);
* ``decode(ids, skip_special_tokens=False)`` with ``clean_up_tokenization_spaces`` when configured;
* ``apply_chat_template`` renders with :mod:`sluice.text.chat_template`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from sluice.text.chars_per_token import max_chars_per_token, spec_of
from sluice.text.chat_template import ChatTemplateError, render_chat_template

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return None if content is None else str(content)
    return str(value)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (only when the config asks for it)."""
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
        .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
        .replace(" 've", "'ve").replace(" 're", "'re")
    )


def read_chat_template(model_dir: str | Path) -> str | dict[str, str] | None:
    """A model directory's chat template, found where transformers looks for it.

    ``chat_template.jinja`` (what a recent ``save_pretrained`` writes) takes priority over the
    ``chat_template`` entry of ``tokenizer_config.json``, as in transformers; named templates in
    ``additional_chat_templates/*.jinja`` join it (the result is then ``{name: template}``, the
    file's as ``"default"``). ``chat_template.json`` (``{"chat_template": ...}``, the processors'
    legacy file) is the last resort. None when the directory has no template.
    """
    root = Path(model_dir)

    def read(name: str) -> str | None:
        path = root / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    templates: dict[str, str] = {}
    if (text := read("chat_template.jinja")) is not None:
        templates["default"] = text
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    config_text = read("tokenizer_config.json")
    config = json.loads(config_text) if config_text else {}
    if config.get("chat_template") is not None:
        template = config["chat_template"]
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            return {str(t["name"]): str(t["template"]) for t in template if isinstance(t, Mapping)}
        return str(template)
    if (text := read("chat_template.json")) is not None:
        template = json.loads(text).get("chat_template")
        if template is not None:
            return template if isinstance(template, str) else dict(template)
    return None


class Tokenizer:
    """A model's tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.config: dict[str, Any] = dict(config or {})
        self.generation_config: dict[str, Any] = dict(generation_config or {})

        self._special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            content = _token_content(self.config.get(key))
            if content is not None:
                self._special_tokens[key] = content
        self.additional_special_tokens: list[str] = [
            c for c in (_token_content(t) for t in self.config.get("additional_special_tokens") or []) if c
        ]

        added = self._tok.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.added_token_ids: frozenset[int] = frozenset(added)

        template = chat_template if chat_template is not None else self.config.get("chat_template")
        self._templates: dict[str, str] = {}
        if isinstance(template, str):
            self._templates["default"] = template
        elif isinstance(template, Mapping):  # {name: template}
            self._templates.update({str(k): str(v) for k, v in template.items()})
        elif isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            for entry in template:
                if isinstance(entry, Mapping) and "name" in entry and "template" in entry:
                    self._templates[str(entry["name"])] = str(entry["template"])

        self.add_bos_token: bool = bool(self.config.get("add_bos_token", False))
        self.add_eos_token: bool = bool(self.config.get("add_eos_token", False))
        self.clean_up_tokenization_spaces: bool = bool(self.config.get("clean_up_tokenization_spaces", False))
        max_len = self.config.get("model_max_length")
        self.model_max_length: int | None = int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 else None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_strings(
        cls,
        tokenizer_json: str,
        tokenizer_config_json: str | None = None,
        generation_config_json: str | None = None,
        chat_template: str | Mapping[str, str] | None = None,
    ) -> Tokenizer:
        """From the texts of ``tokenizer.json`` and ``tokenizer_config.json`` (the config may be empty)."""
        try:
            tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
            raise ValueError(f"invalid tokenizer.json: {exc}") from exc
        config = json.loads(tokenizer_config_json) if tokenizer_config_json and tokenizer_config_json.strip() else {}
        gen = (
            json.loads(generation_config_json)
            if generation_config_json and generation_config_json.strip()
            else {}
        )
        return cls(tok, config, gen, chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json (only fast tokenizers are supported)")

        def read(name: str) -> str | None:
            p = root / name
            return p.read_text(encoding="utf-8") if p.is_file() else None

        config_text = read("tokenizer_config.json")
        config = json.loads(config_text) if config_text else {}
        return cls.from_strings(tok_file.read_text(encoding="utf-8"), json.dumps(config),
                                read("generation_config.json"), read_chat_template(root))

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    # -- vocabulary -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(tokenizer)`` in transformers)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token covers (``sluice.text.chars_per_token``): a text of ``C``
        characters is at least ``ceil(C / L)`` tokens. None when no bound is proven for this
        tokenizer. Computed once (it reads the whole vocabulary)."""
        return max_chars_per_token(spec_of(self._tok))

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    # -- special tokens -------------------------------------------------------------------------

    def _special_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def special_tokens_map(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._special_tokens)
        if self.additional_special_tokens:
            out["additional_special_tokens"] = list(self.additional_special_tokens)
        return out

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        tid = self._special_id("eos_token")
        if tid is None:
            ids = _ids(self.generation_config.get("eos_token_id"))
            return ids[0] if ids else None
        return tid

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's EOS, then generation_config's, in order."""
        out: list[int] = []
        for tid in [self._special_id("eos_token"), *_ids(self.generation_config.get("eos_token_id"))]:
            if tid is not None and tid not in out:
                out.append(tid)
        return out

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_ids)

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._specials(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, add_special_tokens)

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode`, the same ids, with Python's GIL released while the text is tokenized
        (``tokenizers`` releases it in ``encode_batch`` only): other threads, an event loop among
        them, run meanwhile."""
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._specials(ids, add_special_tokens)

    def _specials(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        """The BOS / EOS ``tokenizer_config.json`` asks for and the post-processor did not add."""
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
                ids = [*ids, eos]
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        if self.add_bos_token or self.add_eos_token:
            return [self.encode(t, add_special_tokens) for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = _clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    # -- chat -----------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template text (``None`` when the model has none)."""
        return self._templates.get("default") or next(iter(self._templates.values()), None)

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """HF's choice: an explicit template text or name, else ``tool_use`` when tools are given, else the default."""
        if chat_template is not None:
            return self._templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        template = self.chat_template
        if template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt to /v1/completions")
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the conversation (a ``ValueError`` on template errors); ids when ``tokenize``."""
        special: dict[str, Any] = dict(self._special_tokens)
        special["additional_special_tokens"] = list(self.additional_special_tokens)
        text = render_chat_template(
            self.get_chat_template(chat_template, tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=continue_final_message,
            special_tokens=special,
            **kwargs,
        )
        if tokenize:
            # The template writes its own special tokens, as transformers does.
            return self.encode(text, add_special_tokens=False)
        return text
