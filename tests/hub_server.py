"""A local stand-in for the Hugging Face Hub's HTTP API, serving one repository at one commit:
what `huggingface_hub.snapshot_download` asks of `HF_ENDPOINT` to download a snapshot (there is
no network here).

    GET  /api/models/<id>/revision/<main|commit>   the commit a revision is (repo_info)
    GET  /api/models/<id>/tree/<commit>            the files with their sizes (list_repo_tree)
    HEAD /<id>/resolve/<commit>/<file>             a file's commit, etag and size
    GET  /<id>/resolve/<commit>/<file>             its bytes

Anything else is a 404 with the Hub's error headers. `requests` lists every request line, so a
test sees which files were fetched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


@dataclass
class HubRepository:
    hub_id: str
    commit: str
    files: dict[str, bytes]
    requests: list[str] = field(default_factory=list)

    def answer(self, method: str, target: str) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, headers) of one request."""
        self.requests.append(f"{method} {target}")
        path = urlparse(target).path
        api = f"/api/models/{self.hub_id}"
        if path in (f"{api}/revision/main", f"{api}/revision/{self.commit}"):
            siblings = [{"rfilename": name} for name in self.files]
            return _json({"id": self.hub_id, "sha": self.commit, "siblings": siblings})
        if path == f"{api}/tree/{self.commit}":
            return _json(
                [
                    {"type": "file", "path": name, "size": len(data), "oid": _sha1(data)}
                    for name, data in self.files.items()
                ]
            )
        resolve = f"/{self.hub_id}/resolve/{self.commit}/"
        name = path.removeprefix(resolve)
        if path.startswith(resolve) and name in self.files:
            data = self.files[name]
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            return 200, data, {"X-Repo-Commit": self.commit, "ETag": etag}
        return 404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"}


def _json(value) -> tuple[int, bytes, dict[str, str]]:
    return 200, json.dumps(value).encode(), {"Content-Type": "application/json"}


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@contextlib.contextmanager
def hub_server(repository: HubRepository) -> Iterator[str]:
    """Serve `repository` on a free loopback port; yields the endpoint (`HF_ENDPOINT`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body, headers = repository.answer(self.command, self.path)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args) -> None:  # no access lines in the test's output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
