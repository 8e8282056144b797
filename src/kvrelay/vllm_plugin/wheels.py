"""vLLM release wheels from PyPI, cached locally, for reading their Python sources.

The wheels are CUDA builds (~330 MB each); kvrelay never installs or imports them, it only
reads ``.py`` members (``kvrelay.vllm_plugin.contract``). They are kept in
``~/.cache/kvrelay/vllm-wheels`` (next to the generated models in ``~/.cache/kvrelay``, shared
by every checkout on the machine); ``KVRELAY_VLLM_WHEELS`` points elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

CACHE_ENV = "KVRELAY_VLLM_WHEELS"
DEFAULT_CACHE_DIR = Path("~/.cache/kvrelay/vllm-wheels")

_WHEEL_NAME = re.compile(r"^vllm-(?P<version>[0-9][^-]*)-.+\.whl$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?(\.post[0-9]+)?$")


class WheelDownloadError(RuntimeError):
    """``pip download`` could not fetch the wheel."""


def wheel_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def cached_wheels(cache_dir: Path) -> list[tuple[str, Path]]:
    """``(version, path)`` of every vLLM wheel in ``cache_dir``, oldest version first."""
    if not cache_dir.is_dir():
        return []
    found = []
    for path in cache_dir.iterdir():
        match = _WHEEL_NAME.match(path.name)
        if match and path.is_file():
            found.append((match["version"], path))
    return sorted(found, key=lambda item: (_version_key(item[0]), item[1].name))


def find_wheel(version: str, cache_dir: Path) -> Path | None:
    for found_version, path in cached_wheels(cache_dir):
        if found_version == version:
            return path
    return None


def validate_version(version: str) -> str:
    """``version`` if it looks like a release (``0.33.0``), else ``ValueError``."""
    if not _VERSION.match(version):
        raise ValueError(f"not a vLLM release version: {version!r}")
    return version


def download_wheel(version: str, cache_dir: Path) -> Path:
    """Fetch ``vllm==version`` (the wheel only, no dependencies) into ``cache_dir``."""
    validate_version(version)
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", f"vllm=={version}",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q",
        "-d", str(cache_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    path = find_wheel(version, cache_dir)
    if result.returncode != 0 or path is None:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise WheelDownloadError(f"pip download vllm=={version} failed: {' / '.join(detail)}")
    return path


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"[0-9]+", version))
