"""Where packs come from: the project's own packs/ folder (the official packs, loaded by default), local
folders, and git repositories (`URL[@ref]`, cloned into the cache and pinned to the commit the ref resolved
to). Every pack file of every source is read and checked before any is used: one broken pack stops the load
with a PackError naming the file and the field (the server then refuses to start), never a half-loaded set.
"""

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from spinf_jax import api
from spinf_jax.packs.format import SUFFIXES, Pack, PackError, read_pack

_HERE = Path(__file__).resolve().parent
# In a wheel the official packs sit inside the package; in the repository, at its top.
OFFICIAL = next(
    (p for p in (_HERE.parent / "official_packs", _HERE.parents[1] / "packs") if p.is_dir()), None
)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spinf-jax" / "packs"
GIT_DEADLINE = 60.0  # seconds for each git command of a checkout, the clone included
# git never asks: no terminal prompt for a username, no ssh passphrase or host-key question; a transfer
# slower than 1 KB/s for 15 s (a remote that accepts and never answers) fails instead of waiting.
_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_ASKPASS": "",
    "SSH_ASKPASS": "",
    "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o ConnectTimeout=15",
}
_GIT_CONFIG = ("-c", "http.lowSpeedLimit=1000", "-c", "http.lowSpeedTime=15", "-c", "credential.helper=")


@dataclass(frozen=True)
class LoadedPack:
    pack: Pack
    path: Path  # the file
    source: str  # "official", a folder, or a git URL
    commit: str | None = None  # the commit a git source was pinned to


def load_packs(
    sources: list[str] = (),
    official: bool = True,
    cache: Path = DEFAULT_CACHE,
    git_deadline: float = GIT_DEADLINE,
) -> dict[str, LoadedPack]:
    """Every pack of the official folder (unless official=False) and of each source, by id. A source that
    holds no pack is refused: a wrong folder or repository would otherwise load silently."""
    folders: list[tuple[Path, str, str | None]] = []
    if official and OFFICIAL is not None:
        folders.append((OFFICIAL, "official", None))
    for source in sources:
        if Path(source).is_dir():
            folders.append((Path(source).resolve(), str(Path(source).resolve()), None))
        elif _is_git(source):
            url, ref = split_ref(source)
            folder, commit = checkout(url, ref, cache, git_deadline)
            folders.append((folder, url, commit))
        else:
            raise PackError(
                source, "", "neither a folder nor a git repository URL (git+file://..., https://...git)"
            )
    loaded: dict[str, LoadedPack] = {}
    for folder, source, commit in folders:
        files = pack_files(folder)
        if not files and source != "official":
            at = f" at {commit[:12]}" if commit else ""
            raise PackError(source, "", f"no pack files ({', '.join(SUFFIXES)}) in it{at}")
        for path in files:
            pack = read_pack(path)
            if pack.id in loaded:
                raise PackError(path, "id", f"pack {pack.id!r} is also defined in {loaded[pack.id].path}")
            loaded[pack.id] = LoadedPack(pack, path, source, commit)
    return loaded


def pack_files(folder: Path) -> list[Path]:
    """The pack files of a folder and its subfolders, in order."""
    return sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file() and _is_pack(p))


def _is_pack(path: Path) -> bool:
    """Pack files are every YAML/JSON file of a source except JSON Schemas and hidden folders' files."""
    return path.name != "schema.json" and not any(part.startswith(".") for part in path.parts[-3:-1])


def _is_git(source: str) -> bool:
    return source.startswith(("git+", "git@")) or "://" in source


def split_ref(source: str) -> tuple[str, str | None]:
    """`git+file:///srv/packs@v1` → ("file:///srv/packs", "v1"); the ref is what follows the last @ after
    the last / (so user@host URLs keep their user)."""
    url = source.removeprefix("git+")
    head, _, tail = url.rpartition("/")
    if "@" in tail:
        tail, _, ref = tail.rpartition("@")
        return f"{head}/{tail}", ref or None
    return url, None


def checkout(url: str, ref: str | None, cache: Path, deadline: float = GIT_DEADLINE) -> tuple[Path, str]:
    """Clone url, check out ref (the default branch when None; a branch, tag or commit) and keep the tree
    under the cache as <url digest>/<commit>: a later load of the same commit reuses it."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        clone = Path(tmp) / "clone"
        _git("clone", "--quiet", "--no-checkout", url, str(clone), source=url, deadline=deadline)
        commit = _resolve(clone, ref, url, deadline)
        _git("-C", str(clone), "checkout", "--quiet", "--detach", commit, source=url, deadline=deadline)
        target = cache / hashlib.sha256(url.encode()).hexdigest()[:16] / commit
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(clone / ".git")
            clone.rename(target)
    return target, commit


def _resolve(clone: Path, ref: str | None, url: str, deadline: float) -> str:
    """The commit ref names in the clone: itself, or a branch of the remote; else a PackError listing the
    branches and tags there are."""
    for name in [ref or "HEAD", f"origin/{ref}"] if ref else ["HEAD"]:
        try:
            return _git(
                "-C", str(clone), "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}",
                source=url, deadline=deadline,
            ).strip()  # fmt: skip
        except PackError:
            continue
    names = _git(
        "-C", str(clone), "for-each-ref", "--format=%(refname:short)", "refs/remotes", "refs/tags",
        source=url, deadline=deadline,
    ).split()  # fmt: skip
    known = sorted({n.removeprefix("origin/") for n in names if n not in ("origin", "origin/HEAD")})
    shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
    raise PackError(url, "", f"no branch, tag or commit {ref!r} there (it has: {shown or 'none'})")


def _git(*args: str, source: str, deadline: float = GIT_DEADLINE) -> str:
    """One git command, never waiting on a person, and stopped with everything it started (git's remote
    helpers too) past the deadline."""
    try:
        process = subprocess.Popen(
            ["git", *_GIT_CONFIG, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | _GIT_ENV,
            start_new_session=True,  # its own process group, so that a stop reaches the helpers
        )
    except FileNotFoundError:
        raise PackError(source, "", "git is not installed") from None
    try:
        out, err = process.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        step = args[0] if args[0] != "-C" else args[2]
        raise PackError(
            source, "", f"git {step} did not finish within {deadline:g} s (is the remote up?)"
        ) from None
    if process.returncode != 0:
        step = args[0] if args[0] != "-C" else args[2]
        raise PackError(
            source, "", f"git {step} failed: {err.strip() or f'exit status {process.returncode}'}"
        )
    return out


def describe(loaded: LoadedPack) -> api.PackInfo:
    """A loaded pack as /v1/packs and /health list it."""
    pack = loaded.pack
    return api.PackInfo(
        id=pack.id,
        version=pack.version,
        description=pack.description,
        source=loaded.source,
        commit=loaded.commit,
        questions=len(pack.questions),
        categories=[c.id for c in pack.categories],
        labels=list(pack.decision.labels),
        calibrated_on=[c.model for c in pack.calibrated_on],
    )
