"""A thin wrapper over transformers' fast tokenizer: from an HF dir or from the vocab inside a GGUF file."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: set[int]):
        self.hf = hf_tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_pretrained(cls, model_dir) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (chat template); eos ids also from config/generation_config."""
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        eos = _ids(tok.eos_token_id)
        for name in ("generation_config.json", "config.json"):
            if (model_dir / name).is_file():
                eos |= _ids(json.loads((model_dir / name).read_text()).get("eos_token_id"))
        return cls(tok, eos)

    @classmethod
    def from_gguf(cls, gguf_path, cache_dir=None) -> "Tokenizer":
        """Vocab, merges and chat template from the GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template).

        Converting them takes seconds (transformers parses every GGUF field in Python), so with
        a cache_dir the converted tokenizer is saved there once, keyed by the GGUF file, and
        loaded from there on later starts. A cache that cannot be read or written is skipped.
        """
        from transformers import AutoTokenizer

        p = Path(gguf_path)
        cached = _cache_path(p, Path(cache_dir)) if cache_dir else None
        tok = None
        if cached is not None and (cached / "tokenizer.json").is_file():
            try:
                tok = AutoTokenizer.from_pretrained(str(cached))
            except Exception as exc:
                log.warning("tokenizer cache %s unreadable (%s); converting the GGUF's tokenizer again", cached, exc)
                shutil.rmtree(cached, ignore_errors=True)  # so the fresh conversion can take its place
        if tok is None:
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
            if cached is not None:
                _save(tok, cached)
        eos = _ids(tok.eos_token_id)
        eot = tok.convert_tokens_to_ids("<|eot_id|>") if "<|eot_id|>" in tok.get_vocab() else None
        return cls(tok, eos | _ids(eot))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template's text, ending with the assistant's generation prompt."""
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}] -> prompt ids."""
        if self.hf.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out  # v5 returns a BatchEncoding
        return list(ids)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Streams text as tokens arrive, holding back bytes of an unfinished UTF-8 character.

    Decodes a short window (from the previous emit point) instead of the whole sequence each time,
    so a leading-space or merge effect at the window start cannot change text already emitted.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = 0  # text of ids[prefix_offset:read_offset] has been emitted

    def push(self, token_id: int) -> str:
        """The new text that token_id completes ('' while a character is still incomplete)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        text = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""


def _cache_path(gguf: Path, cache_dir: Path) -> Path:
    """<cache_dir>/tokenizers/<key>: the key changes with the file (path, size, mtime) and transformers' version."""
    import transformers

    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_dir / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(tok, dest: Path) -> None:
    """Writes the tokenizer to a temporary folder, then renames it into place (atomic)."""
    tmp = dest.parent / f".tmp-{uuid.uuid4().hex}"
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, dest)
        log.info("tokenizer cached in %s", dest)
    except Exception as exc:
        log.info("tokenizer not cached in %s: %s", dest, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple, set)) else {int(value)}
