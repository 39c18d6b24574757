"""Runs under the interpreter that has verl (.venv-verl, made by scripts/setup.sh): verl's own reward loading
(`get_custom_reward_fn`) and reward manager (`NaiveRewardManager.run_single`, as verl's reward loop calls it for
every sample of a batch at once) score through rewardbox.integrations.verl. Prints one JSON line of results.

    python verl_check.py REWARDBOX_CONFIG TOKENIZER_DIR
"""

import asyncio
import json
import sys

import numpy as np
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl import DataProto
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.trainer.ppo.reward import get_custom_reward_fn

ANSWERS = ["<answer>4</answer>", "<answer>5</answer>", "4", "crash", "<answer>7</answer>", "no answer at all"]
TRUTHS = ["4", "4", "4", "4", "7", "7"]


def one_sample(tokenizer, answer: str, truth: str, index: int) -> DataProto:
    prompt = tokenizer("What is it?", return_tensors="pt")["input_ids"][0]
    response = tokenizer(answer, return_tensors="pt")["input_ids"][0]
    ids = torch.cat([prompt, response])[None]
    return DataProto.from_dict(
        tensors={"prompts": prompt[None], "responses": response[None], "input_ids": ids,
                 "attention_mask": torch.ones_like(ids)},
        non_tensors={"data_source": np.array(["arith"], dtype=object),
                     "reward_model": np.array([{"ground_truth": truth}], dtype=object),
                     "extra_info": np.array([{"index": index, "split": "train"}], dtype=object)})


async def main(config_path: str, tokenizer_dir: str) -> None:
    config = OmegaConf.create({"reward": {
        "custom_reward_function": {"path": "pkg://rewardbox.integrations.verl", "name": "compute_score",
                                   "reward_kwargs": {"config": config_path}},
        "reward_manager": {"name": "naive", "source": "register"}}})
    compute_score = get_custom_reward_fn(config)  # verl's own loader
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    manager = NaiveRewardManager(config, tokenizer, compute_score)
    samples = [one_sample(tokenizer, a, t, i) for i, (a, t) in enumerate(zip(ANSWERS, TRUTHS))]
    results = await asyncio.gather(*(manager.run_single(s) for s in samples))  # as verl's reward loop does
    decoded = [tokenizer.decode(s.batch["responses"][0], skip_special_tokens=True) for s in samples]
    print("RESULTS " + json.dumps({"decoded": decoded, "results": [
        {"score": r["reward_score"], **{k: (None if isinstance(v, float) and v != v else v)
                                        for k, v in r["reward_extra_info"].items()}} for r in results]}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
