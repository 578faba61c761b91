"""Download a checkpoint before a server starts: `python -m vskipper.fetch hf://ORG/NAME --out DIR [--revision R]`.

A SkipperDeployment whose `spec.model.path` is `hf://ORG/NAME` gets an init container that runs this module in the
runtime image, into a cache volume the server then reads (operator/README.md, "Model storage"). It is the one
place in `vskipper` that downloads; nothing else imports it.

- The client: `huggingface_hub.snapshot_download` when it is importable (the hub's own client, resumable), else
  plain HTTP against the hub's documented URLs: `GET {endpoint}/api/models/{repo}/revision/{revision}` lists the
  files (`siblings[].rfilename`) and `GET {endpoint}/{repo}/resolve/{revision}/{file}` fetches each one.
  `--client` picks one explicitly.
- The environment: `HF_ENDPOINT` (default https://huggingface.co, or a mirror) and `HF_TOKEN` (from a Secret; sent
  as a bearer token).
- Which files: those matching `--include` (default: configs, safetensors weights, tokenizer files, chat
  templates); a Llama repository's `original/*.pth` copy is not downloaded.
- After the download the folder is checked the way `vskipper serve` needs it: `config.json` parses as a JSON
  object naming its `model_type` or `architectures`, and at least one `*.safetensors` weight file is present.
  A checked download writes `.vskipper-fetch.json` (repository, revision, files); a later run for the same
  repository and revision finds it and downloads nothing (a pod restarted on a persistent cache).
- A failure prints one line to stderr and writes it to the termination message file (`--termination-log`, by
  default Kubernetes' `/dev/termination-log` when it exists), which the kubelet puts in the init container's
  status for the operator to report; the exit status is 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_INCLUDE = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")
MARKER = ".vskipper-fetch.json"
TERMINATION_LOG = "/dev/termination-log"
# The form spec.model.path admits (vskipper_operator.crd.HF_REPO_RE; tests/test_model_fetch.py keeps them equal).
_REPO = re.compile(r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")


class FetchError(RuntimeError):
    """A download that cannot serve; the message says what to change."""


def parse_uri(uri: str) -> str:
    """`hf://ORG/NAME` -> `ORG/NAME`; any other form is refused (the CRD's rule on spec.model.path)."""
    if not _REPO.match(uri):
        raise FetchError(f"{uri!r}: expected hf://ORG/NAME (other schemes are not supported)")
    return uri[len(SCHEME):]


def check_checkpoint(folder: Path) -> dict:
    """What `vskipper serve` reads first: config.json (a JSON object naming the architecture) and the weights.
    Returns the config."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FetchError(f"{folder}: no config.json after the download (is the repository a model checkpoint?)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise FetchError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise FetchError(f"{config_path}: not a model config (no model_type or architectures)")
    if not any(folder.rglob("*.safetensors")):
        raise FetchError(f"{folder}: no *.safetensors weights after the download")
    return config


def _request(url: str, token: str | None) -> urllib.request.Request:
    headers = {"User-Agent": "vskipper-fetch"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.Request(url, headers=headers)


def _status_error(repo: str, revision: str, status: int | None, what: str) -> FetchError:
    if status in (401, 403):
        return FetchError(f"hf://{repo}: access denied (HTTP {status}) for {what}: give a token that can read "
                          "the repository (spec.model.download.tokenSecret)")
    if status == 404:
        return FetchError(f"hf://{repo}@{revision}: not found (HTTP 404) for {what}: check the repository name "
                          "and spec.model.revision")
    return FetchError(f"hf://{repo}@{revision}: HTTP {status} for {what}")


def _http_download(repo: str, revision: str, out: Path, include: Sequence[str], endpoint: str,
                   token: str | None) -> list[str]:
    quoted_rev = urllib.parse.quote(revision, safe="")
    api = f"{endpoint}/api/models/{repo}/revision/{quoted_rev}"
    try:
        with urllib.request.urlopen(_request(api, token), timeout=60) as resp:
            info = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise _status_error(repo, revision, exc.code, "the file list") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise FetchError(f"hf://{repo}: cannot list files at {api}: {exc}") from None
    files = sorted(s["rfilename"] for s in info.get("siblings", [])
                   if any(fnmatch.fnmatch(s["rfilename"], p) for p in include))
    for name in files:
        target = out / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise FetchError(f"hf://{repo}: refusing file name {name!r} outside the checkpoint folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        url = f"{endpoint}/{repo}/resolve/{quoted_rev}/{urllib.parse.quote(name)}"
        part = target.with_name(target.name + ".part")
        try:
            with urllib.request.urlopen(_request(url, token), timeout=60) as resp, open(part, "wb") as fh:
                shutil.copyfileobj(resp, fh, length=1 << 20)
        except urllib.error.HTTPError as exc:
            raise _status_error(repo, revision, exc.code, name) from None
        except (urllib.error.URLError, OSError) as exc:
            raise FetchError(f"hf://{repo}: downloading {name} failed: {exc}") from None
        os.replace(part, target)
    return files


def _hub_download(repo: str, revision: str, out: Path, include: Sequence[str], endpoint: str,
                  token: str | None) -> list[str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(out), allow_patterns=list(include),
                          endpoint=endpoint, token=token or False)
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        # snapshot_download answers an unreadable file list with LocalEntryNotFoundError caused by the HTTP error
        cause = exc if isinstance(exc, HfHubHTTPError) else exc.__cause__
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if status is None:
            raise FetchError(f"hf://{repo}@{revision}: {str(exc).splitlines()[0]}") from None
        raise _status_error(repo, revision, status, "the download") from None
    except OSError as exc:
        raise FetchError(f"hf://{repo}: {exc}") from None
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and ".cache" not in p.parts)


def fetch(uri: str, out: Path, revision: str = "main", include: Sequence[str] = DEFAULT_INCLUDE,
          endpoint: str | None = None, token: str | None = None, client: str = "auto") -> Path:
    """Download `uri` into `out` (unless a checked download of the same revision is there) and check it."""
    repo = parse_uri(uri)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = token if token is not None else os.environ.get("HF_TOKEN") or None
    out = Path(out)
    marker = out / MARKER
    if marker.is_file():
        try:
            done = json.loads(marker.read_text())
        except ValueError:
            done = {}
        if (done.get("repo"), done.get("revision")) == (repo, revision):
            check_checkpoint(out)
            return out
    if client == "auto":
        try:
            import huggingface_hub  # noqa: F401

            client = "hub"
        except ImportError:
            client = "http"
    out.mkdir(parents=True, exist_ok=True)
    download = _hub_download if client == "hub" else _http_download
    files = download(repo, revision, out, include, endpoint, token)
    check_checkpoint(out)
    marker.write_text(json.dumps({"repo": repo, "revision": revision, "endpoint": endpoint, "files": files},
                                 indent=2))
    return out


def _report(message: str, termination_log: str | None) -> None:
    print(f"vskipper fetch: {message}", file=sys.stderr)
    if termination_log is None and Path(TERMINATION_LOG).exists():  # the kubelet creates it in a container
        termination_log = TERMINATION_LOG
    if termination_log:
        try:
            Path(termination_log).write_text(message[:4000])
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vskipper.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("uri", help="hf://ORG/NAME")
    parser.add_argument("--out", required=True, help="the checkpoint folder to fill")
    parser.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    parser.add_argument("--include", action="append", help="file patterns to download (repeatable; default: "
                        + ", ".join(DEFAULT_INCLUDE) + ")")
    parser.add_argument("--client", choices=["auto", "hub", "http"], default="auto",
                        help="huggingface_hub (hub), plain HTTP (http), or hub when installed (auto)")
    parser.add_argument("--termination-log", help="where a failure is also written (default: Kubernetes' "
                        f"termination message file {TERMINATION_LOG}, when it exists)")
    args = parser.parse_args(argv)
    try:
        out = fetch(args.uri, Path(args.out), args.revision, tuple(args.include or DEFAULT_INCLUDE),
                    client=args.client)
    except FetchError as exc:
        _report(str(exc), args.termination_log)
        return 1
    print(f"vskipper fetch: {args.uri}@{args.revision} ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
