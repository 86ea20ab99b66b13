"""A Hugging Face hub on loopback, serving local folders as repositories: enough of the hub's HTTP API for
huggingface_hub's `list_repo_files`, `snapshot_download` and `hf_hub_download` (repository info, file tree,
`resolve` with HEAD and GET). Tests point `HF_ENDPOINT` at it to exercise the online path without internet, and
count what was downloaded."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "f" * 40  # every repository's one revision


class FakeHub:
    """`repos`: {"models/org/name" or "datasets/org/name": folder}. Use as a context manager; `url` is the
    endpoint, `downloads` counts GETs of each file ("org/name/path")."""

    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.downloads: Counter[str] = Counter()
        hub = self

        class Handler(_Handler):
            owner = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def files(self, kind: str, repo: str) -> tuple[Path | None, list[str]]:
        folder = self.repos.get(f"{kind}/{repo}")
        if folder is None:
            return None, []
        return folder, sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


class _Handler(BaseHTTPRequestHandler):
    owner: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body_too=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body_too=True)

    def _answer(self, body_too: bool) -> None:
        url = urlparse(self.path)
        parts = unquote(url.path).strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 4:  # /api/{models,datasets}/org/name[/{revision,tree}/...]
            what = parts[4] if len(parts) > 4 else "revision"
            return self._api(parts[1], "/".join(parts[2:4]), what, "/".join(parts[6:]), "recursive=true" in url.query)
        kind = "models"
        if parts[0] == "datasets":
            kind, parts = "datasets", parts[1:]
        if len(parts) < 5 or parts[2] != "resolve":  # /org/name/resolve/{revision}/{path}
            return self._missing("EntryNotFound")
        repo, file = "/".join(parts[:2]), "/".join(parts[4:])
        folder, files = self.owner.files(kind, repo)
        if folder is None or file not in files:
            return self._missing("RepoNotFound" if folder is None else "EntryNotFound")
        body = (folder / file).read_bytes()
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body_too:
            self.owner.downloads[f"{repo}/{file}"] += 1
            self.wfile.write(body)

    def _api(self, kind: str, repo: str, what: str, under: str, recursive: bool) -> None:
        """Repository info (`revision`), or the `tree` under a folder (its files and, unless recursive, its
        subfolders as entries of their own)."""
        folder, files = self.owner.files(kind, repo)
        if folder is None:
            return self._missing("RepoNotFound")
        if what != "tree":
            return self._json({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]})
        prefix = f"{under}/" if under else ""
        entries: dict[str, dict] = {}
        for file in (f for f in files if f.startswith(prefix)):
            rest = file[len(prefix) :]
            if recursive or "/" not in rest:
                entries[file] = {"type": "file", "path": file, "size": (folder / file).stat().st_size, "oid": "0" * 40}
            else:
                sub = prefix + rest.split("/")[0]
                entries[sub] = {"type": "directory", "path": sub, "oid": "0" * 40}
        return self._json(list(entries.values()))

    def _json(self, data: object) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _missing(self, code: str) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()
