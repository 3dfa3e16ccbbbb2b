"""Load cluster profiles: the built-in `profiles/*.toml` (package data of `meshplan.profiles`) or a
TOML file by path, into the `ClusterProfile` contract."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from meshplan.planner.contracts.cluster import ClusterProfile, cluster_from_dict
from meshplan.planner.contracts.errors import MeshplanError, did_you_mean

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

# The built-in profiles ship as package data; installed or editable, they are real files.
PROFILES_DIR = Path(str(resources.files("meshplan.profiles")))


def builtin_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILES_DIR.glob("*.toml"))


def _validated(path: Path) -> bool:
    """The profile's `validated` flag, read without building it (the listing must not fail)."""
    try:
        return tomllib.loads(path.read_text()).get("validated", True) is not False
    except (OSError, tomllib.TOMLDecodeError):
        return True


def profile_listing() -> str:
    """The built-in profiles, those from published specifications only marked: `b200 (not
    validated)`."""
    return ", ".join(name if _validated(PROFILES_DIR / f"{name}.toml") else f"{name} (not validated)"
                     for name in builtin_profiles())


def load_cluster(name_or_path: str | Path) -> ClusterProfile:
    """Load a built-in profile by name (`h100-sxm`) or a TOML file by path."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if not (text_name.endswith(".toml") or path.exists()):
        path = PROFILES_DIR / f"{text_name}.toml"
        if not path.exists():
            raise MeshplanError(f"unknown cluster profile {text_name!r}{did_you_mean(text_name, builtin_profiles())}; "
                                f"built-in profiles: {profile_listing()}, or pass a path to a .toml file")
    if not path.exists():
        raise MeshplanError(f"cluster profile file not found: {path}")
    from meshplan.planner.contracts.jsonfile import read_input_text

    text = read_input_text(path, "cluster profile", "a cluster profile is TOML text (see `meshplan calibrate`)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MeshplanError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:
        raise MeshplanError(f"{path}: nested too deeply to be a cluster profile (arrays or tables nested hundreds "
                            "of levels)") from None
    try:
        return cluster_from_dict(data)
    except ValueError as exc:
        raise MeshplanError(f"{path}: {exc}") from None
