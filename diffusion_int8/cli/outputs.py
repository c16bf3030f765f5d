"""Output sets, written whole or not at all: ``check_out`` before any work, ``output_set`` around the writing.

A command's outputs (``calibrate``: the calibration file, schedule, summaries and plots; ``eval``: the
reports and images) are written into a temporary directory beside ``--out`` (``.<name>.tmp-<pid>``: the
same parent, so the same file system, where renames are atomic) and moved into ``--out`` once complete.
With ``--overwrite`` the previous outputs move aside to ``.<name>.old-<pid>`` until the new ones are in
place, and move back if anything fails on the way. An interrupted run therefore leaves the previous
outputs or none, never a mix, and no temporary directory (one killed outright leaves its temporary directory,
which a run into the same ``--out`` an hour later removes). Files in ``--out`` that are not the command's
outputs are left where they are. ``command`` makes SIGTERM interrupt a command as Ctrl-C does, so that the
same clean-up runs, and ends an interrupted command with one line. ``check_out_file`` checks a single output
file (``check --json``, ``tune --out``) before any work.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..calibration.run import OUTPUTS as CALIBRATION_OUTPUTS
from ..eval.score import IMAGE_FILE
from .usage import UsageError, user_errors


def _present(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def check_out(out: Path, names: Sequence[str], overwrite: bool) -> None:
    """Raise ``UsageError`` unless ``out`` can receive the outputs ``names``: not a file, its parent (or the
    nearest existing ancestor) a writable directory, and none of ``names`` there unless ``overwrite``."""
    out = Path(out)
    if _present(out) and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory (new, or one holding earlier outputs)")
    ancestor = out.absolute().parent
    while not _present(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"--out {out} cannot be created: {ancestor} is a file, not a directory")
    # the outputs are written beside --out and renamed into it: both need the parent writable
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot write in {ancestor} (permission denied); "
                         f"choose an --out inside a directory you can write to")
    if not out.is_dir():
        return
    existing = [n for n in names if _present(out / n)]
    if existing and not overwrite:
        raise UsageError(f"{out} already holds {', '.join(existing)}; choose another --out or pass --overwrite")
    if existing and not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot replace its outputs (permission denied)")
    foreign = [f"{n}/{f}" for n in existing for f in _not_made(out / n, n)]
    if foreign:
        raise UsageError(f"--overwrite replaces {', '.join(sorted({f.split('/')[0] for f in foreign}))} in {out} "
                         f"whole, and it holds files no diffusion-int8 command writes there: "
                         f"{', '.join(foreign[:5])}{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''}; "
                         f"move them out or choose another --out")


# What the commands write inside the outputs that are folders: eval's and demo's images/<variant>/<index>.png, and
# demo's calibration/ (calibrate's outputs). --overwrite replaces such a folder whole, so anything else in it is the
# user's and is not deleted.
_MADE_IN = {"images": re.compile(r"[^/]+/" + IMAGE_FILE.pattern),
            "calibration": re.compile("|".join(re.escape(n) for n in CALIBRATION_OUTPUTS))}


def _not_made(path: Path, name: str) -> list[str]:
    """The files under the output folder ``path`` (output ``name``) that no command writes there, as paths
    relative to it; none where ``path`` is not a folder."""
    made = _MADE_IN.get(name)
    if made is None or path.is_symlink() or not path.is_dir():
        return []
    # images/: only the variant folders the report beside it lists, where it can be read
    folders = _report_folders(path.parent) if name == "images" else None
    return sorted(rel for rel in (p.relative_to(path).as_posix() for p in path.rglob("*")
                                  if p.is_symlink() or not p.is_dir())
                  if not made.fullmatch(rel) or (folders is not None and rel.split("/")[0] not in folders))


def _report_folders(out: Path) -> set[str] | None:
    """The image folders ``out/report.json`` lists (``images/<variant>``), or None where it cannot be read."""
    try:
        dirs = [str(d) for d in json.loads((out / "report.json").read_text(encoding="utf-8"))["image_dirs"].values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    names = [d.removeprefix("images/") for d in dirs]
    if not all(d.startswith("images/") and n and "/" not in n for d, n in zip(dirs, names)):
        return None  # eval --score's report names the folders it was given, wherever they are
    return set(names)


def check_out_file(path: Path, flag: str, overwrite: bool, make_parents: bool = False) -> None:
    """Raise ``UsageError`` unless the file ``path`` (given as ``flag``) can be written: not a directory, its
    directory writable (with ``make_parents``, the nearest existing ancestor, under which the rest is made),
    and not there already unless ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    parent = path.absolute().parent
    while make_parents and not _present(parent):
        parent = parent.parent
    if not _present(parent):
        raise UsageError(f"{flag} {path}: the directory {path.parent} does not exist; create it first")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path} cannot be written: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {parent} (permission denied)")
    if _present(path) and not overwrite:
        raise UsageError(f"{flag} {path} exists; pass --overwrite to replace it")
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag} {path} is not a regular file; give a file name")
    if _present(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot replace it (permission denied)")


_written: list[Path] = []  # the output sets this process has moved into place


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises ``KeyboardInterrupt``: the same clean-up runs for both."""


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated


def command(run: Callable) -> Callable:
    """``run(args)`` as a subcommand: Ctrl-C and SIGTERM end it, once the output sets' temporary directories
    are removed, with one line on stderr and status 130 (SIGINT) or 143 (SIGTERM)."""

    @functools.wraps(run)
    def wrapped(args) -> int:
        main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
        previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
        written = len(_written)
        try:
            return run(args)
        except KeyboardInterrupt as e:
            out = getattr(args, "out", None) or getattr(args, "json", None)
            if out is not None and Path(os.path.realpath(out)) in _written[written:]:
                what = f"after writing {out}"
            else:
                what = "nothing was written" + (f" to {out}" if out else "")
            print(f"diffusion-int8 {args.command}: interrupted; {what}", file=sys.stderr)
            return 143 if isinstance(e, Terminated) else 130
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

    return wrapped


@contextmanager
def output_set(out: Path, names: Sequence[str], overwrite: bool) -> Iterator[Path]:
    """Yield an empty temporary directory to write the outputs ``names`` into; on leaving without an
    exception, move them into ``out`` (replacing earlier ones when ``overwrite``, see the module docstring)."""
    check_out(out, names, overwrite)  # again: --out may have changed while the command ran
    real = Path(os.path.realpath(out))
    created = [p for p in (real.parent, *real.parent.parents) if not _present(p)]  # deepest first
    tmp = real.parent / f".{real.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier run of this pid's
    _remove_killed_runs(real)
    try:
        with user_errors(OSError):  # e.g. permissions that os.access did not tell
            real.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        yield tmp
        _commit(tmp, real, names, overwrite)
        _written.append(real)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _present(real):  # nothing was written: nor are the parents made for it kept
            for p in created:
                try:
                    p.rmdir()
                except OSError:
                    break


KILLED_AFTER_S = 3600


def _remove_killed_runs(out: Path) -> None:
    """Remove the temporary directories beside ``out`` of runs killed outright (SIGKILL, a power cut: no clean-up
    ran), told by their process being gone from this machine and ``KILLED_AFTER_S`` untouched; a live one's is left
    alone. A killed run's ``.old-<pid>`` holds the outputs it was replacing: kept, and named in a warning."""
    for path in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        kind, _, pid = path.name[len(out.name) + 2:].rpartition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:  # an hour untouched too: a run on another machine or in another container sharing the folder has
            if time.time() - path.stat().st_mtime < KILLED_AFTER_S:  # a pid this machine does not see
                continue
        except OSError:
            continue
        if kind == "tmp":
            shutil.rmtree(path, ignore_errors=True)
        else:
            warnings.warn(f"diffusion_int8: {path} holds outputs a killed run was replacing in {out}; "
                          f"move back what you want of them and delete it", RuntimeWarning, stacklevel=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _move(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _commit(tmp: Path, out: Path, names: Sequence[str], overwrite: bool) -> None:
    """Move the complete set in ``tmp`` into ``out``; on any failure put everything back as it was."""
    written = sorted(os.listdir(tmp))
    stray = set(written) - set(names)
    if stray:
        raise RuntimeError(f"outputs {sorted(stray)} are not among the declared {list(names)}")
    if not _present(out):
        _move(tmp, out)  # one rename: all or nothing
        return
    check_out(out, names, overwrite)
    backup = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(backup, ignore_errors=True)
    backup.mkdir()
    old, new = [], []
    try:
        for n in names:
            if _present(out / n):
                _move(out / n, backup / n)
                old.append(n)
        for n in written:
            _move(tmp / n, out / n)
            new.append(n)
    except BaseException:
        # undo in reverse; if that fails too the backup is kept (it holds the previous outputs)
        for n in reversed(new):
            _move(out / n, tmp / n)
        for n in reversed(old):
            _move(backup / n, out / n)
        backup.rmdir()
        raise
    shutil.rmtree(backup)
