"""A small Hugging Face Hub-compatible HTTP server for offline tests.

It implements the endpoints the installed huggingface_hub 2.x client calls for create_repo,
upload_folder (validate-yaml, preupload, ndjson commit), create_branch, create_tag, list_repo_refs,
model_info, list_repo_tree, list_repo_commits, list_models, whoami, and HEAD/GET ``resolve``
(hf_hub_download / snapshot_download).  Every file is a regular git blob (preupload answers
``uploadMode: regular``), so LFS and Xet never come into play.

State lives in a directory: ``blobs/<git sha1>`` for file contents and ``repos.json`` for repos,
commits (full trees), branches and tags.  Tokens map to user names; a user writes to its own
namespace only; a private repo is visible to its owner only.  Status codes and ``X-Error-Code``
headers follow the real Hub, because the client turns them into its exception types:

- no token for a private repo: 401, ``X-Error-Code: RepoNotFound`` (the Hub does not reveal it exists);
- an unknown token: 401, ``X-Error-Message: Invalid credentials in Authorization header``;
- another user's private repo: 404 RepoNotFound; writing to another namespace: 403;
- unknown revision: 404 RevisionNotFound; unknown file: 404 EntryNotFound (with X-Repo-Commit).

Faults for tests: :meth:`HubServer.add_fault` makes matching requests answer 500, drop the
connection (after reading half of the body), or serve a file with corrupted bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: sha1(b"blob <size>\\0" + data) (what the client compares in preupload)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def front_matter(text: str) -> dict | None:
    """The YAML front matter of a README.md as a dict; None without one; ValueError if it does not parse."""
    if not text.startswith("---"):
        return None
    parts = text.split("\n---", 1)
    if len(parts) != 2:
        raise ValueError("front matter is not closed by '---'")
    data = yaml.safe_load(parts[0][3:]) or {}
    if not isinstance(data, dict):
        raise ValueError("front matter is not a mapping")
    return data


class HubFailure(Exception):
    """An HTTP error answer: status, X-Error-Code, message."""

    def __init__(self, status: int, message: str, *, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


@dataclass
class Fault:
    """Make up to ``times`` requests whose method and path match misbehave.

    kind: "500" (answer 500), "drop" (read half the body, then close the socket without an answer),
    "corrupt" (serve a file with one byte flipped; same length, same ETag).
    """

    kind: str
    method: str
    path_contains: str
    times: int = 1
    hits: int = 0


@dataclass
class HubState:
    root: Path
    tokens: dict[str, str] = field(default_factory=dict)  # token -> user name
    repos: dict = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    counter: int = 0

    def __post_init__(self):
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        path = self.root / "repos.json"
        if path.exists():
            self.repos = json.loads(path.read_text())

    # ---- storage ------------------------------------------------------------------------------
    def save(self) -> None:
        (self.root / "repos.json").write_text(json.dumps(self.repos, indent=1, sort_keys=True))

    def put_blob(self, data: bytes) -> str:
        oid = git_blob_sha1(data)
        path = self.root / "blobs" / oid
        if not path.exists():
            path.write_bytes(data)
        return oid

    def blob(self, oid: str) -> bytes:
        return (self.root / "blobs" / oid).read_bytes()

    # ---- repos and revisions ---------------------------------------------------------------------
    def repo(self, repo_id: str, user: str | None, *, token_given: bool) -> dict:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubFailure(404, f"Repository {repo_id} not found", code="RepoNotFound")
        if repo["private"] and repo["owner"] != user:
            if not token_given:
                raise HubFailure(401, "Invalid username or password.", code="RepoNotFound")
            raise HubFailure(404, f"Repository {repo_id} not found", code="RepoNotFound")
        return repo

    def resolve(self, repo: dict, revision: str) -> str:
        revision = unquote(revision)
        if revision in repo["branches"]:
            return repo["branches"][revision]
        if revision in repo["tags"]:
            return repo["tags"][revision]
        if len(revision) == 40 and revision in repo["commits"]:
            return revision
        raise HubFailure(404, f"Invalid rev id: {revision}", code="RevisionNotFound")

    def new_commit(self, repo: dict, parent: str | None, tree: dict, title: str, message: str, user: str) -> str:
        self.counter += 1
        seed = json.dumps([repo["id"], parent, tree, title, self.counter, time.time()])
        sha = hashlib.sha1(seed.encode()).hexdigest()
        repo["commits"][sha] = {
            "parent": parent,
            "tree": tree,
            "title": title,
            "message": message,
            "date": _now(),
            "author": user,
        }
        repo["last_modified"] = _now()
        return sha

    def create_repo(self, repo_id: str, owner: str, private: bool) -> dict:
        repo = {
            "id": repo_id,
            "owner": owner,
            "private": bool(private),
            "created_at": _now(),
            "last_modified": _now(),
            "commits": {},
            "branches": {},
            "tags": {},
        }
        tree = {".gitattributes": self.put_blob(GITATTRIBUTES)}
        repo["branches"]["main"] = self.new_commit(repo, None, tree, "initial commit", "", owner)
        self.repos[repo_id] = repo
        self.save()
        return repo

    def card_data(self, repo: dict) -> dict | None:
        tree = repo["commits"][repo["branches"]["main"]]["tree"]
        if "README.md" not in tree:
            return None
        try:
            return front_matter(self.blob(tree["README.md"]).decode())
        except ValueError:
            return None

    def model_tags(self, card: dict | None) -> list[str]:
        """Tags the Hub derives from card metadata (library, base models and relation, datasets, license)."""
        if not card:
            return []
        tags = list(card.get("tags") or [])
        if card.get("library_name"):
            tags.append(card["library_name"])
        bases = card.get("base_model") or []
        bases = [bases] if isinstance(bases, str) else bases
        relation = card.get("base_model_relation") or ("merge" if len(bases) > 1 else "finetune")
        for base in bases:
            tags += [f"base_model:{base}", f"base_model:{relation}:{base}"]
        datasets = card.get("datasets") or []
        tags += [f"dataset:{d}" for d in ([datasets] if isinstance(datasets, str) else datasets)]
        if card.get("license"):
            tags.append(f"license:{card['license']}")
        return sorted(set(tags))

    def model_json(self, repo: dict, sha: str, *, card_data: bool = True) -> dict:
        card = self.card_data(repo)
        tree = repo["commits"][sha]["tree"]
        data = {
            "_id": hashlib.md5(repo["id"].encode()).hexdigest()[:24],
            "id": repo["id"],
            "modelId": repo["id"],
            "author": repo["id"].split("/")[0],
            "sha": sha,
            "private": repo["private"],
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "createdAt": repo["created_at"],
            "lastModified": repo["last_modified"],
            "tags": self.model_tags(card),
            "library_name": (card or {}).get("library_name"),
            "siblings": [{"rfilename": path} for path in sorted(tree)],
        }
        if card_data and card is not None:
            data["cardData"] = card
        return data


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    # ---- plumbing ------------------------------------------------------------------------------
    @property
    def state(self) -> HubState:
        return self.server.state

    def _user(self) -> tuple[str | None, bool]:
        header = self.headers.get("Authorization") or ""
        token = header[7:] if header.lower().startswith("bearer ") else None
        if token is None:
            return None, False
        if token not in self.state.tokens:
            raise HubFailure(401, "Invalid credentials in Authorization header")
        return self.state.tokens[token], True

    def _writer(self, repo_id: str) -> str:
        user, _ = self._user()
        if user is None:
            raise HubFailure(401, "You must be authenticated to write to a repository")
        if repo_id.split("/")[0] != user:
            raise HubFailure(403, f"You don't have the rights to write to {repo_id}")
        return user

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _fault(self, kind_filter: set[str]) -> Fault | None:
        with self.state.lock:
            for fault in self.server.faults:
                if (
                    fault.kind in kind_filter
                    and fault.method == self.command
                    and fault.path_contains in self.path
                    and fault.hits < fault.times
                ):
                    fault.hits += 1
                    return fault
        return None

    def _dispatch(self) -> None:
        self.server.requests.append((self.command, self.path, "Authorization" in self.headers))
        if (fault := self._fault({"500", "drop"})) is not None:
            if fault.kind == "500":
                self._body()
                return self._json(500, {"error": "Internal Error (injected)"})
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length // 2)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        try:
            with self.state.lock:
                return self._route(parts, query)
        except HubFailure as failure:
            headers = dict(failure.headers)
            if failure.code:
                headers["X-Error-Code"] = failure.code
            headers["X-Error-Message"] = failure.message
            self._json(failure.status, {"error": failure.message}, headers)

    do_GET = do_POST = do_HEAD = do_DELETE = _dispatch

    # ---- routes --------------------------------------------------------------------------------
    def _route(self, parts: list[str], query: dict) -> None:
        if parts[:2] == ["api", "whoami-v2"]:
            user, _ = self._user()
            if user is None:
                raise HubFailure(401, "Invalid credentials in Authorization header")
            return self._json(200, {"type": "user", "name": user, "orgs": []})
        if parts[:3] == ["api", "repos", "create"] and self.command == "POST":
            return self._create_repo()
        if parts[:2] == ["api", "validate-yaml"]:
            return self._validate_yaml()
        if parts[:2] == ["api", "models"] and len(parts) == 2:
            return self._list_models(query)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._model_api("/".join(parts[2:4]), parts[4:], query)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        raise HubFailure(404, f"no route for {self.command} {self.path}")

    def _create_repo(self) -> None:
        payload = json.loads(self._body() or b"{}")
        namespace = payload.get("organization")
        user, _ = self._user()
        if user is None:
            raise HubFailure(401, "You must be authenticated to create a repository")
        repo_id = f"{namespace or user}/{payload['name']}"
        url = f"{self.server.endpoint}/{repo_id}"
        if repo_id in self.state.repos:
            return self._json(409, {"error": "You already created this model repo", "url": url})
        if (namespace or user) != user:
            raise HubFailure(403, f"You don't have the rights to create a model under the namespace {namespace}")
        self.state.create_repo(repo_id, user, payload.get("private") or payload.get("visibility") == "private")
        self._json(200, {"url": url, "name": repo_id})

    def _validate_yaml(self) -> None:
        payload = json.loads(self._body() or b"{}")
        try:
            front_matter(payload.get("content", ""))
        except (ValueError, yaml.YAMLError) as exc:
            return self._json(400, {"errors": [{"message": str(exc)}], "warnings": []})
        self._json(200, {"errors": [], "warnings": []})

    def _list_models(self, query: dict) -> None:
        user, _ = self._user()
        wanted = set(query.get("filter", []))
        search = (query.get("search") or [""])[0].lower()
        author = (query.get("author") or [None])[0]
        out = []
        for repo in sorted(self.state.repos.values(), key=lambda r: r["id"]):
            if repo["private"] and repo["owner"] != user:
                continue
            info = self.state.model_json(repo, repo["branches"]["main"], card_data="cardData" in query)
            info.pop("siblings")
            if search and search not in repo["id"].lower():
                continue
            if author and repo["id"].split("/")[0] != author:
                continue
            if not wanted <= set(info["tags"]):
                continue
            out.append(info)
        self._json(200, out)

    def _model_api(self, repo_id: str, rest: list[str], query: dict) -> None:
        action = rest[0] if rest else None
        if action in ("preupload", "commit", "tag", "branch") and self.command in ("POST", "DELETE"):
            user = self._writer(repo_id)
            repo = self.state.repo(repo_id, user, token_given=True)
            return getattr(self, f"_{action}")(repo, unquote(rest[1]), user)
        user, token_given = self._user()
        repo = self.state.repo(repo_id, user, token_given=token_given)
        if action is None:
            return self._json(200, self.state.model_json(repo, repo["branches"]["main"]))
        if action == "revision":
            return self._json(200, self.state.model_json(repo, self.state.resolve(repo, rest[1])))
        if action == "refs":
            return self._json(200, self._refs(repo))
        if action == "tree":
            sha = self.state.resolve(repo, rest[1])
            return self._json(200, self._tree(repo, sha, "/".join(rest[2:]), query))
        if action == "commits":
            return self._json(200, self._commits(repo, self.state.resolve(repo, rest[1])))
        raise HubFailure(404, f"no route for {self.command} {self.path}")

    def _refs(self, repo: dict) -> dict:
        def refs(kind: str, names: dict) -> list[dict]:
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": sha} for n, sha in sorted(names.items())]

        return {
            "branches": refs("heads", repo["branches"]),
            "tags": refs("tags", repo["tags"]),
            "converts": [],
            "pullRequests": [],
        }

    def _tree(self, repo: dict, sha: str, prefix: str, query: dict) -> list[dict]:
        tree = repo["commits"][sha]["tree"]
        recursive = (query.get("recursive") or ["False"])[0].lower() in ("1", "true")
        prefix = f"{prefix.strip('/')}/" if prefix else ""
        entries, folders = [], set()
        for path, oid in sorted(tree.items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            entries.append({"type": "file", "oid": oid, "size": len(self.state.blob(oid)), "path": path})
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)]
        return entries

    def _commits(self, repo: dict, sha: str | None) -> list[dict]:
        out = []
        while sha is not None:
            commit = repo["commits"][sha]
            out.append(
                {
                    "id": sha,
                    "title": commit["title"],
                    "message": commit["message"],
                    "date": commit["date"],
                    "authors": [{"user": commit["author"]}],
                }
            )
            sha = commit["parent"]
        return out

    def _branch_head(self, repo: dict, revision: str) -> str:
        if revision not in repo["branches"]:
            raise HubFailure(404, f"Invalid rev id: {revision} is not a branch", code="RevisionNotFound")
        return repo["branches"][revision]

    def _preupload(self, repo: dict, revision: str, user: str) -> None:
        payload = json.loads(self._body() or b"{}")
        tree = repo["commits"][self._branch_head(repo, revision)]["tree"]
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": tree.get(f["path"])}
            for f in payload.get("files", [])
        ]
        self._json(200, {"files": files, "commitOid": repo["branches"][revision]})

    def _commit(self, repo: dict, revision: str, user: str) -> None:
        head = self._branch_head(repo, revision)
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        if header.get("parentCommit") and header["parentCommit"] != head:
            raise HubFailure(412, "A commit has happened since. Please refresh and try again.")
        tree = dict(repo["commits"][head]["tree"])
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                tree[value["path"]] = self.state.put_blob(base64.b64decode(value["content"]))
            elif key == "deletedFile":
                if value["path"] not in tree:
                    raise HubFailure(404, "A file with this name doesn't exist", code="EntryNotFound")
                del tree[value["path"]]
            elif key == "deletedFolder":
                tree = {p: o for p, o in tree.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            elif key == "lfsFile":
                raise HubFailure(400, "this test server only accepts regular files")
        sha = self.state.new_commit(repo, head, tree, header["summary"], header.get("description", ""), user)
        pr_url = None
        if parse_qs(urlsplit(self.path).query).get("create_pr") == ["1"]:  # a pull request: the branch stays
            number = len(repo.setdefault("pull_requests", {})) + 1
            repo["pull_requests"][str(number)] = sha
            pr_url = f"{self.server.endpoint}/{repo['id']}/discussions/{number}"
        else:
            repo["branches"][revision] = sha
        self.state.save()
        url = f"{self.server.endpoint}/{repo['id']}/commit/{sha}"
        self._json(200, {"success": True, "commitOid": sha, "commitUrl": url, "pullRequestUrl": pr_url})

    def _tag(self, repo: dict, revision: str, user: str) -> None:
        if self.command == "DELETE":
            if repo["tags"].pop(revision, None) is None:
                raise HubFailure(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
            self.state.save()
            return self._json(200, {})
        payload = json.loads(self._body() or b"{}")
        sha = self.state.resolve(repo, revision)
        if payload["tag"] in repo["tags"]:
            raise HubFailure(409, f"Tag {payload['tag']} already exists")
        repo["tags"][payload["tag"]] = sha
        self.state.save()
        self._json(200, {})

    def _branch(self, repo: dict, branch: str, user: str) -> None:
        payload = json.loads(self._body() or b"{}")
        if branch in repo["branches"]:
            raise HubFailure(409, f"Branch {branch} already exists")
        start = payload.get("startingPoint") or "main"
        repo["branches"][branch] = self.state.resolve(repo, start)
        self.state.save()
        self._json(200, {})

    def _resolve(self, repo_id: str, revision: str, path: str) -> None:
        user, token_given = self._user()
        repo = self.state.repo(repo_id, user, token_given=token_given)
        sha = self.state.resolve(repo, revision)
        tree = repo["commits"][sha]["tree"]
        if path not in tree:
            raise HubFailure(404, f"Entry not found: {path}", code="EntryNotFound", headers={"X-Repo-Commit": sha})
        data = self.state.blob(tree[path])
        if self.command == "GET" and self._fault({"corrupt"}) is not None:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{tree[path]}"'}
        self._send(200, data, headers, ctype="application/octet-stream")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    state: HubState
    endpoint: str
    faults: list[Fault]
    requests: list[tuple[str, str, bool]]


class HubServer:
    """Start with ``HubServer(root, tokens={"tok": "alice"}).start()``; ``.endpoint`` is the HF_ENDPOINT."""

    def __init__(self, root: str | Path, *, tokens: dict[str, str] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self._httpd.state = HubState(self.root, tokens=dict(tokens or {}))
        self._httpd.faults = []
        self._httpd.requests = []
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._httpd.endpoint = self.endpoint
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> HubState:
        return self._httpd.state

    @property
    def requests(self) -> list[tuple[str, str, bool]]:
        """(method, path, had_authorization) of every request so far."""
        return self._httpd.requests

    def add_fault(self, kind: str, method: str, path_contains: str, *, times: int = 1) -> Fault:
        fault = Fault(kind, method, path_contains, times)
        self._httpd.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self._httpd.faults.clear()

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---- inspection helpers for tests ------------------------------------------------------------
    def repo(self, repo_id: str) -> dict:
        return self.state.repos[repo_id]

    def file(self, repo_id: str, revision: str, path: str) -> bytes:
        repo = self.repo(repo_id)
        return self.state.blob(repo["commits"][self.state.resolve(repo, revision)]["tree"][path])


if __name__ == "__main__":  # manual use: python -m tests.hub_server DIR TOKEN=USER ...
    import sys

    server = HubServer(sys.argv[1], tokens=dict(arg.split("=", 1) for arg in sys.argv[2:])).start()
    print(server.endpoint, flush=True)
    threading.Event().wait()
