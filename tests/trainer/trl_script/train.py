"""A plain TRL GRPO script, as users write them; `--sandboxed` changes one line: its reward_funcs run in rewardbox
sandboxes. Prints the trainer's log history as JSON. Used by tests/trainer/test_dropin_fidelity.py.

    python train.py MODEL OUTPUT_DIR STEPS [--sandboxed BASE_IMAGE]
"""

import json
import sys

from datasets import Dataset
from my_rewards import digit_share, get_length_reward
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import accuracy_reward


TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def has_a_tag(completions, **kwargs):
    """Defined in the script itself (its module is __main__)."""
    return [float(any(tag in c[0]["content"] for tag in TAGS)) for c in completions]


def main() -> None:
    model, output_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "solution": f"${a + b}$"}
        for a in range(4) for b in range(4)
    ])
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=12, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
                      learning_rate=5e-3, save_strategy="no", seed=0, temperature=1.0)
    reward_funcs = [has_a_tag, digit_share, get_length_reward(8, scale=0.5), accuracy_reward]

    def train(funcs):
        trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=dataset)
        trainer.train()
        return trainer.state.log_history

    if "--sandboxed" in sys.argv:
        import rewardbox

        base_image = sys.argv[sys.argv.index("--sandboxed") + 1]
        with rewardbox.sandboxed(reward_funcs, packages=["math-verify"],
                                 sandbox={"docker": {"base_image": base_image}}) as sandboxed_funcs:
            history = train(sandboxed_funcs)
    else:
        history = train(reward_funcs)
    print("HISTORY " + json.dumps(history))


if __name__ == "__main__":
    main()
