"""The engine's records of the latest ended requests, kept for ``GET /minillm/requests`` (minillm's extension,
what ``python -m minillm bench --compare-engine`` reads), bounded in count and in token times, served by page.

Only what the endpoint publishes is kept (``RequestSummary``: times and counts, never the tokens), at most
``KEPT`` records and ``KEPT_TOKEN_TIMES`` token times in all (the oldest go first): with SmolLM2's 8,192-token
context, keeping whole records would let 4,096 of them hold about 2 GB. A page holds at most ``PAGE_MAX``
records and ``PAGE_TOKEN_TIMES`` token times, and is rendered to JSON bytes by the caller's worker thread:
each record is rendered once (with and without its token times), and a page joins the rendered records, so
that clients who ask for pages back to back cost the server little more than the bytes it sends.
"""
from __future__ import annotations

import json
import threading
from collections import deque

from ..request import RequestRecord, RequestSummary

KEPT, KEPT_TOKEN_TIMES = 4096, 500_000  # records kept, their token times in all (16 MB of floats, ~10 MB as JSON)
PAGE_DEFAULT, PAGE_MAX, PAGE_TOKEN_TIMES = 100, 1000, 20_000  # a page: records by default, at most, token times


class Records:
    """Kept on the engine thread (``keep``), read from any thread (``page``)."""

    def __init__(self, kept: int = KEPT, kept_token_times: int = KEPT_TOKEN_TIMES):
        self.kept, self.kept_token_times = kept, kept_token_times
        self.rows: deque[RequestSummary] = deque()
        self.rendered: deque[dict[bool, bytes]] = deque()  # each row's JSON once a page has held it (by token_times)
        self.token_times = 0  # in self.rows
        self.lock = threading.Lock()

    def keep(self, record: RequestRecord) -> None:
        summary = RequestSummary.of(record)
        with self.lock:
            self.rows.append(summary)
            self.rendered.append({})
            self.token_times += len(summary.token_times)
            while len(self.rows) > self.kept or self.token_times > self.kept_token_times:
                self.token_times -= len(self.rows.popleft().token_times)
                self.rendered.popleft()

    def page(self, offset: int, limit: int, token_times: bool = True) -> bytes:
        """Skip the ``offset`` newest records; the ``limit`` before them, oldest first (fewer when their token
        times would pass ``PAGE_TOKEN_TIMES``), as JSON with ``total`` and ``next_offset`` (null at the end)."""
        with self.lock:
            total, chosen, times = len(self.rows), [], 0
            for i in range(total - 1 - offset, -1, -1):
                row = self.rows[i]
                cost = len(row.token_times) if token_times else 0
                if len(chosen) == limit or (chosen and times + cost > PAGE_TOKEN_TIMES):
                    break
                times += cost
                rendered = self.rendered[i]
                if token_times not in rendered:
                    rendered[token_times] = json.dumps(row.to_json(token_times), separators=(",", ":")).encode()
                chosen.append(rendered[token_times])
        end = offset + len(chosen)
        tail = json.dumps({"total": total, "offset": offset, "next_offset": end if end < total else None},
                          separators=(",", ":")).encode()
        return b'{"requests":[' + b",".join(reversed(chosen)) + b"]," + tail[1:]
