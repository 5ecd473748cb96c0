"""The default response store: an embedded SQLite database, `responses.sqlite3` in the
configured directory.

One table, one row per response: its id, its creation time (for retention) and the record as
JSON. WAL journaling: a reader never waits for the writer, and a second process opening the
same file (Serve starting the replacement replica before stopping the old one) is safe.
Retention is applied on every write (age, then count: the oldest go first) and on open;
a record past its age is not returned even before it is pruned.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time

from actors.store.base import ResponseStoreConfig, StoredResponse

FILENAME = "responses.sqlite3"
_SCHEMA = ("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, body TEXT NOT NULL)",
           "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)")


class SQLiteResponseStore:
    """`ResponseStore` on SQLite. Thread-safe: one connection, calls serialized by a lock."""

    def __init__(self, config: ResponseStoreConfig) -> None:
        self.max_age_s, self.max_responses = config.max_age_s, config.max_responses
        directory = config.resolved_directory()
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / FILENAME
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across process crashes
        for statement in _SCHEMA:
            self._db.execute(statement)
        self.prune()

    def put(self, record: StoredResponse) -> None:
        body = json.dumps(record.to_json(), ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (id, created_at, body) VALUES (?, ?, ?)",
                             (record.id, record.created_at, body))
            self._prune_locked()

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute("SELECT created_at, body FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None or self._expired(row[0]):
            return None
        return StoredResponse.from_json(json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def prune(self) -> int:
        with self._lock:
            return self._prune_locked()

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _expired(self, created_at: float) -> bool:
        return self.max_age_s is not None and created_at < time.time() - self.max_age_s

    def _prune_locked(self) -> int:
        dropped = 0
        if self.max_age_s is not None:
            dropped += self._db.execute("DELETE FROM responses WHERE created_at < ?",
                                        (time.time() - self.max_age_s,)).rowcount
        if self.max_responses is not None:
            dropped += self._db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, rowid DESC "
                "LIMIT -1 OFFSET ?)", (self.max_responses,)).rowcount
        return dropped
