"""A stand-in for the Hugging Face Hub on loopback (no internet here): serves folders as model repositories with
the hub's URL layout, the parts of it that `huggingface_hub.snapshot_download` and vskipper.fetch's plain-HTTP
client call:

- `GET /api/models/{org}/{name}/revision/{revision}`: `sha` (the commit) and `siblings[].rfilename`;
- `GET /api/models/{org}/{name}/tree/{revision}?recursive=...`: `[{type, path, size, oid}]` (one page);
- `HEAD|GET /{org}/{name}/resolve/{revision}/{path}`: the file, with `X-Repo-Commit`, `ETag` and `Content-Length`.

With `token` set every request must carry `Authorization: Bearer <token>` (else 401, as for a gated or private
repository). Only the revision `main` and the commit exist (else 404, `X-Error-Code: RevisionNotFound`). Every
request is recorded (method, path, authorization header).
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Hub:
    def __init__(self, repos: dict[str, Path], token: str | None = None):
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.token = token
        self.requests: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1()
        for name, path in self.files(repo).items():
            digest.update(name.encode() + path.read_bytes())
        return digest.hexdigest()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body=b"", headers=None, head=False):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, value, head=False):
                self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"}, head)

            def _route(self, head=False):
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                auth = self.headers.get("Authorization")
                hub.requests.append((self.command, path, auth))
                if hub.token and auth != f"Bearer {hub.token}":
                    return self._send(401, b'{"error": "Invalid credentials"}', {}, head)
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo = "/".join(parts[2:4] if api else parts[0:2])
                if repo not in hub.repos:
                    return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"},
                                      head)
                commit = hub.commit(repo)
                action = parts[4] if api else parts[2] if len(parts) > 2 else ""
                revision = parts[5] if api else parts[3] if len(parts) > 3 else ""
                if revision not in ("main", commit):
                    return self._send(404, b'{"error": "Revision not found"}', {"X-Error-Code": "RevisionNotFound"},
                                      head)
                files = hub.files(repo)
                if api and action == "revision":
                    return self._json({"id": repo, "modelId": repo, "sha": commit, "private": False,
                                       "siblings": [{"rfilename": name} for name in files]}, head)
                if api and action == "tree":
                    return self._json([{"type": "file", "path": name, "size": p.stat().st_size,
                                        "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                                       for name, p in files.items()], head)
                if not api and action == "resolve":
                    name = "/".join(parts[4:])
                    if name not in files:
                        return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"},
                                          head)
                    body = files[name].read_bytes()
                    return self._send(200, body, {"X-Repo-Commit": commit, "Content-Type": "application/octet-stream",
                                                  "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}, head)
                return self._send(404, b"{}", {}, head)

            def do_GET(self):
                self._route()

            def do_HEAD(self):
                self._route(head=True)

        return Handler
