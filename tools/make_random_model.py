"""Writes a Llama-family Hugging Face model directory with random weights, for benchmarks.

Speed does not depend on the weights' values, so a benchmark can run a model of a real
model's shapes without its checkpoint: a CUDA host without a model hub cannot use the
embedded GGUF. Tokenizer files are copied from --tokenizer (e.g. the executor's cached
conversion of the SmolLM2 GGUF's tokenizer, var/cache/tokenizers/<key>/).

Usage: python tools/make_random_model.py --shape smollm2 --tokenizer DIR --out DIR
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

SHAPES = {
    # SmolLM2-135M-Instruct, as its GGUF describes it
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    # Llama-3-8B's layers (the vocabulary is the tokenizer's, see --vocab)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json (+ config, chat template)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (the tokenizer's ids must fit)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **SHAPES[args.shape],
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, args.dtype))  # built in the target dtype: no float32 copy of 8B
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(args.out)
    copied = [f for f in TOKENIZER_FILES if (args.tokenizer / f).is_file()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"{args.tokenizer} has no tokenizer.json")
    for f in copied:
        shutil.copy(args.tokenizer / f, args.out / f)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{args.out}: {args.shape}, {n / 1e6:.0f}M parameters, {args.dtype}, tokenizer {copied}, {time.perf_counter() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
