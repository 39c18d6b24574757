"""The run record: every completion of a run with each reward's score, status, error, own output and latency, in
one SQLite file in the output directory (``record.sqlite``), for ``rewardbox report`` and for anyone's own queries.

``rewardbox train`` writes it; any ``GRPOTrainer`` whose ``reward_funcs`` come from :class:`~rewardbox.RewardSandboxes`
writes it with one callback::

    trainer = GRPOTrainer(..., reward_funcs=sandboxes.rewards, callbacks=[RunRecordCallback(sandboxes)])

TRL calls every reward function with the same batch; once each has answered, the batch is complete and its rows
(with the weighted total and the group advantage, computed as GRPO does) go to a writer thread, which commits them
in one transaction: the training thread never waits on the disk. The file is in WAL mode, so ``rewardbox report``
reads it while training writes. Ranks of one run write the same file (SQLite serialises their transactions).

Schema (version :data:`SCHEMA_VERSION`, in ``meta``):

- ``meta(key, value)``: ``schema_version``, ``created``, ``num_generations``;
- ``rewards(name, weight, position)``: the run's rewards, in the trainer's order;
- ``versions(reward, version, digest, first_step)``: each version of a reward's file (``v1``, ``v2``, ... in the
  order they appeared; ``digest`` is the SHA-256 of the file, 12 hex digits);
- ``prompts(id, text, messages, columns, tokens, first_step)``: ``id`` is a content hash of the prompt (stable
  across steps and epochs); ``messages`` the conversation as JSON for conversational data; ``columns`` the row's
  other columns as JSON; ``tokens`` its length in tokens where a tokenizer was given;
- ``completions(id, step, epoch, rank, batch, position, prompt_id, text, messages, tokens, total, advantage, time)``:
  ``id`` is the rank in its top 24 bits and a counter below; ``batch`` numbers the reward calls of a rank,
  ``position`` the completion's place in it;
- ``scores(completion_id, reward, step, version, value, status, error, logs, latency_s)``: ``step`` repeats the
  completion's (the graphs aggregate scores without a join); ``value`` after fallbacks (what training used), ``status``
  as the sandbox reported it, ``error`` its full traceback, ``logs`` what the reward printed for that sample alone
  (isolation ``sample``/``process``; "" where it ran with others), ``latency_s`` how long the reward took on it as its
  sandbox measured (the same isolation levels; batch style: the whole call; else NULL);
- ``calls(rank, batch, reward, step, logs, latency_s, attempts)``: each reward call, with what it printed as a whole
  and how long it took;
- ``tool_calls(completion_id, position, step, name, arguments, shown, status, error, latency_s)``: each tool call of
  a completion (TRL's tools and environment methods), in the order made: ``arguments`` as JSON, ``shown`` what the
  model was shown (the result, or ``{'error': ...}``; NULL for a call left unanswered), ``status`` how it ended
  (``ok``, ``error``, ``timeout``, ``crash``, ...), ``error`` rewardbox's text for a call the sandbox ended (it names
  the limit), ``latency_s`` the call's time on the host (sandboxed calls only: :mod:`rewardbox.report.tool_calls`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import queue
import sqlite3
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..scoring.samples import TRL_RESERVED
from . import tool_calls

log = logging.getLogger("rewardbox")

SCHEMA_VERSION = 1
FILENAME = "record.sqlite"
RANK_SHIFT = 40  # completion ids: rank << 40 | a counter of that rank's completions
SCALE_EPSILON = 1e-4  # TRL's: advantages are (total - group mean) / (group std + 1e-4)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rewards (name TEXT PRIMARY KEY, weight REAL NOT NULL, position INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    reward TEXT NOT NULL, version TEXT NOT NULL, digest TEXT NOT NULL, first_step INTEGER,
    PRIMARY KEY (reward, version));
CREATE TABLE IF NOT EXISTS prompts (
    id TEXT PRIMARY KEY, text TEXT NOT NULL, messages TEXT, columns TEXT NOT NULL, tokens INTEGER,
    first_step INTEGER);
CREATE TABLE IF NOT EXISTS completions (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, epoch REAL, rank INTEGER NOT NULL, batch INTEGER NOT NULL,
    position INTEGER NOT NULL, prompt_id TEXT NOT NULL REFERENCES prompts(id), text TEXT NOT NULL, messages TEXT,
    tokens INTEGER, total REAL, advantage REAL, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS scores (
    completion_id INTEGER NOT NULL REFERENCES completions(id), reward TEXT NOT NULL, step INTEGER NOT NULL,
    version TEXT NOT NULL, value REAL, status TEXT NOT NULL, error TEXT, logs TEXT NOT NULL, latency_s REAL,
    PRIMARY KEY (completion_id, reward)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS calls (
    rank INTEGER NOT NULL, batch INTEGER NOT NULL, reward TEXT NOT NULL, step INTEGER NOT NULL, logs TEXT NOT NULL,
    latency_s REAL, attempts INTEGER, PRIMARY KEY (rank, batch, reward)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tool_calls (
    completion_id INTEGER NOT NULL REFERENCES completions(id), position INTEGER NOT NULL, step INTEGER NOT NULL,
    name TEXT NOT NULL, arguments TEXT NOT NULL, shown TEXT, status TEXT NOT NULL, error TEXT, latency_s REAL,
    PRIMARY KEY (completion_id, position)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS completions_step ON completions(step);
CREATE INDEX IF NOT EXISTS completions_prompt ON completions(prompt_id, step);
CREATE INDEX IF NOT EXISTS scores_status ON scores(reward, status, value);
CREATE INDEX IF NOT EXISTS scores_step ON scores(reward, step, value, status);
"""


def connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    """A connection to a record: read-only (``rewardbox report``) or the writer's (WAL, waits for other ranks)."""
    if readonly:
        db = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False,
                             timeout=5)
        db.execute("PRAGMA query_only=ON")
    else:
        db = sqlite3.connect(path, check_same_thread=False, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
    db.row_factory = sqlite3.Row
    return db


def file_digest(path: Optional[Path]) -> Optional[str]:
    """The SHA-256 of a file (hex), or None when it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None
    except OSError:
        return None


def _text(value: Any) -> tuple[str, Optional[str]]:
    """(text, messages as JSON or None) of a prompt or completion: a string, or a conversation."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) for m in value):
        messages = json.dumps(list(value), ensure_ascii=False, default=str)
        if len(value) == 1:
            return str(value[0].get("content", "")), messages
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value), messages
    return str(value), None


def prompt_id(text: str, messages: Optional[str]) -> str:
    return hashlib.sha256((messages or text).encode("utf-8", "replace")).hexdigest()[:12]


def totals_and_advantages(rows: list, weights: list, group: int) -> tuple[list, list]:
    """GRPO's weighted total per completion (None counts as 0, as TRL's nansum does; all None: None) and its
    advantage within its group of ``group`` consecutive completions (None when the batch does not split into
    groups)."""
    totals = []
    for values in rows:
        present = [w * v for w, v in zip(weights, values) if v is not None and not math.isnan(v)]
        total = sum(present) if present else None
        totals.append(total if total is None or math.isfinite(total) else None)  # 1e308 * 2: no total
    advantages: list = [None] * len(totals)
    if group > 1 and totals and len(totals) % group == 0:
        for start in range(0, len(totals), group):
            block = [t if t is not None else 0.0 for t in totals[start:start + group]]
            try:
                mean, std = statistics.fmean(block), statistics.stdev(block)
            except (OverflowError, ValueError):  # totals too large to square: no advantage for this group
                continue
            for k, total in enumerate(block):
                advantages[start + k] = (total - mean) / (std + SCALE_EPSILON)
    return totals, advantages


class RunRecorder:
    """Collects each reward's report of a batch and writes complete batches on a thread of its own.

    ``rewards``: (name, weight) in the trainer's order. ``versions``: each reward's file digest at the start.
    """

    def __init__(self, path: Path, rewards: Sequence[tuple], num_generations: int, rank: int = 0,
                 tokenizer: Any = None, versions: Optional[dict] = None):
        self.path = Path(path)
        self.names = [name for name, _ in rewards]
        self.weights = [float(weight) for _, weight in rewards]
        self.group = int(num_generations)
        self.rank = rank
        self.tokenizer = tokenizer
        self._pending: dict = {}  # batch key -> {reward name: its part}
        self._seen_prompts: set = set()
        self._versions: dict = {}  # name -> (label, digest)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = connect(self.path)
        self._db.executescript(SCHEMA)
        with self._db:
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('created', ?)", (str(time.time()),))
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('num_generations', ?)", (str(self.group),))
            self._db.executemany("INSERT OR REPLACE INTO rewards VALUES (?, ?, ?)",
                                 [(n, w, i) for i, (n, w) in enumerate(zip(self.names, self.weights))])
            # Another run (a resumed one) may have written here: go on after what this rank wrote.
            last_id, last_batch = self._db.execute(
                "SELECT MAX(id), MAX(batch) FROM completions WHERE rank = ?", (rank,)).fetchone()
            self._next_id = last_id + 1 if last_id is not None else rank << RANK_SHIFT
            self._batches = last_batch + 1 if last_batch is not None else 0
        for name, digest in (versions or {}).items():
            self.new_version(name, digest, 0)
        self._writer = threading.Thread(target=self._write_loop, name="rewardbox-record", daemon=True)
        self._writer.start()

    # -- what the trainer's rewards report ------------------------------------------------------------------------
    def new_version(self, name: str, digest: Optional[str], step: Optional[int]) -> None:
        """A reward's file changed (and loaded) at ``step``: later scores carry its next version label. ``digest``:
        the file's SHA-256 (kept to 12 hex digits)."""
        digest = (digest or "")[:12]
        with self._lock:
            current = self._versions.get(name)
            if current is not None and current[1] == digest:
                return
            label = f"v{int(current[0][1:]) + 1}" if current is not None else "v1"
            self._versions[name] = (label, digest)
        self._queue.put(("version", (name, label, digest, step)))

    def observe(self, name: str, report, trainer_state: Any, prompts: Sequence[Any], completions: Sequence[Any],
                columns: dict, completion_ids: Optional[Sequence[Sequence[int]]] = None) -> None:
        """One reward's report of a batch (from :class:`~rewardbox.api.reward.SandboxedReward`)."""
        step = int(getattr(trainer_state, "global_step", 0) or 0)
        # The same batch, whichever reward reports it (TRL passes every reward the same lists; callers of their
        # own may pass copies): its step and its completions.
        key = (step, len(completions), hash(tuple(c if isinstance(c, str) else repr(c) for c in completions)))
        with self._lock:
            version = self._versions.get(name, ("v1", ""))[0]
            parts = self._pending.setdefault(key, {})
            parts[name] = (report, version)
            if any(n not in parts for n in self.names):
                return
            del self._pending[key]
            batch = self._batches
            self._batches += 1
            first_id = self._next_id
            self._next_id += len(completions)
            # A batch another reward never completed (an exception in TRL) is dropped when a later step starts.
            for stale in [k for k in self._pending if k[0] < step]:
                del self._pending[stale]
        epoch = getattr(trainer_state, "epoch", None)
        self._queue.put(("batch", (step, epoch, batch, first_id, parts, list(prompts), list(completions),
                                   {k: list(v) for k, v in columns.items() if k not in TRL_RESERVED},
                                   None if completion_ids is None else [len(ids) for ids in completion_ids],
                                   time.time())))

    def close(self) -> None:
        """Writes what is queued and closes the file."""
        if self._writer.is_alive():
            self._queue.put(("stop", None))
            self._writer.join()
        self._db.close()

    def flush(self) -> None:
        """Waits until everything observed so far is committed."""
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()

    # -- the writer thread ----------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "flush":
                item.set()
                continue
            try:
                with self._db:
                    if kind == "version":
                        name, label, digest, step = item
                        self._db.execute("INSERT OR IGNORE INTO versions VALUES (?, ?, ?, ?)",
                                         (name, label, digest, step))
                    else:
                        self._write_batch(*item)
            except Exception:  # noqa: BLE001 - the record must never stop training
                log.exception("the run record could not write to %s", self.path)

    def _prompt_tokens(self, text: str) -> Optional[int]:
        if self.tokenizer is None:
            return None
        try:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a tokenizer that cannot take it: no length
            return None

    def _write_batch(self, step, epoch, batch, first_id, parts, prompts, completions, columns, lengths, when):
        n = len(completions)
        reports = [parts[name][0] for name in self.names]
        rows = [[r.values[i] if i < len(r.values) else None for r in reports] for i in range(n)]
        totals, advantages = totals_and_advantages(rows, self.weights, self.group)
        prompt_rows, completion_rows, score_rows, tool_rows = [], [], [], []
        for i in range(n):
            p_text, p_messages = _text(prompts[i])
            pid = prompt_id(p_text, p_messages)
            if pid not in self._seen_prompts:
                self._seen_prompts.add(pid)
                row_columns = json.dumps({k: v[i] for k, v in columns.items() if i < len(v)}, ensure_ascii=False,
                                         default=str)
                prompt_rows.append((pid, p_text, p_messages, row_columns, self._prompt_tokens(p_text), step))
            c_text, c_messages = _text(completions[i])
            cid = first_id + i
            completion_rows.append((cid, step, epoch, self.rank, batch, i, pid, c_text, c_messages,
                                    lengths[i] if lengths else None, totals[i], advantages[i], when))
            tool_rows += [(cid, position, step, *rest) for position, *rest in tool_calls.record_rows(completions[i])]
            for name in self.names:
                report, version = parts[name]
                own = report.sample_logs[i] if i < len(report.sample_logs) else ""
                took = report.sample_seconds[i] if i < len(report.sample_seconds) else None
                score_rows.append((cid, name, step, version, report.values[i], str(report.statuses[i]),
                                   report.errors[i], own, took))
        call_rows = [(self.rank, batch, name, step, parts[name][0].logs, parts[name][0].latency_s,
                      parts[name][0].attempts) for name in self.names]
        self._db.executemany("INSERT OR IGNORE INTO prompts VALUES (?, ?, ?, ?, ?, ?)", prompt_rows)
        self._db.executemany("INSERT INTO completions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             completion_rows)
        self._db.executemany("INSERT INTO scores VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", score_rows)
        self._db.executemany("INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?)", call_rows)
        self._db.executemany("INSERT INTO tool_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", tool_rows)
