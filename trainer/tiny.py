"""A tiny causal LM with its own tokenizer and chat template, built locally: the offline default model.

Used by the quickstart and the tests where no model hub is reachable. It learns nothing useful in a few steps,
but it generates, trains and saves like any Hugging Face model.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Reasoning-format tags as single ordinary tokens (kept when decoding), so that even an untrained model emits
# them now and then and format rewards vary within a GRPO group from the first step.
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
VERSION = 2  # bump when the model or tokenizer changes: it is part of the cache path
_CORPUS = (
    "<answer> </answer> <think> </think> The answer is 0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ? . , "
    "What is how many apples does Tom have if he buys more and gives away some? Let me think step by step."
)


def build_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Writes a tiny Llama-architecture model and tokenizer to ``path`` (idempotent) and returns the path."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([_CORPUS] * 4, vocab_size=300, min_frequency=1, special_tokens=SPECIAL, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|end|>"
    )
    tokenizer.add_tokens(TAGS)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
