#!/usr/bin/env python
"""A tiny random Llama that splits over 2 tensor-parallel ranks, and two PEFT adapters for it.

The default model (SmolLM2-135M, 9 attention heads / 3 kv heads) splits over tp 1, 3 or 9 only;
this one (8 heads / 2 kv heads, hidden 256, 2 layers, a byte-level tokenizer with a chat
template) splits over 2, 4 or 8, so `make up-tp2` can show a tp 2 executor on CPU in one command.
Its weights are random: its text is noise; what it shows is two ranks serving a mixed batch.

Usage:
    python tools/make_tiny_llama.py var/tiny-llama     # -> var/tiny-llama/model, var/tiny-llama/adapters/{qv8,mlp4}
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

BOS, EOS, PAD, VOCAB = 256, 257, 258, 260  # ids 0..255 are bytes
ADAPTERS = {"qv8": (8, ("q_proj", "v_proj")), "mlp4": (4, ("gate_proj", "up_proj", "down_proj"))}


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, then <s> </s> <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(path)


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    out = p.parse_args().out
    if (out / "model" / "config.json").is_file():
        print(f"{out}: already made")
        return
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out / "model")  # config.json + model.safetensors
    write_byte_tokenizer(out / "model")
    for seed, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
        with torch.no_grad():
            for n, param in peft.named_parameters():
                if "lora_B" in n:  # PEFT starts B at zero: an adapter that changes nothing
                    param.normal_(0, 0.2)
        peft.save_pretrained(out / "adapters" / name)
    print(f"{out}/model: Llama, 8 heads / 2 kv heads, random weights; adapters: {', '.join(ADAPTERS)}")


if __name__ == "__main__":
    main()
