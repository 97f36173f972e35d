"""``serve --watch``: notice new steps of runs that are still training, and recompute them.

Each poll compares a run's *watch fingerprint* with the one seen at the previous poll and
recomputes (incrementally: only new or changed steps) a run whose fingerprint changed.

- A local run: the modification times of ``tokens/``, ``samples/`` and ``complete/`` (three
  stats). ``complete/`` belongs to it because a step counts only once every rank's completion
  marker is there, and the markers arrive after the step's shards: a poll that falls between a
  step's first shard and its last marker would otherwise recompute without the step, and never
  look again until the next step appears.
- A run on object storage: a prefix has no modification time, so the fingerprint is a digest of
  the listing of the same three prefixes, each key's name, size and LastModified (what the per-step
  cache compares, :meth:`grpolens.run.storage.Entry.fingerprint`). An idle poll costs one LIST
  request per prefix (one more per 1,000 keys) and no GET; it happens every :data:`REMOTE_EVERY`
  seconds (a local run is polled every :data:`LOCAL_EVERY`). The digest also becomes the run's
  version for the dashboard's pages (:func:`grpolens.serve.data.memo.note_listing`), which thus
  never list the bucket themselves.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from grpolens.run import format as fmt

#: Seconds between polls of a local run (three stats each).
LOCAL_EVERY = 5.0
#: Seconds between polls of an ``s3://`` run: three LIST requests each (one more per 1,000 keys),
#: about 17,000 a day (under 0.1 USD at AWS' list price), for a new step noticed within 15 s.
REMOTE_EVERY = 15.0
_WATCHED = (fmt.TOKENS, fmt.SAMPLES, fmt.COMPLETE_DIR)


def fingerprint(run: Any) -> tuple:
    """What a poll compares: see the module docstring."""
    from grpolens.serve.data.memo import _stat

    if not fmt.is_remote_run(run):
        return tuple(_stat(Path(run) / d) for d in _WATCHED)
    root = fmt.as_run(run)
    digest = hashlib.sha256()
    for table in _WATCHED:
        for rel, entry in sorted((root / table).walk()):
            digest.update(json.dumps([table, rel, *entry.fingerprint()[1:]]).encode())
    return (digest.hexdigest(),)


class Watcher:
    """Polls ``runs`` (name -> run path or ``s3://`` location) and recomputes those that changed;
    ``on_error(name, exc)`` hears of a recompute that failed (a half-uploaded step: the next
    change tries again)."""

    def __init__(self, runs: Mapping[str, Any], on_error: Callable[[str, Exception], None],
                 every: float = LOCAL_EVERY, remote_every: float = REMOTE_EVERY):
        self.runs = dict(runs)
        self.on_error = on_error
        self.every, self.remote_every = every, remote_every
        self.seen = {name: self._look(path) for name, path in self.runs.items()}
        start = time.monotonic()
        self.due = {name: start + self._interval(path) for name, path in self.runs.items()}

    def _interval(self, path: Any) -> float:
        return self.remote_every if fmt.is_remote_run(path) else self.every

    def _look(self, path: Any) -> tuple:
        v = fingerprint(path)
        if fmt.is_remote_run(path):
            from grpolens.serve.data.memo import note_listing

            note_listing(path, v)
        return v

    def poll(self, now: float | None = None) -> list[str]:
        """Look at every run that is due (all of them when ``now`` is ``inf``); recompute each that
        changed. Returns the names of the runs recomputed."""
        from grpolens.analysis.recompute import recompute

        now = time.monotonic() if now is None else now
        changed = []
        for name, path in self.runs.items():
            if now < self.due[name]:
                continue
            self.due[name] = min(now, time.monotonic()) + self._interval(path)
            v = self._look(path)
            if v == self.seen[name]:
                continue
            self.seen[name] = v
            if fmt.is_remote_run(path):
                fmt.forget_listings()  # the recompute lists what this poll saw, not an older listing kept for a TTL
            try:
                recompute(path, write=True)
            except Exception as e:  # noqa: BLE001 - reported; the next change tries again
                self.on_error(name, e)
            changed.append(name)
        return changed

    def start(self) -> threading.Thread:
        """Poll forever on a daemon thread (it dies with the server)."""
        def loop() -> None:
            while True:
                time.sleep(min(self.every, self.remote_every))
                self.poll()

        t = threading.Thread(target=loop, name="grpolens-watch", daemon=True)
        t.start()
        return t
