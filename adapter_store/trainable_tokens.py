"""Trainable tokens, beside LoRA or alone: checked and packed for every rank.

PEFT trains only some rows of the embedding (and, when the model ties it, of the lm_head that
shares its weight; or of a separate lm_head it targets) and saves them as
`<module>.token_adapter.trainable_tokens_delta` [K, hidden] beside LoRA (LoraConfig's
`trainable_token_indices`: a list, the input embedding's ids; an object, ids per module name) or
`<module>.trainable_tokens_delta` alone (peft_type TRAINABLE_TOKENS, TrainableTokensConfig's
`token_indices`: one list for every targeted module; a tied lm_head's rows are saved too, equal to
the embedding's). They are the new rows themselves, which replace the base weight's rows of those
K token ids for that adapter's tokens only (executor/token_rows.py).

A shard carries them whole on every rank, whatever the layout (they are small):
"tokens.<embed|lm_head>.ids" [K] int32 and "tokens.<embed|lm_head>.rows" [K, hidden] float32.
Every check names the fault (INVALID_ARGUMENT).
"""

from __future__ import annotations

import re

import torch

from loraserve.errors import invalid

from .base_model import BaseModelSpec

MAX_TOKENS = 64  # trainable token ids per adapter an executor's slot holds (executor/token_rows.py)

CONFIG_KEY = "trainable_token_indices"
ALONE_KEY = "token_indices"  # peft_type TRAINABLE_TOKENS
SUFFIX = ".token_adapter.trainable_tokens_delta"
ALONE_SUFFIX = ".trainable_tokens_delta"
PREFIX = "base_model.model."
# which served weight a module's rows replace: the input embedding or a separate lm_head
TARGETS = {"embed": re.compile(r"(^|\.)(embed_tokens|wte|embed_in)$"), "lm_head": re.compile(r"(^|\.)(lm_head|embed_out)$")}


def split(tensors: dict[str, torch.Tensor], alone: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the other tensors, module -> its trainable token rows); alone: a TRAINABLE_TOKENS adapter's names."""
    suffix = ALONE_SUFFIX if alone else SUFFIX
    rest, rows = {}, {}
    for name, t in tensors.items():
        if name.endswith(suffix) and name.startswith(PREFIX):
            rows[name[len(PREFIX) : -len(suffix)]] = t
        else:
            rest[name] = t
    return rest, rows


def check(
    cfg: dict, rows: dict[str, torch.Tensor], spec: BaseModelSpec | None, lora_modules, sources: dict | None = None
) -> dict[str, tuple[list[int], torch.Tensor]]:
    """{"embed" | "lm_head": (token ids, rows [K, hidden] float32)} of an adapter; {} without trainable tokens.
    sources: a renamed module -> the adapter file's name for it (LoraSettings.module_sources), which the
    config's per-module keys match, as PEFT matched them."""
    sources = sources or {}
    alone = cfg.get("peft_type") == "TRAINABLE_TOKENS"
    key = ALONE_KEY if alone else CONFIG_KEY
    indices = cfg.get(key)
    if alone and (not isinstance(indices, list) or not indices):
        raise invalid(f"{key} of a TRAINABLE_TOKENS adapter must be a non-empty list of token ids >= 0, got {indices!r}")
    if not indices:
        if rows:
            raise invalid(f"module {sorted(rows)[0]!r} has trainable token rows but adapter_config.json sets no {key}")
        return {}
    if not rows:
        raise invalid(f"{key} is set but the weights hold no trainable_tokens_delta")
    out = {}
    for module, t in sorted(rows.items()):
        target = next((k for k, pattern in TARGETS.items() if pattern.search(module)), None)
        if target is None:
            raise invalid(f"trainable tokens on module {module!r} are not served (only the embedding and lm_head)")
        if target in out:
            raise invalid(f"trainable tokens on two {target} modules: {module!r} and another")
        if any(m == module or m.startswith(module + ".") for m in lora_modules):
            raise invalid(f"module {module!r} has both LoRA and trainable tokens: not served")
        ids = _ids(indices, sources.get(module, module), 1 if alone else len(rows), key)
        if len(ids) > MAX_TOKENS:
            raise invalid(f"{key} lists {len(ids)} token ids: at most {MAX_TOKENS} per adapter are served")
        if t.dim() != 2 or t.shape[0] != len(ids):
            raise invalid(f"module {module!r}: trainable_tokens_delta has shape {list(t.shape)}, {key} lists {len(ids)} ids")
        if spec is not None:
            if spec.hidden_size and t.shape[1] != spec.hidden_size:
                raise invalid(
                    f"module {module!r}: trainable token rows of {t.shape[1]} features, the base model has {spec.hidden_size}"
                )
            beyond = [i for i in ids if i >= spec.vocab_size] if spec.vocab_size else []
            if beyond:
                raise invalid(
                    f"{key}: token id {beyond[0]} is beyond base model {spec.name!r}'s vocabulary of {spec.vocab_size} "
                    "(tokens past it are not served)"
                )
        if not torch.isfinite(t).all():
            raise invalid(f"module {module!r}: trainable_tokens_delta holds NaN or Inf values")
        out[target] = (ids, t.float())
    if spec is not None and spec.tied_embeddings:
        _check_tied(out, spec, lora_modules)
    return out


def _check_tied(out: dict[str, tuple[list[int], torch.Tensor]], spec: BaseModelSpec, lora_modules) -> None:
    """A tied model's lm_head takes the embedding's rows, as PEFT ties them, unless the adapter has
    lm_head rows for other ids (PEFT ties neither then: each keeps its own). Tied rows must equal the
    embedding's, and an lm_head with LoRA cannot take them: PEFT wraps the token rows inside the
    lm_head's LoRA layer, so its logits for those ids are the replaced rows' plus the LoRA's, while a
    slot's lm_head rows replace those logits whole (executor/token_rows.py)."""
    if "embed" not in out or ("lm_head" in out and out["lm_head"][0] != out["embed"][0]):
        return
    if "lm_head" in out and not torch.equal(out["embed"][1], out["lm_head"][1]):
        raise invalid(
            f"base model {spec.name!r} ties lm_head to the embedding, but the adapter's lm_head trainable token rows "
            "differ from its embedding's for the same ids"
        )
    head = sorted(m for m in lora_modules if TARGETS["lm_head"].search(m))
    if head:
        raise invalid(
            f"module {head[0]!r} has LoRA and base model {spec.name!r} ties it to the embedding, whose trainable token "
            "rows it would take: LoRA on a tied lm_head with trainable tokens is not served"
        )


def _ids(indices, module: str, num_modules: int, key: str) -> list[int]:
    """The token ids of `module` from the config's list (the input embedding's, or, alone, every
    module's: num_modules 1) or object (by module name suffix)."""
    if isinstance(indices, dict):
        found = [v for k, v in indices.items() if isinstance(k, str) and re.search(rf"(^|\.){re.escape(k)}$", module)]
        if len(found) != 1:
            raise invalid(f"{key} has no single entry for module {module!r}: keys {sorted(map(str, indices))}")
        ids = found[0]
    else:
        if num_modules != 1:
            raise invalid(f"{key} is a list but {num_modules} modules have trainable token rows")
        ids = indices
    if not isinstance(ids, list) or not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise invalid(f"{key} of module {module!r} must be a non-empty list of token ids >= 0, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise invalid(f"{key} of module {module!r} lists a token id twice")
    return ids


def shard_tensors(tokens: dict[str, tuple[list[int], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The shard's tensors of an adapter's trainable tokens (the same on every rank)."""
    out = {}
    for target, (ids, rows) in tokens.items():
        out[f"tokens.{target}.ids"] = torch.tensor(ids, dtype=torch.int32)
        out[f"tokens.{target}.rows"] = rows.contiguous()
    return out
