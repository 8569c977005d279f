"""Write a tiny local HF checkpoint (random-init Llama + a word-level tokenizer, saved with ``save_pretrained``) and a
small jsonl text dataset, so that ``python -m cp_packing train --model DIR --data FILE`` can be tried (and tested)
without downloading anything.

    python launch/tiny_checkpoint.py /tmp/tiny-llama --data /tmp/tiny.jsonl

The tokenizer splits on whitespace over a fixed vocabulary of words (``[UNK]`` for any other), with ``</s>`` as
its end-of-sequence token; the dataset's documents count through the words in strides, so the loss has a pattern
to learn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

SPECIAL = ["<pad>", "[UNK]", "</s>"]
WORDS = [f"w{i}" for i in range(61)]  # 64 tokens in all


def write_tokenizer(out_dir: str):
    """A word-level ``PreTrainedTokenizerFast`` over ``WORDS``, saved to ``out_dir``; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    return fast


def write_model(out_dir: str, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                max_positions: int = 1024, seed: int = 0) -> None:
    """A random-init float32 Llama sized for the tokenizer's vocabulary, saved to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, attention_dropout=0.0, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(out_dir)


def write_text_jsonl(path: str, *, documents: int = 64, seed: int = 0) -> None:
    """``documents`` rows ``{"text": "w3 w6 w9 ..."}`` of long-tailed lengths (4 to ~200 words)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(documents):
            n = max(4, min(200, int(rng.lognormvariate(3.0, 0.8))))
            start, stride = rng.randrange(len(WORDS)), rng.randrange(1, 5)
            f.write(json.dumps({"text": " ".join(WORDS[(start + stride * i) % len(WORDS)] for i in range(n))}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python launch/tiny_checkpoint.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="the model directory to write (config, weights, tokenizer)")
    p.add_argument("--data", default=None, help="also write a jsonl text dataset here")
    p.add_argument("--documents", type=int, default=64, help="documents in --data (default 64)")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    write_model(args.out_dir)
    write_tokenizer(args.out_dir)
    print(f"wrote a tiny Llama and its tokenizer to {args.out_dir}")
    if args.data:
        write_text_jsonl(args.data, documents=args.documents)
        print(f"wrote {args.documents} text documents to {args.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
