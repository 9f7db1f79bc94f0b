"""Tiny random-initialised model pairs with a real (small) tokenizer, saved in HF format.

Tests use them, and `specserve make-tiny-pair DIR` writes one for trying the CLI with no
trained models. Random models agree only by chance: use them for exactness, not speed.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
# a ChatML-style chat template, so the tiny pairs serve /v1/chat/completions too
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on this file's own source (always present, no download)."""
    with open(__file__, encoding="utf-8") as f:
        text = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def tiny_model(arch: str, vocab_size: int, seed: int, hidden: int = 32, layers: int = 2,
               eos_token_id: int | None = None, initializer_range: float = 0.2, max_positions: int = 512):
    """A random causal LM. A large initializer_range makes its distributions peaked, so greedy
    ties are rare and the exactness tests compare real decisions."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, initializer_range=initializer_range, eos_token_id=eos_token_id,
                  bos_token_id=eos_token_id, pad_token_id=eos_token_id)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=2 * hidden, max_position_embeddings=max_positions, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_positions, **common)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    return model.eval()


def make_tiny_pair(out_dir: str, seed: int = 0, vocab_size: int = 300) -> tuple[str, str]:
    """Writes out_dir/target (Llama, 4 layers) and out_dir/drafter (Llama, 1 layer), same tokenizer
    (with a chat template)."""
    tok = tiny_tokenizer(vocab_size)
    tok.chat_template = CHAT_TEMPLATE
    eos = tok.convert_tokens_to_ids(EOS)
    paths = []
    for name, hidden, layers, s in (("target", 64, 4, seed), ("drafter", 32, 1, seed + 1)):
        path = os.path.join(out_dir, name)
        tiny_model("llama", len(tok), s, hidden=hidden, layers=layers, eos_token_id=eos).save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
