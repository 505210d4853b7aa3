"""The topology files that ship with glm_ep (the repository's ``configs/``), found by name.

``setup.cfg`` maps the package ``glm_ep.configs`` onto ``configs/``, so a wheel carries them as
``glm_ep/configs/*.toml``; a source checkout (or an editable install) has them beside the package.
``--topology gb10-2`` then works from any folder, and a path to a file of one's own still does.
"""

from __future__ import annotations

from pathlib import Path

from glm_ep.errors import ConfigError, path_kind

PACKAGE = Path(__file__).resolve().parents[1]  # glm_ep/
CANDIDATE_DIRS = (PACKAGE / "configs", PACKAGE.parent / "configs")  # installed wheel, source tree


def shipped_dir() -> Path | None:
    return next((d for d in CANDIDATE_DIRS if d.is_dir()), None)


def shipped_names() -> list[str]:
    d = shipped_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d else []


def topology_path(spec: str | Path) -> Path:
    """``spec`` where it is a file; else the shipped topology named ``spec`` (``gb10-2`` or
    ``gb10-2.toml``; a bare name only, never a path into another folder)."""
    path = Path(spec)
    if path.is_file():
        return path
    d = shipped_dir()
    if d is not None and path.name == str(spec):
        shipped = d / f"{path.name.removesuffix('.toml')}.toml"
        if shipped.is_file():
            return shipped
    kind = path_kind(path)
    if kind != "not found":  # a folder, a FIFO, a symbolic link loop: say so, never "not found"
        raise ConfigError(f"{spec}: the topology is {kind}, not a file; expected a TOML topology file or a shipped "
                          f"name ({', '.join(shipped_names()) or 'none'})")
    raise ConfigError(f"{spec}: topology file not found, and no shipped topology has that name "
                      f"(shipped: {', '.join(shipped_names()) or 'none'})")
