"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that `huggingface_hub`
uses to create a repo and a branch, commit regular files (preupload + NDJSON commit), and
resolve/download files and snapshots (etag and commit sha headers). The real client talks
to it through HF_ENDPOINT; nothing here imports huggingface_hub.

Auth model: TOKENS maps a token to a user, who may write to repos in their own namespace.
Private repos are invisible (404 RepoNotFound) to anyone but their owner, like on the Hub.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

TOKENS = {"hf_alice": "alice", "hf_bob": "bob"}


@dataclass
class Repo:
    owner: str
    private: bool
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: content}
    refs: dict[str, str] = field(default_factory=dict)  # branch -> sha


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counter: int = 0

    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, bytes]) -> str:
        self.counter += 1
        h = hashlib.sha1(f"{parent}:{self.counter}:{time.time_ns()}".encode())
        for path in sorted(files):
            h.update(path.encode() + hashlib.sha256(files[path]).digest())
        sha = h.hexdigest()
        repo.commits[sha] = files
        return sha

    def count(self, method: str, fragment: str) -> int:
        return sum(1 for m, p in self.requests if m == method and fragment in p)


class Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    # -- plumbing ----------------------------------------------------------------------------
    def _user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return TOKENS.get(auth.removeprefix("Bearer ").strip()) if auth else None

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _json(self, status: int, data, headers: dict | None = None):
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, message: str, code: str | None = None, head: bool = False):
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        body = json.dumps({"error": message}).encode()
        self._send(status, body, headers, head=head)

    def _body(self) -> bytes:
        return self.body

    def _visible(self, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and self._user() != repo.owner):
            self._error(404, "Repository not found", "RepoNotFound", head=head)
            return None
        return repo

    def _commit_of(self, repo: Repo, rev: str, head: bool = False) -> str | None:
        rev = unquote(rev)
        sha = repo.refs.get(rev) or (rev if rev in repo.commits else None)
        if sha is None:
            self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound", head=head)
        return sha

    # -- routes ------------------------------------------------------------------------------
    def do_HEAD(self):
        self._route("HEAD")

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def _route(self, method: str):
        n = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(n) if n and method == "POST" else b""  # always drain (keep-alive)
        url = urlsplit(self.path)
        path = url.path
        with self.hub.lock:
            self.hub.requests.append((method, path))
        parts = path.strip("/").split("/")
        try:
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo()
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml()
            if method == "GET" and parts[:2] == ["api", "models"] and len(parts) == 4:
                return self._repo_info("/".join(parts[2:4]), "main")
            if parts[:2] == ["api", "models"] and len(parts) >= 5:
                repo_id, action, rest = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                if method == "POST" and action == "preupload":
                    return self._preupload(repo_id, rest)
                if method == "POST" and action == "commit":
                    return self._commit(repo_id, rest)
                if method == "POST" and action == "branch":
                    return self._branch(repo_id, rest)
                if method == "GET" and action == "revision":
                    return self._repo_info(repo_id, rest)
                if method == "GET" and action == "tree":
                    return self._tree(repo_id, parts[5], parse_qs(url.query))
            if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve("/".join(parts[:2]), parts[3], unquote("/".join(parts[4:])), method == "HEAD")
            self._error(404, f"no route {method} {path}")
        except Exception as e:  # a bug in this server must show up in the test, not hang it
            self._error(500, f"fake hub error: {e!r}")

    def _create_repo(self):
        user = self._user()
        if user is None:
            return self._error(401, "Invalid credentials in Authorization header")
        data = json.loads(self._body())
        namespace = data.get("organization") or user
        repo_id = f"{namespace}/{data['name']}"
        if repo_id in self.hub.repos:  # the Hub's 409 carries the repo url
            return self._json(409, {"error": "You already created this model repo",
                                    "url": f"http://{self.headers['Host']}/{repo_id}"},
                              {"X-Error-Message": "You already created this model repo"})
        if namespace != user:
            return self._error(403, f"You don't have the rights to create a model under the namespace {namespace}")
        private = data.get("visibility", "private" if data.get("private") else "public") != "public"
        repo = Repo(owner=user, private=private)
        sha = self.hub.new_commit(repo, None, {".gitattributes": b"*.bin filter=lfs\n"})
        repo.refs["main"] = sha
        self.hub.repos[repo_id] = repo
        self._json(200, {"url": f"http://{self.headers['Host']}/{repo_id}", "name": repo_id, "id": repo_id})

    def _validate_yaml(self):
        """The model card's metadata block must be a YAML mapping (the Hub checks more)."""
        import yaml

        content = json.loads(self._body())["content"]
        try:
            meta = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
        except yaml.YAMLError as e:
            return self._json(400, {"errors": [{"message": str(e)}]})
        if not isinstance(meta, dict):
            return self._json(400, {"errors": [{"message": "metadata must be a mapping"}]})
        self._json(200, {"errors": [], "warnings": []})

    def _writable(self, repo_id: str) -> Repo | None:
        if self._user() is None:
            self._error(401, "Invalid credentials in Authorization header")
            return None
        repo = self._visible(repo_id)
        if repo is not None and repo.owner != self._user():
            self._error(403, "You don't have write access to this repo")
            return None
        return repo

    def _preupload(self, repo_id: str, rev: str):
        repo = self._writable(repo_id)
        if repo is None or self._commit_of(repo, rev) is None:
            return
        files = json.loads(self._body())["files"]
        self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]})

    def _commit(self, repo_id: str, rev: str):
        repo = self._writable(repo_id)
        parent = repo and self._commit_of(repo, rev)
        if repo is None or parent is None:
            return
        files = dict(repo.commits[parent])
        for line in self._body().splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key != "header":
                return self._error(400, f"this fake hub only takes regular files, not {key}")
        sha = self.hub.new_commit(repo, parent, files)
        repo.refs[unquote(rev)] = sha
        self._json(200, {"commitUrl": f"http://{self.headers['Host']}/{repo_id}/commit/{sha}",
                         "commitOid": sha, "success": True})

    def _branch(self, repo_id: str, branch: str):
        repo = self._writable(repo_id)
        if repo is None:
            return
        branch = unquote(branch)
        if branch in repo.refs:
            return self._error(409, f"Reference already exists: refs/heads/{branch}")
        body = self._body()
        start = (json.loads(body).get("startingPoint") if body else None) or "main"
        sha = self._commit_of(repo, start)
        if sha is not None:
            repo.refs[branch] = sha
            self._json(200, {})

    def _repo_info(self, repo_id: str, rev: str):
        repo = self._visible(repo_id)
        sha = repo and self._commit_of(repo, rev)
        if sha:
            self._json(200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                             "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])]})

    def _tree(self, repo_id: str, rev: str, query: dict):
        repo = self._visible(repo_id)
        sha = repo and self._commit_of(repo, rev)
        if sha:
            files = repo.commits[sha]
            self._json(200, [{"type": "file", "path": p, "size": len(files[p]), "oid": _etag(files[p])}
                             for p in sorted(files)])

    def _resolve(self, repo_id: str, rev: str, filename: str, head: bool):
        repo = self._visible(repo_id, head)
        sha = repo and self._commit_of(repo, rev, head)
        if not sha:
            return
        content = repo.commits[sha].get(filename)
        if content is None:
            return self._error(404, "Entry not found", "EntryNotFound", head=head)
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = int(rng[6:].split("-")[0])
        body = content[start:]
        self._send(206 if start else 200, body, {
            "Content-Type": "application/octet-stream", "Content-Length": str(len(body)),
            "ETag": f'"{_etag(content)}"', "X-Repo-Commit": sha}, head=head)


def _etag(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


class HubServer:
    """`with HubServer() as hub:` -> hub.url for HF_ENDPOINT, hub.state for assertions."""

    def __init__(self):
        self.state = FakeHub()
        handler = type("BoundHandler", (Handler,), {"hub": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join()
