"""A tiny causal LM with its own tokenizer and chat template, built locally: the offline default model.

Used by the quickstart and the tests where no model hub is reachable. It stands in for a small pretrained model:
after random initialisation it is briefly trained (seconds, on the CPU) on synthetic arithmetic chats whose
answers only sometimes use the full ``<think>...</think><answer>...</answer>`` format and are sometimes wrong,
so that GRPO has something to improve from the first step.
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
VERSION = 3  # bump when the model or tokenizer changes: it is part of the cache path
SYSTEM_PROMPTS = [
    None,
    "Think inside <think></think>, then give the number inside <answer></answer>.",
    "Answer the question.",
]
_QUESTIONS = [
    "What is {a} {op} {b}?",
    "Tom has {a} apples and buys {b} more. How many apples does Tom have?",
    "Sara has {a} pens and gives away {b}. How many pens does she have left?",
    "A box holds {a} rows of {b} eggs. How many eggs are in the box?",
]
_CORPUS = (
    "<answer> </answer> <think> </think> The answer is 0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ? . , "
    "What is how many apples does Tom have if he buys more and gives away some? Let me think step by step. "
    "Sara has pens and gives away. How many pens does she have left? A box holds rows of eggs. "
    "How many eggs are in the box? Answer the question. Think inside, then give the number inside."
)


def build_tiny_model(path: str | Path, seed: int = 0, warm_up: bool = True) -> Path:
    """Writes a tiny Llama-architecture model and tokenizer to ``path`` (idempotent) and returns the path.

    ``warm_up`` trains it briefly on synthetic chats (about 20 s on two cores); without it the weights are random.
    """
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
    if warm_up:
        _warm_up(model, tokenizer, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def synthetic_chats(n: int, seed: int = 0) -> list[list[dict]]:
    """Arithmetic chats; 40% fully formatted and right, 20% formatted with a possibly wrong answer, 20% only an
    <answer> tag, 20% plain text."""
    import random

    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        template = rng.choice(_QUESTIONS)
        op = "+" if "buys" in template else "-" if "gives" in template else "*" if "rows" in template \
            else rng.choice("+-*")
        a, b = rng.randint(2, 12), rng.randint(1, 9)
        a, b = max(a, b), min(a, b)
        c = a + b if op == "+" else a - b if op == "-" else a * b
        style = rng.random()
        if style < 0.4:
            answer = f"<think>{a} {op} {b} = {c}</think><answer>{c}</answer>"
        elif style < 0.6:
            answer = f"<think>{a} {op} {b}</think><answer>{c + rng.randint(-3, 3)}</answer>"
        elif style < 0.8:
            answer = f"<answer>{c}</answer>"
        else:
            answer = f"The answer is {c}."
        system = rng.choice(SYSTEM_PROMPTS)
        chat = [{"role": "system", "content": system}] if system else []
        chats.append([*chat, {"role": "user", "content": template.format(a=a, b=b, op=op)},
                      {"role": "assistant", "content": answer}])
    return chats


def _warm_up(model, tokenizer, seed: int, steps: int = 200, batch_size: int = 16, lr: float = 5e-3) -> None:
    """A few hundred next-token steps on synthetic chats (a stand-in for pretraining)."""
    import torch

    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in synthetic_chats(steps * batch_size // 4, seed)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(texts), (batch_size,), generator=generator).tolist()
        batch = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


# -- a tiny model that calls tools --------------------------------------------------------------------------------

TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
TOOL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_VERSION = 1  # bump when the tool model or its tokenizer changes


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def tool_chats(n: int, seed: int = 0) -> list[list[dict]]:
    """Chats in which the assistant calls ``add`` on the question's numbers, reads the result and answers."""
    import random

    rng = random.Random(seed)
    chats: list[list[dict]] = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        chats.append([{"role": "user", "content": f"What is {a} + {b}?"},
                      {"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "name": "add", "content": str(a + b)},
                      {"role": "assistant", "content": f"The answer is {a + b}."}])
    return chats


def build_tiny_tool_model(path: str | Path, seed: int = 0, steps: int = 100) -> Path:
    """Writes a tiny model that calls tools, and its tokenizer, to ``path`` (idempotent) and returns the path.

    The tokenizer carries TRL's Qwen3 chat template (which TRL parses tool calls with) and its tokens; the model is
    trained briefly (about 15 s on two cores) on :func:`tool_chats`, so that it answers "What is a + b?" with a
    ``<tool_call>`` to ``add`` (its own numbers, not always the question's) that TRL executes.
    """
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    chats = tool_chats(50 + steps * 4, seed)
    bpe = ByteLevelBPETokenizer()
    bootstrap = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    bootstrap.chat_template = qwen3_chat_template
    texts = [bootstrap.apply_chat_template(c, tools=[add], tokenize=False) for c in chats]
    bpe.train_from_iterator(texts[:50], vocab_size=400, min_frequency=1, special_tokens=TOOL_SPECIAL,
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>")
    tokenizer.add_tokens(TOOL_TOKENS)
    tokenizer.chat_template = qwen3_chat_template
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(texts), (16,), generator=generator).tolist()
        batch = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
