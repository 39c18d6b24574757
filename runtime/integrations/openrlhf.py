"""OpenRLHF: its remote reward protocol, scored in rewardbox sandboxes.

OpenRLHF (``--remote_rm_url``) asks for rewards in batches of ``query`` (the decoded prompt and response, special
tokens kept), ``prompts`` (the templated prompt) and ``labels`` (the dataset's label column), one rollout per call
and many at once, either over HTTP (``rewardbox serve CONFIG --openrlhf HOST:PORT``, :mod:`..serve.openrlhf`) or
from a Python file whose ``reward_func(queries, prompts, labels)`` it calls in a thread. For the file route, a
file of one line::

    from rewardbox.integrations.openrlhf import reward_func

with the rewardbox config in ``REWARDBOX_CONFIG``; the config's sandboxes start on the first call in each process
and stop when it exits.

Every reward of the config scores every rollout. Sample style: ``prompt`` is ``prompts[i]``, ``completion`` the
response (``query[i]`` past ``prompts[i]`` where the query starts with it, else the whole query) and ``example``
``{"label": labels[i]}`` (as a string); batch style: ``prompts``, ``completions`` and ``label`` as lists. The
answer, as OpenRLHF's own reward server gives it: ``rewards`` (the weighted sum of the rewards' values, one per
query), ``scores`` (the same) and ``extra_logs`` (each reward's value, NaN for ``None``, and ``<reward>_fallback``,
1.0 where its ``default_score`` stood in), each a list in query order. Concurrent calls are scored in batches
(:class:`.batching.Gatherer`); a reward that fails gives its ``default_score``, as everywhere.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from .batching import Gatherer, started

CONFIG_ENV = "REWARDBOX_CONFIG"


class ProtocolError(ValueError):
    """A request that does not follow OpenRLHF's reward protocol (the message names the field)."""


def rows(queries: Any, prompts: Any = None, labels: Any = None) -> list[dict]:
    """One row (:mod:`.batching`) per query.

    Raises:
        ProtocolError: ``query`` is not a list of strings, or ``prompts``/``labels`` are not lists of its length.
    """
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ProtocolError('"query" must be a list of strings (the decoded prompt and response of each rollout)')
    n = len(queries)
    prompts = [""] * n if prompts is None else prompts
    labels = [None] * n if labels is None else labels
    if not isinstance(prompts, list) or len(prompts) != n or not all(isinstance(p, str) for p in prompts):
        raise ProtocolError(f'"prompts" must be a list of {n} strings, one per query')
    if not isinstance(labels, list) or len(labels) != n:
        raise ProtocolError(f'"labels" must be a list of {n} values, one per query')
    for field, texts in (("query", queries), ("prompts", prompts)):
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: JSON carries it, UTF-8 (and protobuf) cannot
                raise ProtocolError(f'"{field}"[{i}] is not valid Unicode: {e.reason} at {e.start}') from None
    out = []
    for query, prompt, label in zip(queries, prompts, labels):
        completion = query[len(prompt):] if prompt and query.startswith(prompt) else query
        out.append({"prompt": prompt, "completion": completion, "columns": {"label": label}})
    return out


def answer(results: Sequence[dict]) -> dict:
    """OpenRLHF's answer for the rows' results, in order (the module docstring)."""
    totals = [r["score"] for r in results]
    extra: dict = {}
    for result in results:
        for key, value in result.items():
            if key != "score":
                extra.setdefault(key, []).append(value)
    return {"rewards": totals, "scores": list(totals), "extra_logs": extra}


async def score(gatherer: Gatherer, queries: Any, prompts: Any = None, labels: Any = None) -> dict:
    """The answer to one request: its rollouts scored with those of the requests around it.

    Raises:
        ProtocolError: the request breaks the protocol (see :func:`rows`).
    """
    results = await asyncio.gather(*(gatherer.submit(row) for row in rows(queries, prompts, labels)))
    return answer(results)


_loop: Optional[asyncio.AbstractEventLoop] = None
_loop_lock = threading.Lock()
_gatherers: dict[str, Gatherer] = {}


def _background_loop() -> asyncio.AbstractEventLoop:
    """One event loop in a thread of its own for the file route's calls (OpenRLHF calls reward_func in threads),
    so that concurrent calls gather into batches."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rewardbox-openrlhf", daemon=True).start()
            _loop = loop
        return _loop


def _config_path() -> str:
    value = os.environ.get(CONFIG_ENV)
    if not value:
        raise ValueError(f"rewardbox.integrations.openrlhf.reward_func needs its rewardbox config: set {CONFIG_ENV}="
                         "/path/to/rewardbox.yaml in the environment of OpenRLHF's processes (Ray's runtime_env "
                         "env_vars reach its workers)")
    return str(Path(value).resolve())


def reward_func(queries: list, prompts: list, labels: list) -> dict:
    """OpenRLHF's ``reward_func`` (the file route of ``--remote_rm_url``): its answer for these rollouts.

    Raises:
        ValueError: no config in REWARDBOX_CONFIG; ProtocolError for arguments outside the protocol; rewardbox's
        errors when the config's sandboxes cannot start.
    """
    path = _config_path()
    sandboxes = started(path)
    loop = _background_loop()
    gatherer = _gatherers.get(path)
    if gatherer is None:
        gatherer = _gatherers.setdefault(path, Gatherer(sandboxes))
    return asyncio.run_coroutine_threadsafe(score(gatherer, queries, prompts, labels), loop).result()
