"""Where packs come from: the project's own packs/ folder (the official packs, loaded by default), local
folders, and git repositories (`URL[@ref]`, cloned into the cache and pinned to the commit the ref resolved
to). Every pack file of every source is read and checked before any is used: one broken pack stops the load
with a PackError naming the file and the field (the server then refuses to start), never a half-loaded set.
"""

import hashlib
import os
import shutil
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


@dataclass(frozen=True)
class LoadedPack:
    pack: Pack
    path: Path  # the file
    source: str  # "official", a folder, or a git URL
    commit: str | None = None  # the commit a git source was pinned to


def load_packs(
    sources: list[str] = (), official: bool = True, cache: Path = DEFAULT_CACHE
) -> dict[str, LoadedPack]:
    """Every pack of the official folder (unless official=False) and of each source, by id."""
    folders: list[tuple[Path, str, str | None]] = []
    if official and OFFICIAL is not None:
        folders.append((OFFICIAL, "official", None))
    for source in sources:
        if Path(source).is_dir():
            folders.append((Path(source).resolve(), str(Path(source).resolve()), None))
        elif _is_git(source):
            url, ref = split_ref(source)
            folder, commit = checkout(url, ref, cache)
            folders.append((folder, url, commit))
        else:
            raise PackError(
                source, "", "neither a folder nor a git repository URL (git+file://..., https://...git)"
            )
    loaded: dict[str, LoadedPack] = {}
    for folder, source, commit in folders:
        files = sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file() and _is_pack(p))
        for path in files:
            pack = read_pack(path)
            if pack.id in loaded:
                raise PackError(path, "id", f"pack {pack.id!r} is also defined in {loaded[pack.id].path}")
            loaded[pack.id] = LoadedPack(pack, path, source, commit)
    return loaded


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


def checkout(url: str, ref: str | None, cache: Path) -> tuple[Path, str]:
    """Clone url, check out ref (the default branch when None) and keep the tree under the cache as
    <url digest>/<commit>: a later load of the same commit reuses it."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        clone = Path(tmp) / "clone"
        _git("clone", "--quiet", "--no-checkout", url, str(clone), source=url)
        _git("-C", str(clone), "checkout", "--quiet", "--detach", ref or "HEAD", source=url)
        commit = _git("-C", str(clone), "rev-parse", "HEAD", source=url).strip()
        target = cache / hashlib.sha256(url.encode()).hexdigest()[:16] / commit
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(clone / ".git")
            clone.rename(target)
    return target, commit


def _git(*args: str, source: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=120, check=True)
    except FileNotFoundError:
        raise PackError(source, "", "git is not installed") from None
    except subprocess.CalledProcessError as e:
        raise PackError(
            source, "", f"git {args[0] if args[0] != '-C' else args[2]} failed: {e.stderr.strip()}"
        ) from None
    except subprocess.TimeoutExpired:
        raise PackError(source, "", "git took over 120 s") from None
    return done.stdout


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
