"""Wheels for the GPU kit: which distributions to bring (the closure of Requires-Dist), and ray's repack.

Pure of network and subprocesses except `repack_wheel`'s `strip`: the fetching lives in kit.py, so the
closure and its refusals are testable on synthetic METADATA (tests/unit/test_gpu_kit_resolution.py).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# The GPU machine's interpreter: CPython 3.12.3 on Linux x86_64 (its markers; `extra` set per use).
TARGET_ENV: dict[str, str] = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# Tried only when a package has no wheel for PLATFORMS; the GPU machine's Python 3.12.3 is Ubuntu 24.04's
# (glibc 2.39), so these still load there. The manifest names any wheel that needed one.
MORE_PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]


def accepted_tags(platforms: Sequence[str]) -> set[tags.Tag]:
    """The tags pip accepts for cp312 on these platforms (abi3, none and py3-none-any included)."""
    return set(tags.cpython_tags((3, 12), ["cp312"], platforms)) | set(
        tags.compatible_tags((3, 12), "cp312", platforms)
    )


def wheel_fits(path: Path, platforms: Sequence[str]) -> bool:
    _, _, _, wheel_tags = parse_wheel_filename(path.name)
    return bool(wheel_tags & accepted_tags(platforms))


def read_gpu_list(path: Path) -> dict[str, Version | None]:
    """Name -> known version (None: unknown) of each distribution listed; '#' starts a comment."""
    present: dict[str, Version | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            present[canonicalize_name(name)] = Version(version) if version else None
    return present


def requirements(metadata: str, env: Mapping[str, str], extras: Iterable[str] = ()) -> list[Requirement]:
    """The Requires-Dist of a METADATA whose markers hold in env, with no extra (or only those asked)."""
    found = []
    for line in HeaderParser().parsestr(metadata).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras)):
            found.append(req)
    return found


def metadata_name_version(metadata: str) -> tuple[str, Version]:
    headers = HeaderParser().parsestr(metadata)
    return canonicalize_name(headers["Name"]), Version(headers["Version"])


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        return z.read(name).decode()


@dataclass(frozen=True)
class Fetched:
    """A wheel chosen for a requirement: its file, its METADATA, and how it was obtained."""

    wheel: Path
    metadata: str
    source: str = "PyPI"


@dataclass
class Brought:
    name: str
    version: Version
    fetched: Fetched
    chain: list[str]  # from elastictrain to this distribution: the first path that asked for it
    asked_by: list[str] = field(default_factory=list)  # every "requirer: requirement"
    extras: set[str] = field(default_factory=set)


@dataclass
class Plan:
    brought: dict[str, Brought] = field(default_factory=dict)
    present: dict[str, list[str]] = field(default_factory=dict)  # on the GPU machine: who asked
    errors: list[str] = field(default_factory=list)


class FetchError(RuntimeError):
    pass


def resolve(
    roots: Sequence[tuple[Requirement, str]],
    present: Mapping[str, Version | None],
    fetch: Callable[[Requirement], Fetched],
    env: Mapping[str, str] = TARGET_ENV,
    log: Callable[[str], None] = lambda _: None,
) -> Plan:
    """The closure of roots (requirement, requirer) over Requires-Dist, stopping at what is present.

    A present distribution of known version that a requirement's specifier excludes is an error (bringing
    a second version of it would shadow or break the GPU machine's own); so is a brought distribution
    whose version a later requirement excludes (no backtracking: the first choice stands).
    """
    plan = Plan()
    queue: deque[tuple[Requirement, list[str]]] = deque((req, [who]) for req, who in roots)
    while queue:
        req, chain = queue.popleft()
        name, asker = canonicalize_name(req.name), f"{chain[-1]}: {req}"
        if name in present:
            plan.present.setdefault(name, []).append(asker)
            have = present[name]
            if have is not None and not req.specifier.contains(have, prereleases=True):
                plan.errors.append(
                    f"{asker} — the GPU machine has {name}=={have}, which this excludes; refusing to "
                    f"bring a second version of {name}"
                )
            continue
        if name in plan.brought:
            got = plan.brought[name]
            got.asked_by.append(asker)
            if not req.specifier.contains(got.version, prereleases=True):
                plan.errors.append(f"{asker} — conflicts with {name}=={got.version} already chosen")
            elif not set(req.extras) <= got.extras:
                got.extras |= set(req.extras)
                for sub in requirements(got.fetched.metadata, env, req.extras):
                    queue.append((sub, [*chain, f"{name} {got.version}"]))
            continue
        try:
            fetched = fetch(req)
        except FetchError as e:
            plan.errors.append(f"{asker} — {e}")
            continue
        got_name, version = metadata_name_version(fetched.metadata)
        if got_name != name or not req.specifier.contains(version, prereleases=True):
            plan.errors.append(f"{asker} — fetched {got_name}=={version} ({fetched.wheel.name})")
            continue
        log(f"  {name}=={version} ({fetched.wheel.name}) <- {' -> '.join(chain)}")
        plan.brought[name] = Brought(name, version, fetched, chain, [asker], set(req.extras))
        for sub in requirements(fetched.metadata, env, req.extras):
            queue.append((sub, [*chain, f"{name} {version}"]))
    return plan


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass
class Repacked:
    dropped: dict[str, int]  # prefix -> compressed bytes the original wheel spent on it
    stripped: dict[str, tuple[int, int]]  # member -> compressed size before, after `strip --strip-unneeded`
    before: int
    after: int


def _members(z: zipfile.ZipFile, drop: Sequence[str]) -> Iterator[tuple[zipfile.ZipInfo, str | None]]:
    for info in z.infolist():
        yield info, next((p for p in drop if info.filename.startswith(p)), None)


def repack_wheel(src: Path, dst: Path, drop: Sequence[str] = (), strip: Sequence[str] = ()) -> Repacked:
    """Copy wheel src to dst without the members under drop, the members in strip stripped of symbols.

    RECORD is rewritten for what is left (a RECORD signature, if any, is dropped with it); names, dates and
    modes (executables stay executable) are kept, so dst is a valid wheel of the same name and tags.
    """
    dropped: dict[str, int] = dict.fromkeys(drop, 0)
    stripped: dict[str, tuple[int, int]] = {}
    rows: list[tuple[str, str, str]] = []
    with (
        zipfile.ZipFile(src) as zin,
        zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout,
    ):
        (record,) = [n for n in zin.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
        for info, prefix in _members(zin, drop):
            if prefix is not None:
                dropped[prefix] += info.compress_size
                continue
            if info.filename in (record, record + ".jws", record + ".p7s"):
                continue
            data = zin.read(info)
            if info.filename in strip:
                data = _stripped(data)
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            zout.writestr(out, data, compresslevel=9)
            if info.filename in strip:
                stripped[info.filename] = (info.compress_size, zout.getinfo(info.filename).compress_size)
            rows.append((info.filename, _record_hash(data), str(len(data))))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*rows, (record, "", "")])
        rec = zipfile.ZipInfo(record, zin.getinfo(record).date_time)
        rec.external_attr = zin.getinfo(record).external_attr
        zout.writestr(rec, text.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    missing = sorted(set(strip) - set(stripped))
    if missing:
        raise FileNotFoundError(f"{src.name} has no member {missing[0]} to strip")
    return Repacked(dropped, stripped, src.stat().st_size, dst.stat().st_size)


def _stripped(data: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "elf"
        path.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True, timeout=300)
        return path.read_bytes()
