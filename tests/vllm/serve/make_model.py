"""Writes a tiny random-weight Llama and its tokenizer into a directory, for
`vllm serve` on CPU in the tests (tests/support/vllm_serve.rs).

Made at test time with transformers and tokenizers, no download: a
word-level tokenizer over a small fixed vocabulary (vLLM loads it through
transformers' PreTrainedTokenizerFast, from tokenizer.json) and a 2-layer
Llama with hidden size 128 and 4 heads (head_dim 32: vLLM's CPU attention
needs head_dim >= 32), weights random with a fixed seed, saved as
safetensors in float32 (the `--dtype` the tests give `vllm serve`).

Usage: python make_model.py DIR
Prints one JSON line {"model": DIR, "vocab": N} when done.
"""

import json
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = [f"w{i}" for i in range(509)]


def main(out):
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out)
    print(json.dumps({"model": out, "vocab": len(vocab)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
