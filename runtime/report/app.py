"""``rewardbox report OUTPUT_DIR``: a local web app over a run record (:mod:`rewardbox.report.record`), live while
training writes it and usable after.

The server is the standard library's threading HTTP server: the app is a few read-only JSON queries over one
SQLite file, which needs no framework, and no dependency means nothing more to install or keep patched. Every
query pages and aggregates in SQLite (the browser never gets the whole record); the page is static files shipped
in the package, and the charts are plotly.js from the ``plotly`` package's own wheel (no CDN, no network).

Completions and what rewards print are hostile: the page only ever puts them into the document as text
(``textContent``), and every response carries a Content-Security-Policy that allows scripts from this server only.
The server binds loopback by default; any other address is refused unless a token is set, and then every request
must carry it (``?token=`` once, which sets a cookie, or ``Authorization: Bearer``). Only GET and HEAD are served:
nothing changes the record.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import mimetypes
import socket
import sqlite3
import statistics
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, urlsplit

from ..errors import ConfigError
from .record import FILENAME, SCHEMA_VERSION, connect

PAGE_LIMIT = 200
MAX_QUERY = 200  # characters of a text search
QUERY_DEADLINE_S = 5.0  # a query that runs longer is stopped (its request answers 503)
INT64 = 2 ** 63 - 1
EXPORT_LIMIT = 100_000
STATIC = {"/": "index.html", "/app.js": "app.js", "/app.css": "app.css"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
STATUSES = ("ok", "error", "timeout", "crash", "invalid", "unavailable")


class RecordError(Exception):
    """The record cannot be read (missing, or from another schema): the message says why and what to do."""


def find_record(path: Path) -> Path:
    """The record file of an output directory (or the file itself).

    Raises:
        RecordError: there is none.
    """
    path = Path(path)
    candidate = path / FILENAME if path.is_dir() else path
    if not candidate.is_file():
        raise RecordError(f"no run record at {candidate}: `rewardbox train` writes {FILENAME} in its output_dir "
                          "(a GRPOTrainer of your own: add rewardbox.trainer.callbacks.RunRecordCallback)")
    return candidate


class Record:
    """Read-only queries over one record. A connection per thread; each query sees one consistent snapshot (WAL)."""

    def __init__(self, path: Path):
        self.path = find_record(path)
        self._local = threading.local()
        self.check()

    def db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = connect(self.path, readonly=True)
        self._local.deadline = time.monotonic() + QUERY_DEADLINE_S
        db.set_progress_handler(lambda: int(time.monotonic() > self._local.deadline), 10_000)
        return db

    def rows(self, sql: str, params: tuple = ()) -> list[dict]:
        return [dict(row) for row in self.db().execute(sql, params).fetchall()]

    def check(self) -> None:
        try:
            found = self.db().execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.DatabaseError as e:
            raise RecordError(f"{self.path} is not a readable run record ({e})") from None
        if found is None or found[0] != str(SCHEMA_VERSION):
            raise RecordError(f"{self.path} has schema version {found[0] if found else 'none'}; this rewardbox "
                              f"reads version {SCHEMA_VERSION}: open it with the rewardbox that wrote it")

    # -- the views' queries ---------------------------------------------------------------------------------------
    def rewards(self) -> list[dict]:
        return self.rows("SELECT name, weight FROM rewards ORDER BY position")

    def versions(self) -> list[dict]:
        return self.rows("SELECT reward, version, digest, first_step FROM versions ORDER BY reward, first_step")

    def meta(self) -> dict:
        counts = self.db().execute("SELECT COUNT(*), COALESCE(MAX(step), -1), COUNT(DISTINCT prompt_id) "
                                   "FROM completions").fetchone()
        return {"record": str(self.path), "completions": counts[0], "last_step": counts[1], "prompts": counts[2],
                "rewards": self.rewards(), "versions": self.versions(),
                "num_generations": int((self.db().execute(
                    "SELECT value FROM meta WHERE key = 'num_generations'").fetchone() or ["1"])[0])}

    def graphs(self) -> dict:
        steps = self.rows("SELECT step, AVG(total) AS total, COUNT(*) AS n, "
                          "AVG(total * total) AS total_sq FROM completions GROUP BY step ORDER BY step")
        for row in steps:
            try:
                variance = max(0.0, (row.pop("total_sq") or 0.0) - (row["total"] or 0.0) ** 2)
                row["total_std"] = math.sqrt(variance * row["n"] / (row["n"] - 1)) if row["n"] > 1 else 0.0
            except OverflowError:
                row["total_std"] = None
            if not _finite(row["total_std"]):
                row["total_std"] = None
        per_reward = self.rows(
            "SELECT step, reward, AVG(value) AS mean, "
            + ", ".join(f"SUM(status = '{st}') AS {st}" for st in STATUSES)
            + ", COUNT(*) AS n FROM scores GROUP BY reward, step ORDER BY step")
        latency = self.rows("SELECT step, reward, AVG(latency_s) AS latency_s FROM calls GROUP BY step, reward "
                            "ORDER BY step")
        return {"steps": steps, "rewards": per_reward, "latency": latency, "versions": self.versions()}

    def prompts(self, q: str = "", sort: str = "last_step", order: str = "desc", offset: int = 0,
                limit: int = 50) -> dict:
        columns = {"id": "p.id", "text": "p.text", "tokens": "p.tokens", "completions": "completions",
                   "mean_total": "mean_total", "first_step": "first_step", "last_step": "last_step",
                   "steps": "steps"}
        key = columns.get(sort, "last_step")
        direction = "ASC" if order == "asc" else "DESC"
        where, params = ("WHERE p.text LIKE ? ESCAPE '\\' OR p.columns LIKE ? ESCAPE '\\' OR p.id = ?",
                         (like(q), like(q), q[:MAX_QUERY])) if q else ("", ())
        total = self.db().execute(f"SELECT COUNT(*) FROM prompts p {where}", params).fetchone()[0]
        rows = self.rows(
            "SELECT p.id, substr(p.text, 1, 400) AS text, p.tokens, p.columns, COUNT(c.id) AS completions, "
            "AVG(c.total) AS mean_total, MIN(c.step) AS first_step, MAX(c.step) AS last_step, "
            "COUNT(DISTINCT c.step) AS steps, GROUP_CONCAT(DISTINCT CAST(c.epoch AS INTEGER)) AS epochs "
            f"FROM prompts p JOIN completions c ON c.prompt_id = p.id {where} GROUP BY p.id "
            f"ORDER BY {key} {direction}, p.id LIMIT ? OFFSET ?", params + (limit, offset))
        return {"total": total, "rows": rows}

    def _scores_of(self, ids: list) -> dict:
        found: dict = {}
        for chunk in range(0, len(ids), 500):
            part = ids[chunk:chunk + 500]
            for row in self.rows("SELECT completion_id, reward, version, value, status, error, latency_s FROM scores "
                                 f"WHERE completion_id IN ({','.join('?' * len(part))})", tuple(part)):
                found.setdefault(row.pop("completion_id"), {})[row.pop("reward")] = row
        return found

    def _tool_calls_of(self, ids: list) -> dict:
        """Each completion's tool calls, in order (a record written before tool calls were recorded has none)."""
        found: dict = {}
        try:
            for chunk in range(0, len(ids), 500):
                part = ids[chunk:chunk + 500]
                for row in self.rows("SELECT completion_id, name, arguments, substr(shown, 1, 2000) AS shown, status, "
                                     "substr(error, 1, 2000) AS error, latency_s FROM tool_calls WHERE completion_id "
                                     f"IN ({','.join('?' * len(part))}) ORDER BY completion_id, position",
                                     tuple(part)):
                    found.setdefault(row.pop("completion_id"), []).append(row)
        except sqlite3.OperationalError:  # no such table
            return {}
        return found

    def _with_scores(self, rows: list) -> list:
        ids = [r["id"] for r in rows]
        scores, tools = self._scores_of(ids), self._tool_calls_of(ids)
        for r in rows:
            r["scores"] = scores.get(r["id"], {})
            r["tool_calls"] = tools.get(r["id"], [])
        return rows

    def prompt(self, prompt_id: str) -> dict:
        prompt = self.rows("SELECT * FROM prompts WHERE id = ?", (prompt_id,))
        if not prompt:
            return {"error": f"no prompt {prompt_id!r} in this record"}
        completions = self.rows("SELECT id, step, epoch, rank, text, tokens, total, advantage FROM completions "
                                "WHERE prompt_id = ? ORDER BY step, id", (prompt_id,))
        return {"prompt": prompt[0], "completions": self._with_scores(completions)}

    def _filters(self, params: dict) -> tuple[str, tuple]:
        clauses: list[str] = []
        values: list[object] = []
        if params.get("q"):
            clauses.append("c.text LIKE ? ESCAPE '\\'")
            values.append(like(params["q"]))
        if params.get("step") not in (None, ""):
            clauses.append("c.step = ?")
            values.append(_bounded(int(params["step"])))
        for bound, op in (("min_total", ">="), ("max_total", "<=")):
            if params.get(bound) not in (None, ""):
                clauses.append(f"c.total {op} ?")
                values.append(float(params[bound]))
        if params.get("reward") or params.get("status"):
            sub = ["s.completion_id = c.id"]
            sub_values: list[object] = []
            if params.get("reward"):
                sub.append("s.reward = ?")
                sub_values.append(params["reward"])
            if params.get("status"):
                sub.append("s.status = ?")
                sub_values.append(params["status"])
            clauses.append(f"EXISTS (SELECT 1 FROM scores s WHERE {' AND '.join(sub)})")
            values += sub_values
        if params.get("ids"):
            ids = [_bounded(int(i)) for i in str(params["ids"]).split(",")[:PAGE_LIMIT * 5] if i.strip().isdigit()]
            clauses.append(f"c.id IN ({','.join('?' * len(ids)) or 'NULL'})")
            values += ids
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", tuple(values)

    def completions(self, params: dict, offset: int = 0, limit: int = 50) -> dict:
        where, values = self._filters(params)
        total = self.db().execute(f"SELECT COUNT(*) FROM completions c {where}", values).fetchone()[0]
        rows = self.rows("SELECT c.id, c.step, c.epoch, c.prompt_id, substr(p.text, 1, 200) AS prompt, "
                         "substr(c.text, 1, 2000) AS text, c.tokens, c.total, c.advantage FROM completions c "
                         f"JOIN prompts p ON p.id = c.prompt_id {where} ORDER BY c.id DESC LIMIT ? OFFSET ?",
                         values + (limit, offset))
        return {"total": total, "rows": self._with_scores(rows)}

    def logs(self, params: dict, offset: int = 0, limit: int = 50) -> dict:
        clauses, values = [], []
        for name, column in (("reward", "s.reward"), ("status", "s.status")):
            if params.get(name):
                clauses.append(f"{column} = ?")
                values.append(params[name])
        if params.get("step") not in (None, ""):
            clauses.append("c.step = ?")
            values.append(_bounded(int(params["step"])))
        if params.get("q"):
            clauses.append("(s.logs LIKE ? ESCAPE '\\' OR s.error LIKE ? ESCAPE '\\' OR k.logs LIKE ? ESCAPE '\\')")
            values += [like(params["q"])] * 3
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        base = ("FROM scores s JOIN completions c ON c.id = s.completion_id "
                "LEFT JOIN calls k ON k.rank = c.rank AND k.batch = c.batch AND k.reward = s.reward")
        total = self.db().execute(f"SELECT COUNT(*) {base} {where}", tuple(values)).fetchone()[0]
        rows = self.rows("SELECT c.id, c.step, c.prompt_id, s.reward, s.version, s.value, s.status, s.error, "
                         "s.latency_s, "
                         "s.logs AS own_logs, substr(k.logs, 1, 20000) AS call_logs, "
                         f"substr(c.text, 1, 300) AS text {base} {where} ORDER BY c.id DESC, s.reward "
                         "LIMIT ? OFFSET ?", tuple(values) + (limit, offset))
        return {"total": total, "rows": rows}

    def signals(self) -> list[dict]:
        """Patterns a person would otherwise hunt for; each names the completions concerned (at most 500 ids)."""
        found = []
        rewards = [r["name"] for r in self.rewards()]
        bounds = {}
        for name in rewards:  # each MIN and MAX is one look-up in the (reward, status, value) index
            lo = self.db().execute("SELECT MIN(value) FROM scores WHERE reward = ? AND status = 'ok'", (name,))
            hi = self.db().execute("SELECT MAX(value) FROM scores WHERE reward = ? AND status = 'ok'", (name,))
            bounds[name] = (lo.fetchone()[0], hi.fetchone()[0])
            if bounds[name][0] is None:
                del bounds[name]
        for a in rewards:
            for b in rewards:
                if a == b or a not in bounds or b not in bounds or bounds[a][0] == bounds[a][1] \
                        or bounds[b][0] == bounds[b][1]:
                    continue
                ids = [r["id"] for r in self.rows(
                    "SELECT x.completion_id AS id FROM scores x JOIN scores y ON y.completion_id = x.completion_id "
                    "WHERE x.reward = ? AND y.reward = ? AND x.status = 'ok' AND y.status = 'ok' "
                    "AND x.value = ? AND y.value = ? LIMIT 500", (a, b, bounds[a][1], bounds[b][0]))]
                if ids:
                    found.append({"kind": "max_vs_min", "title": f"{a} at its maximum ({bounds[a][1]:g}) while "
                                  f"{b} is at its minimum ({bounds[b][0]:g})", "ids": ids})
        dupes = self.rows("SELECT text, COUNT(DISTINCT prompt_id) AS prompts, GROUP_CONCAT(id) AS ids "
                          "FROM completions WHERE length(text) > 0 GROUP BY text HAVING prompts > 1 "
                          "ORDER BY prompts DESC LIMIT 20")
        for d in dupes:
            found.append({"kind": "identical", "title": f"the same completion for {d['prompts']} different "
                          f"prompts: {d['text'][:80]!r}", "ids": [int(i) for i in d["ids"].split(",")][:500]})
        means: dict[str, list[tuple[int, float]]] = {}
        for row in self.rows("SELECT step, reward, AVG(value) AS mean FROM scores GROUP BY reward, step ORDER BY step"):
            means.setdefault(row["reward"], []).append((row["step"], row["mean"]))
        for reward, series in means.items():
            series = [(s, m) for s, m in series if _finite(m)]
            values = [m for _, m in series]
            if len(values) < 3:
                continue
            spread = statistics.pstdev([b - a for a, b in zip(values, values[1:])]) or 0.0
            for (s0, m0), (s1, m1) in zip(series, series[1:]):
                if m0 is not None and m1 is not None and spread and abs(m1 - m0) > 3 * spread \
                        and abs(m1 - m0) > 0.1 * (max(values) - min(values) or 1):
                    ids = [r["id"] for r in self.rows("SELECT id FROM completions WHERE step = ? LIMIT 500", (s1,))]
                    found.append({"kind": "jump", "title": f"{reward}'s mean jumped from {m0:.3g} to {m1:.3g} "
                                  f"between steps {s0} and {s1}", "ids": ids})
        ids = [r["id"] for r in self.rows(
            "SELECT completion_id AS id FROM scores GROUP BY completion_id HAVING SUM(status = 'ok') = 0 "
            "LIMIT 500")]
        if ids:
            found.append({"kind": "fallbacks_only", "title": f"{len(ids)}{'+' if len(ids) == 500 else ''} "
                          "completions scored only through fallbacks (no reward answered ok)", "ids": ids})
        return found

    def export(self, params: dict):
        """The completions a filter selects, as JSON lines (at most EXPORT_LIMIT)."""
        where, values = self._filters(params)
        cursor = self.db().execute("SELECT c.*, p.text AS prompt FROM completions c JOIN prompts p "
                                   f"ON p.id = c.prompt_id {where} ORDER BY c.id LIMIT ?", values + (EXPORT_LIMIT,))
        names = [d[0] for d in cursor.description]
        while True:
            batch = cursor.fetchmany(500)
            if not batch:
                return
            for r in self._with_scores([dict(zip(names, r)) for r in batch]):
                yield (json.dumps(_clean(r), ensure_ascii=False, allow_nan=False) + "\n").encode()


def _bounded(number: int) -> int:
    return max(-INT64, min(INT64, number))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def like(text: str) -> str:
    """A LIKE pattern that finds ``text`` (at most MAX_QUERY characters) anywhere, its own % and _ literal."""
    text = str(text)[:MAX_QUERY]
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _clean(value):
    """JSON has no NaN or infinity: a non-finite number (a reward can return 1e308) goes out as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _int(params: dict, name: str, default: int, high: int) -> int:
    try:
        return max(0, min(high, int(params.get(name, default))))
    except (TypeError, ValueError):
        return default


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")


class Handler(BaseHTTPRequestHandler):
    server: ThreadingHTTPServer  # make_server's; the base class types it as any socketserver
    record: Record
    token: Optional[str] = None
    server_version = "rewardbox-report"
    timeout = 30  # an idle connection does not hold its thread for ever

    def _host_allowed(self) -> bool:
        """Without a token, only requests addressed to a loopback name: a page of another site whose name was made
        to resolve to 127.0.0.1 (DNS rebinding) sends its own name in Host and gets nothing."""
        if self.token:
            return True
        host = (self.headers.get("Host") or "").strip().lower()
        if host.startswith("["):
            host = host[:host.find("]") + 1]
        else:
            host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return host in LOOPBACK_NAMES

    @property
    def cookie(self) -> str:
        return f"rewardbox_token_{self.server.server_port}"  # one per port: reports of other ports keep theirs

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _authorized(self, params: dict) -> bool:
        if not self.token:
            return True
        offered = [params.get("token", ""), self.headers.get("Authorization", "").removeprefix("Bearer ")]
        cookie = self.headers.get("Cookie", "")
        offered += [part.strip().removeprefix(self.cookie + "=") for part in cookie.split(";")
                    if part.strip().startswith(self.cookie + "=")]
        return any(o and hmac.compare_digest(o.encode(), self.token.encode()) for o in offered)

    def _send(self, status: int, body: bytes, kind: str, extra: Optional[dict] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _stream(self, chunks, kind: str, extra: dict) -> None:
        """A body written as it is made (an export of 100,000 completions is never held whole); HTTP/1.0: the
        connection's end marks the body's."""
        self.send_response(HTTPStatus.OK)
        for key, value in {"Content-Type": kind, "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                           "Cache-Control": "no-store", **extra}.items():
            self.send_header(key, value)
        self.end_headers()
        self.close_connection = True
        if self.command == "HEAD":
            return
        for chunk in chunks:
            self.wfile.write(chunk)

    def _json(self, value: Any, status: int = 200) -> None:
        self._send(status, json.dumps(_clean(value), ensure_ascii=False, allow_nan=False, default=str).encode(),
                   "application/json; charset=utf-8")

    def do_HEAD(self) -> None:  # noqa: N802 - the base class's name
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        url = urlsplit(self.path)
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not self._host_allowed():
            self._send(HTTPStatus.MISDIRECTED_REQUEST, b"this report answers requests to 127.0.0.1 or localhost only",
                       "text/plain; charset=utf-8")
            return
        if not self._authorized(params):
            self._send(HTTPStatus.UNAUTHORIZED, b"a token is required: open the address `rewardbox report` printed",
                       "text/plain; charset=utf-8")
            return
        extra: dict[str, str] = {}
        if self.token and params.get("token"):
            # The token leaves the address bar (and history): a cookie of this port carries it from here on.
            self._send(HTTPStatus.SEE_OTHER, b"", "text/plain; charset=utf-8", {
                "Set-Cookie": f"{self.cookie}={self.token}; HttpOnly; SameSite=Strict; Path=/",
                "Location": url.path + (f"#{url.fragment}" if url.fragment else "")})
            return
        try:
            if url.path in STATIC or url.path == "/plotly.min.js":
                self._static(url.path, extra)
            elif url.path == "/favicon.ico":
                self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            elif url.path.startswith("/api/"):
                self._api(url.path[5:], params)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain; charset=utf-8")
        except RecordError as e:
            self._json({"error": str(e)}, HTTPStatus.SERVICE_UNAVAILABLE)
        except sqlite3.OperationalError as e:
            if "interrupted" in str(e):
                self._json({"error": f"the query took over {QUERY_DEADLINE_S:g} s and was stopped: narrow the "
                                     "filters"}, HTTPStatus.SERVICE_UNAVAILABLE)
            else:
                self._json({"error": f"the record could not answer: {e}"}, HTTPStatus.BAD_REQUEST)
        except (ValueError, OverflowError, sqlite3.Error) as e:
            self._json({"error": f"a parameter it cannot take: {type(e).__name__}"}, HTTPStatus.BAD_REQUEST)
        except Exception:  # noqa: BLE001 - no stack trace to the client; the server keeps serving
            self._json({"error": "the report failed on this request (see the terminal that runs it)"},
                       HTTPStatus.INTERNAL_SERVER_ERROR)
            raise

    def _static(self, path: str, extra: dict) -> None:
        if path == "/plotly.min.js":
            body = plotly_js()
            kind = "text/javascript; charset=utf-8"
        else:
            name = STATIC[path]
            body = resources.files("rewardbox.report").joinpath("static", name).read_bytes()
            kind = (mimetypes.guess_type(name)[0] or "application/octet-stream") + "; charset=utf-8"
        self._send(HTTPStatus.OK, body, kind, extra)

    def _api(self, name: str, params: dict) -> None:
        record = self.record
        offset, limit = _int(params, "offset", 0, 10 ** 9), _int(params, "limit", 50, PAGE_LIMIT)
        routes: dict[str, Callable[[], Any]] = {
            "meta": record.meta,
            "graphs": record.graphs,
            "prompts": lambda: record.prompts(params.get("q", ""), params.get("sort", "last_step"),
                                              params.get("order", "desc"), offset, limit),
            "prompt": lambda: record.prompt(params.get("id", "")),
            "completions": lambda: record.completions(params, offset, limit),
            "logs": lambda: record.logs(params, offset, limit),
            "signals": record.signals,
        }
        if name == "export":
            self._stream(record.export(params), "application/x-ndjson; charset=utf-8",
                         {"Content-Disposition": 'attachment; filename="completions.jsonl"'})
            return
        if name not in routes:
            self._json({"error": f"no such query: {name}"}, HTTPStatus.NOT_FOUND)
            return
        self._json(routes[name]())

    def do_POST(self) -> None:  # noqa: N802 - read-only: nothing changes the record
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"the report is read-only", "text/plain; charset=utf-8",
                   {"Allow": "GET, HEAD"})

    do_PUT = do_DELETE = do_PATCH = do_POST


_PLOTLY: list = []


def plotly_js() -> bytes:
    """plotly.js as the installed ``plotly`` package ships it (offline)."""
    if not _PLOTLY:
        from plotly.offline import get_plotlyjs

        _PLOTLY.append(get_plotlyjs().encode())
    return _PLOTLY[0]


def parse_listen(listen: str, token: Optional[str]) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port).

    Raises:
        ConfigError: not HOST:PORT, or an address other than loopback without a token.
    """
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8050")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise ConfigError(f"--listen {listen}: the report serves completions and reward output to anyone who can "
                          "reach it; it binds loopback unless a token is set: set REWARDBOX_REPORT_TOKEN (then "
                          "every request must carry it), or listen on 127.0.0.1")
    return host, int(port)


class ReportServer6(ThreadingHTTPServer):
    """The report's server on an IPv6 address."""

    address_family = socket.AF_INET6


def make_server(output_dir: Path, listen: str = "127.0.0.1:8050", token: Optional[str] = None) -> ThreadingHTTPServer:
    """The report's HTTP server (not yet serving).

    Raises:
        RecordError: no readable record; ConfigError: a bad ``listen``.
    """
    host, port = parse_listen(listen, token)
    record = Record(output_dir)
    handler = type("ReportHandler", (Handler,), {"record": record, "token": token})
    server_class = ReportServer6 if ":" in host else ThreadingHTTPServer
    server = server_class((host, port), handler)
    server.daemon_threads = True
    return server
