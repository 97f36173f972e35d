"""A real local S3 server for the tests and benchmarks: moto's server on 127.0.0.1, in its own process.

    python tests/helpers/s3_server.py [--auth]

Binds a free port and prints ``port=<N>`` once listening. Every request is counted by method and
kind (GET of an object, HEAD, LIST, PUT, COPY, DELETE); ``GET /_counts`` returns the counts as JSON
and ``POST /_counts`` resets them, so a test can assert how many requests a command made.

With ``--auth`` the server checks signatures and IAM policies after its first setup requests (moto's
``INITIAL_NO_AUTH_ACTION_COUNT``): the parent creates its users with the first ``AUTH_SETUP_ACTIONS``
requests, and from then on a wrong secret is refused and a user without ``s3:GetObject`` gets
AccessDenied, as on AWS.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter

#: IAM requests the parent makes before auth is enforced (see tests/storage/conftest.py).
AUTH_SETUP_ACTIONS = 6


def _kind(environ) -> str:
    method = environ["REQUEST_METHOD"]
    query = environ.get("QUERY_STRING", "")
    path = environ.get("PATH_INFO", "/").strip("/")
    if method == "GET" and ("list-type" in query or "/" not in path):
        return "LIST"
    if method == "PUT" and environ.get("HTTP_X_AMZ_COPY_SOURCE"):
        return "COPY"
    return method


def main() -> None:
    if "--auth" in sys.argv:
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(AUTH_SETUP_ACTIONS)
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    counts: Counter = Counter()
    lock = threading.Lock()

    def counted(environ, start_response):
        if environ.get("PATH_INFO") == "/_counts":
            with lock:
                if environ["REQUEST_METHOD"] == "POST":
                    counts.clear()
                body = json.dumps(dict(counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = _kind(environ)
        path = environ.get("PATH_INFO", "")
        with lock:
            counts[kind] += 1
            for table in ("tokens", "samples"):  # reads of a run's shards, counted apart
                if f"/{table}/" in path:
                    counts[f"{kind} {table}"] += 1
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, counted, threaded=True)
    print(f"port={server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
