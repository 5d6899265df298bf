"""Is the wheel set scripts/gpu_wheels.sh pins the whole of what the GPU machine lacks?

    python scripts/gpu_wheels_check.py [DIR]     # the pins; with DIR (.whl/) its wheels too
    python scripts/gpu_wheels_check.py --installed   # on the GPU machine, after the install

Without DIR (or with no wheels in it): every pin is `name==version`, one of each. With wheels:
one wheel per pin at its version and no other; each installs on the GPU machine's CPython 3.12
(its tags, Requires-Python); every Requires-Dist of every wheel (its markers read for CPython
3.12 on Linux x86_64) is met by a pinned wheel at a version it allows, or by a package the GPU
machine has (GPU_MACHINE: by name, its version unseen from here; those are listed); the total
stays under MAX_MIB. --installed, in the environment the check runs in (the wheels installed
with --target and first on PYTHONPATH): every pin is the version Python finds, every
Requires-Dist of theirs and every floor of pyproject.toml's dependencies is met by what Python
finds, the GPU machine's own packages included. Exits 1 with the problems listed.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
MAX_MIB = 40  # the device tool carries 64 MiB in all, the working tree included
# The GPU machine: Python 3.12.3 at /opt/torch/.venv/bin/python3, torch 2.11.0+cu130 with NCCL,
# and these (versions not known here; gpu_check.sh's env step records them there).
PYTHON = "3.12.3"
GPU_MACHINE = frozenset(
    canonicalize_name(n)
    for n in (
        "absl-py",
        "accelerate",
        "aiofiles",
        "anyio",
        "attrs",
        "certifi",
        "click",
        "cloudpickle",
        "execnet",
        "filelock",
        "fsspec",
        "h11",
        "httpcore",
        "httpx",
        "idna",
        "iniconfig",
        "jinja2",
        "markupsafe",
        "mpmath",
        "networkx",
        "numpy",
        "nvidia-ml-py",
        "packaging",
        "pillow",
        "pip",
        "pluggy",
        "prometheus-client",
        "psutil",
        "pygments",
        "pytest",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pyyaml",
        "requests",
        "rich",
        "setuptools",
        "six",
        "sympy",
        "torch",
        "tqdm",
        "typing-extensions",
        "urllib3",
        "wheel",
    )
)
# elastic_nb's dependencies the check does without: no cuda test or GPU benchmark imports them.
NOT_CARRIED = {
    "jupyter-server": "the server extension's (elastic_nb.server, the JupyterLab panel's API)",
}
# Read for the GPU machine: CPython 3.12 on Linux x86_64.
TARGET = {
    "implementation_name": "cpython",
    "implementation_version": PYTHON,
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": PYTHON,
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)")


def pins(script: Path = SCRIPT) -> dict[str, tuple[str, str]]:
    """canonical name -> (name as written, version), from the lines between the markers."""
    text = script.read_text()
    m = re.search(r"# wheels:begin[^\n]*\n(.*?)\n\s*# wheels:end", text, re.S)
    if not m:
        raise SystemExit(f"{script}: no '# wheels:begin' ... '# wheels:end' block")
    found: dict[str, tuple[str, str]] = {}
    problems = []
    for raw in m[1].splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pin = _PIN.fullmatch(line)
        if not pin:
            problems.append(f"not name==version: {line!r}")
            continue
        key = canonicalize_name(pin[1])
        if key in found:
            problems.append(f"pinned twice: {pin[1]}")
        found[key] = (pin[1], pin[2])
    if problems:
        raise SystemExit("\n".join(f"{script.name}: {p}" for p in problems))
    return found


def _target_tags() -> set[tags.Tag]:
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    supported = set(tags.cpython_tags((3, 12), platforms=platforms))
    supported |= set(tags.compatible_tags((3, 12), "cp312", platforms))
    return supported


def _metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        name = next(
            n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
        )
        msg = HeaderParser().parsestr(z.read(name).decode())
    return {
        k: msg.get_all(k) or [] for k in ("Name", "Version", "Requires-Dist", "Requires-Python")
    }


def _applies(req: Requirement, env: dict[str, str] | None) -> bool:
    if req.marker is None:
        return True
    return bool(req.marker.evaluate(env if env is not None else {"extra": ""}))


def check_wheels(
    directory: Path, pinned: dict[str, tuple[str, str]] | None = None
) -> tuple[list[str], list[str]]:
    """(problems, notes) for the wheels in `directory` against the pins (gpu_wheels.sh's)."""
    pinned = pins() if pinned is None else pinned
    problems: list[str] = []
    notes: list[str] = []
    wheels = sorted(directory.glob("*.whl"))
    supported = _target_tags()
    have: dict[str, tuple[Version, Path]] = {}
    for w in wheels:
        name, version, _, wtags = parse_wheel_filename(w.name)
        if name in have:
            problems.append(f"two wheels of {name}: {have[name][1].name}, {w.name}")
        have[name] = (version, w)
        if name not in pinned:
            problems.append(f"{w.name}: not pinned in {SCRIPT.name}")
        elif Version(pinned[name][1]) != version:
            problems.append(f"{w.name}: pinned at {pinned[name][1]}")
        if not wtags & supported:
            problems.append(f"{w.name}: no tag of it installs on CPython 3.12, manylinux x86_64")
    for key, (written, version) in pinned.items():
        if key not in have:
            problems.append(f"{written}=={version}: no wheel in {directory}")
    assumed: set[str] = set()
    for name, (_, w) in sorted(have.items()):
        meta = _metadata(w)
        for rp in meta["Requires-Python"]:
            if not SpecifierSet(rp).contains(PYTHON):
                problems.append(f"{w.name}: Requires-Python {rp} excludes {PYTHON}")
        for line in meta["Requires-Dist"]:
            req = Requirement(line)
            if not _applies(req, TARGET):
                continue
            dep = canonicalize_name(req.name)
            if dep in have:
                if not req.specifier.contains(have[dep][0], prereleases=True):
                    problems.append(f"{name} needs {line}; the wheel is {have[dep][0]}")
            elif dep in GPU_MACHINE:
                assumed.add(f"{req.name}{req.specifier}")
            else:
                problems.append(f"{name} needs {line}: neither a wheel nor on the GPU machine")
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_MIB * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB of wheels: more than {MAX_MIB} MiB")
    notes.append(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB")
    if assumed:
        notes.append(
            "met by the GPU machine's own packages (versions checked there, by --installed): "
            + ", ".join(sorted(assumed))
        )
    return problems, notes


def check_installed() -> tuple[list[str], list[str]]:
    """(problems, notes) for what this Python finds, the pins first on its path."""
    from importlib import metadata

    def version(name: str) -> Version | None:
        try:
            return Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            return None

    problems: list[str] = []
    notes: list[str] = []
    for written, pinned in pins().values():
        found = version(written)
        if found != Version(pinned):
            problems.append(f"{written}: pinned {pinned}, Python finds {found}")
            continue
        dist = metadata.distribution(written)
        for line in dist.requires or []:
            req = Requirement(line)
            if not _applies(req, None):
                continue
            got = version(req.name)
            if got is None or not req.specifier.contains(got, prereleases=True):
                problems.append(f"{written} needs {line}; Python finds {got}")
    try:
        import tomllib
    except ImportError:  # Python 3.10: no floors to read
        tomllib = None  # type: ignore[assignment]
    if tomllib is not None:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        for line in project["dependencies"]:
            req = Requirement(line)
            if canonicalize_name(req.name) in NOT_CARRIED:
                notes.append(f"not carried: {line}, {NOT_CARRIED[canonicalize_name(req.name)]}")
                continue
            got = version(req.name)
            if got is None or not req.specifier.contains(got, prereleases=True):
                problems.append(f"elastic_nb needs {line}; Python finds {got}")
    for name in ("torch", "pytest", "pytest-timeout", "packaging", "pygments", "python-dateutil"):
        notes.append(f"{name} {version(name)}")
    return problems, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, help="the wheels (.whl/)")
    parser.add_argument("--installed", action="store_true", help="check what Python finds")
    args = parser.parse_args()
    pinned = pins()
    print(f"{len(pinned)} pins in {SCRIPT.relative_to(ROOT)}")
    if args.installed:
        problems, notes = check_installed()
    elif args.directory is not None and any(args.directory.glob("*.whl")):
        problems, notes = check_wheels(args.directory)
    else:
        problems, notes = [], [f"no wheels in {args.directory}: the pins' syntax only"]
    for note in notes:
        print(note)
    for problem in problems:
        print(f"problem: {problem}")
    print("ok" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
