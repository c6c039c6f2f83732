"""The READMEs' shell blocks, found by Sybil, and a shell that runs them in order as a user would.

Every shell block (```bash, ```sh, ```shell) of README.md, k8s/README.md, examples/*/README.md and
the manual's pages under docs/ is either run or marked, visibly, on the line just before it with

    *Not run by the README test: WHY.*

A code block whose first line is a file name comment (`# train_mine.py`) is written to that file,
as a user would save it, so that a later block can run it. A comment line `# error: MESSAGE` right
after a command says that the command fails, printing MESSAGE: that is what is checked for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser

REPO = Path(__file__).resolve().parents[1]
SHELLS = ("bash", "sh", "shell")
NOT_RUN = re.compile(r"^\*Not run by the README test: (?P<why>[^*\n]+)\*[ \t]*$", re.MULTILINE)
FILE_HEADER = re.compile(r"\A# (?P<name>[\w./-]+\.(?:py|ya?ml|json|toml|txt|sh))[ \t]*\n")
EXPECTED_ERROR = re.compile(r"^\s*# (?P<message>error: .+)$")


def readmes() -> list[Path]:
    """Every README a user follows; examples/ added later are covered by the glob."""
    return [REPO / "README.md", REPO / "k8s" / "README.md", *sorted(REPO.glob("examples/*/README.md"))]


def docs_pages() -> list[Path]:
    """The manual's pages under docs/, in the order of mkdocs.yml's nav (the order a reader follows)."""
    nav = re.findall(
        r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.MULTILINE
    )
    return [REPO / "docs" / page for page in nav]


def manual() -> list[Path]:
    """Every page whose commands a user types: the READMEs and the manual under docs/."""
    return [*readmes(), *docs_pages()]


@dataclass(frozen=True)
class Block:
    """What a block asks for: a shell script to run, or a file to write."""

    kind: str  # "shell" or "file"
    source: str
    first_line: int  # the README line of the block's first line of source
    name: str = ""  # the file's name, for "file"
    page: Path | None = None  # the README or page of docs/ the block is on


@dataclass(frozen=True)
class NotRun:
    why: str


def _not_evaluated(example: Example) -> None:
    raise AssertionError("README blocks are run by ShellSession.run, not evaluated by Sybil")


class NotRunMarkParser:
    """The visible mark before a block, as a Sybil region of its own (so its line is known)."""

    def __call__(self, document: Document) -> Iterable[Region]:
        for found in NOT_RUN.finditer(document.text):
            after = document.text[found.end() :].lstrip("\n")
            if not after.startswith("```"):
                line = document.text.count("\n", 0, found.start()) + 1
                raise ValueError(f"{document.path}:{line}: a 'Not run' mark must stand just before a block")
            yield Region(found.start(), found.end(), NotRun(found["why"].strip()), _not_evaluated)


class _FileBlocks(CodeBlockParser):
    """Python/YAML blocks that name their file on the first line; other such blocks are prose."""

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in super().__call__(document):
            if FILE_HEADER.match(str(region.parsed)):
                yield region


def parse(path: Path) -> Document:
    parsers = [NotRunMarkParser(), *(CodeBlockParser(lang, _not_evaluated) for lang in SHELLS)]
    parsers += [_FileBlocks(lang, _not_evaluated) for lang in ("python", "yaml")]
    return Sybil(parsers=parsers).parse(path)


@dataclass(frozen=True)
class Step:
    """One example of a README in order: a block to run, or one the README marks and why."""

    block: Block | None
    not_run_because: str | None
    line: int


def steps(path: Path) -> list[Step]:
    """The README's blocks in order, each with its mark (if any); marks themselves are not steps."""
    out: list[Step] = []
    pending: str | None = None
    for example in parse(path):
        if isinstance(example.parsed, NotRun):  # a mark: applies to the next block
            pending = example.parsed.why
            continue
        source = str(example.parsed)
        header = FILE_HEADER.match(source)
        block = (
            Block("file", source, example.line + 1, header["name"], page=path)
            if header
            else Block("shell", source, example.line + 1, page=path)
        )
        out.append(Step(block, pending, example.line))
        pending = None
    return out


@dataclass
class Substitution:
    """A placeholder a user would fill, or a shortening for the test: `old` becomes `new`, and why."""

    old: str
    new: str
    why: str
    used: int = 0


# What the shell does around each block: the user's exported variables and folder carry over to the
# next block; set -e stops at the first failing command, whose line the ERR trap records.
RUNNER = """\
set -eE -o pipefail
source "$DOCS_STATE/env.sh"
cd "$(cat "$DOCS_STATE/cwd")"
expect_error() {  # the README shows this command failing with this message
  local want=$1 out; shift
  if out=$("$@" 2>&1); then printf '%s\\n' "$out"; echo "expected it to fail with: $want"; return 1; fi
  printf '%s\\n' "$out"
  [[ "$out" == *"$want"* ]] || { echo "it failed, but without: $want"; return 1; }
}
trap 'echo "$LINENO" > "$DOCS_STATE/failed-line"' ERR
source "$DOCS_STATE/block.sh"
trap - ERR
export -p > "$DOCS_STATE/env.sh"
pwd > "$DOCS_STATE/cwd"
"""


def with_expected_errors(source: str) -> str:
    """`cmd` followed by `# error: MSG` becomes `expect_error 'MSG' cmd` (same line count); a command
    continued over several lines (each ending in a backslash) is prefixed on its first line."""
    lines = source.split("\n")
    for i, line in enumerate(lines):
        found = EXPECTED_ERROR.match(line)
        if found and i > 0 and lines[i - 1].strip() and not lines[i - 1].lstrip().startswith("#"):
            first = i - 1
            while first > 0 and lines[first - 1].rstrip().endswith("\\"):
                first -= 1
            lines[first] = f"expect_error {shlex.quote(found['message'])} {lines[first].strip()}"
    return "\n".join(lines)


@dataclass
class ShellSession:
    """One user's shell over a README: blocks run in order in `cwd` (a fresh copy of the repo)."""

    readme: Path
    cwd: Path
    state: Path
    env: dict[str, str]
    substitutions: Sequence[Substitution] = ()
    block_timeout_s: float = 300
    marker: str = field(default_factory=lambda: f"docs-{os.getpid()}-{time.monotonic_ns()}")
    seconds: dict[str, float] = field(default_factory=dict)  # PAGE:LINE -> how long its block ran

    def __post_init__(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "env.sh").write_text("")
        (self.state / "cwd").write_text(str(self.cwd))
        # Every process a block starts (Ray's daemons included) carries this, so stop() finds them all.
        self.env = {**self.env, "ELASTICTRAIN_DOCS_SESSION": self.marker, "DOCS_STATE": str(self.state)}

    def substitute(self, source: str) -> str:
        for sub in self.substitutions:
            if sub.old in source:
                sub.used += 1
                source = source.replace(sub.old, sub.new)
        return source

    def write_file(self, block: Block) -> None:
        folder = Path((self.state / "cwd").read_text().strip())
        body = self.substitute(FILE_HEADER.sub("", block.source, count=1))
        (folder / block.name).write_text(f"# {block.name}\n{body}")

    def run(self, block: Block) -> str:
        """Run one shell block; on failure raise naming the README line and showing the output."""
        script = with_expected_errors(self.substitute(block.source))
        (self.state / "block.sh").write_text(script)
        (self.state / "failed-line").unlink(missing_ok=True)
        log = self.state / f"block-{block.first_line}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["bash", "--noprofile", "--norc", "-c", RUNNER],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            started = time.monotonic()
            try:
                code = proc.wait(timeout=self.block_timeout_s)
            except subprocess.TimeoutExpired:
                # SIGINT first, as Ctrl-C: a DeepSpeed op build then releases its lock file, which a
                # SIGKILLed one leaves behind for every later build to wait on.
                for sig, grace in ((signal.SIGINT, 15), (signal.SIGKILL, 10)):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=grace)
                code = None
        page = block.page or self.readme
        shown_page = page.relative_to(REPO) if page.is_relative_to(REPO) else page
        self.seconds[f"{shown_page}:{block.first_line}"] = round(time.monotonic() - started, 1)
        text = log.read_text(errors="replace")
        if code == 0:
            return text
        failed = self.state / "failed-line"
        offset = int(failed.read_text().strip() or 1) - 1 if failed.exists() else 0
        line = block.first_line + offset
        shown = script.split("\n")[offset] if offset < script.count("\n") + 1 else ""
        what = f"did not end within {self.block_timeout_s:.0f}s" if code is None else f"exited {code}"
        raise AssertionError(
            f"{shown_page}:{line}: `{shown.strip()}` {what}\n"
            f"--- the block as run ---\n{script}\n--- its output (last 6000 characters) ---\n{text[-6000:]}"
        )

    def unused_substitutions(self) -> list[str]:
        return [f"{s.old!r} ({s.why})" for s in self.substitutions if not s.used]

    def stop(self) -> list[int]:
        """End every process this session started (and only those), however deep it went."""
        found = list(_processes_carrying("ELASTICTRAIN_DOCS_SESSION", self.marker))
        # Ray's daemons (a `ray start` cluster a page left up) ignore SIGINT and its GCS outlives a SIGTERM
        # by 15 s: they go as `ray stop --force` ends them, at once. The rest as at a timeout: SIGINT
        # lets an op build release its lock.
        daemons = [pid for pid in found if _is_ray_daemon(pid)]
        for pid in daemons:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        rest = [pid for pid in found if pid not in daemons]
        for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 15), (signal.SIGKILL, 0)):
            for pid in rest:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_alive(pid) for pid in rest):
                time.sleep(0.3)
        return found


def free_ports(n: int, *, for_later: bool = False) -> list[int]:
    """n distinct free loopback ports (all bound at once, so none is handed out twice).

    for_later: ports a command binds minutes from now (the manual's `ray start`, blocks later). They
    come from below the kernel's ephemeral range and above Ray's worker ports (10002-19999), so that no
    process binding port 0 meanwhile (each Ray server of the clusters the other tests start) is handed
    one. Chosen from the ephemeral range at the test's start, two suite runs in a row lost the head's
    job agent (`ray job submit`: "No available agent to submit job"; then its health check never
    answered), which a port taken meanwhile explains."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            if not for_later:
                s.bind(("127.0.0.1", 0))
                continue
            while True:
                try:
                    s.bind(("127.0.0.1", random.randrange(20000, low)))
                    break
                except OSError:
                    continue
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _is_ray_daemon(pid: int) -> bool:
    """A process of Ray's own (GCS, raylet, dashboard, agents, log monitor, client server), not a user's."""
    try:
        argv = (Path(f"/proc/{pid}") / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[0].startswith(b"ray::") or any(
        b"/site-packages/ray/" in a or a.startswith(b"ray.") for a in argv[:3]
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _processes_carrying(name: str, value: str) -> Iterator[int]:
    wanted = f"{name}={value}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0"):
            yield int(entry.name)
