"""LLM-as-judge reward: asks an OpenAI-compatible endpoint to grade a completion from 0 to 10.

Runs in its own sandbox with `network: true` and the API key passed through `secrets`; the base URL and model
come from plain `env`. Async, so many samples are judged concurrently inside the sandbox.
"""

import os
import re

from openai import AsyncOpenAI

_client = None


def client() -> AsyncOpenAI:
    global _client
    if _client is None:
        _client = AsyncOpenAI(
            base_url=os.environ["JUDGE_BASE_URL"],
            api_key=os.environ["JUDGE_API_KEY"],
            timeout=float(os.environ.get("JUDGE_TIMEOUT_S", "10")),
            max_retries=0,  # rewardbox's timeouts and fallbacks handle failures
        )
    return _client


async def judge(prompt, completion, example):
    reply = await client().chat.completions.create(
        model=os.environ.get("JUDGE_MODEL", "gpt-4o-mini"),
        messages=[
            {"role": "system", "content": "Grade the answer from 0 to 10. Reply with 'Score: N'."},
            {"role": "user", "content": f"Question: {prompt}\nReference: {example.get('answer', '')}\n"
                                        f"Answer: {completion}"},
        ],
        temperature=0,
    )
    text = reply.choices[0].message.content or ""
    match = re.search(r"Score:\s*(\d+(?:\.\d+)?)", text)
    if match is None:
        print(f"judge reply without a score: {text!r}")
        return None
    return float(match.group(1)) / 10.0
