"""``loops-callbacks cache list|prune`` in a directory shared with other programs: only this package's caches are
ever selected; every other entry, whatever its name, is listed as not ours and left exactly as it was.

A reference cache is told by its header (this package's format), never by its name: a text file, a SQLite
file, another program's safetensors file or a directory named ``*.cache`` is not one, nor is a symbolic link
(the writer makes none) or a writer's temporary file without a header of ours.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from loops_callbacks.reference import cache_tool as cache_tool_module
from loops_callbacks.reference.cache import (CACHE_FILE_NAME, CacheKey, cache_file, data_fingerprint, find_cache,
                                             list_caches, write_cache)
from loops_callbacks.reference.cache_tool import main as cache_tool

TOKENS = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
LENGTHS = [len(ids) for ids in TOKENS]
OLD = 1.0e9  # 2001-09-09: older than any --older-than of these tests
FORMAT = b"loops-callbacks reference logprobs 3"
HOST = socket.gethostname().replace(os.sep, "_")

pytestmark = pytest.mark.skipif(os.name != "posix", reason="symbolic links, FIFOs and the liveness check are POSIX")


def key(reference: str) -> CacheKey:
    return CacheKey(reference, data_fingerprint(TOKENS), "float32")


def write(directory: Path, reference: str, modified: float) -> Path:
    """A whole cache of ``reference`` in ``directory``, last modified at ``modified``."""
    path = Path(cache_file(directory / CACHE_FILE_NAME, key(reference)))
    write_cache(path, key(reference), [np.full(n, -0.5) for n in LENGTHS])
    os.utime(path, (modified, modified))
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def snapshot(path: Path) -> Any:
    """What an entry is, without following a link: a file's bytes, a link's target, a directory's snapshot."""
    status = os.lstat(path)
    if stat.S_ISLNK(status.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISDIR(status.st_mode):
        return ("dir", {child.name: snapshot(child) for child in sorted(path.iterdir())})
    if stat.S_ISFIFO(status.st_mode):
        return ("fifo",)
    return ("file", path.read_bytes(), status.st_mtime)


def mixed_directory(root: Path) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """A cache directory that other programs share: ``(directory, ours, foreign)``, every entry old.

    Ours: two whole caches (one newer than the other), one cut short in its body, one cut short in its header,
    one of an earlier version (``LOOPSREF``) and the temporary file of a killed writer. Foreign: everything else.
    """
    directory, outside = root / "cache", root / "outside"
    directory.mkdir()
    outside.mkdir()
    ours = {"newest": write(directory, "reference-a", OLD), "older": write(directory, "reference-b", OLD)}
    blob = ours["newest"].read_bytes()
    header_end = 8 + int.from_bytes(blob[:8], "little")
    ours["body cut short"] = directory / "ref_logprobs.00000000000000a1.cache"
    ours["body cut short"].write_bytes(blob[: header_end + 5])
    ours["header cut short"] = directory / "ref_logprobs.00000000000000a2.cache"
    ours["header cut short"].write_bytes(blob[: blob.index(FORMAT) + len(FORMAT) + 3])
    ours["earlier version"] = directory / "ref_logprobs.cache"
    ours["earlier version"].write_bytes(b"LOOPSREF" + bytes(100))
    ours["killed writer's temporary file"] = directory / f"{ours['newest'].name}.tmp.{HOST}.{dead_pid()}"
    ours["killed writer's temporary file"].write_bytes(blob[:-7])

    foreign = {name: directory / name for name in (
        "notes.cache", "tokenizer_index.cache", "empty_dir.cache", "folder.cache", "tensors.cache", "sized.cache",
        "pipe.cache", "dangling.cache", "linked.cache", "cache_link",
    )}
    foreign["notes.cache"].write_text("someone's notes\n")
    with sqlite3.connect(foreign["tokenizer_index.cache"]) as database:  # a SQLite file
        database.execute("CREATE TABLE tokens (id INTEGER, text TEXT)")
        database.execute("INSERT INTO tokens VALUES (1, 'a')")
    database.close()
    foreign["empty_dir.cache"].mkdir()
    foreign["folder.cache"].mkdir()
    (foreign["folder.cache"] / "notes.txt").write_text("someone's")
    safetensors.numpy.save_file({"values": np.zeros(3, np.float32)}, str(foreign["tensors.cache"]),
                                metadata={"format": "another program's"})  # another program's safetensors file
    foreign["sized.cache"].write_bytes((20).to_bytes(8, "little") + b'{"a": "b"}' + bytes(20))
    os.mkfifo(foreign["pipe.cache"])
    foreign["dangling.cache"].symlink_to(root / "gone")
    (outside / "target.cache").write_bytes(blob)  # a whole cache of ours, elsewhere: a link to it is not ours
    foreign["linked.cache"].symlink_to(outside / "target.cache")
    foreign["cache_link"].symlink_to(outside / "target.cache")
    if os.geteuid() != 0:  # (root reads a file of mode 0 all the same)
        foreign["unreadable.cache"] = directory / "unreadable.cache"
        foreign["unreadable.cache"].write_bytes(blob)
        foreign["unreadable.cache"].chmod(0)  # its header cannot be read: it cannot be told to be ours
    # where killed writers' temporary files would be: files without a header of ours, a link, a directory
    temporaries = [directory / f"{name}.tmp.{HOST}.{dead_pid()}" for name in
                   ("notes.cache", "ref_logprobs.00000000000000a3.cache", "ref_logprobs.00000000000000a4.cache",
                    "ref_logprobs.00000000000000a5.cache", "ref_logprobs.00000000000000a6.cache")]
    temporaries.append(directory / f"notes.cache.tmp.{dead_pid()}")  # (a name without the host)
    temporaries[0].write_text("another program's temporary file\n")
    temporaries[1].write_text("another program's temporary file\n")
    temporaries[2].write_bytes(b"")  # nothing of ours in it
    temporaries[3].symlink_to(outside / "target.cache")
    temporaries[4].mkdir()
    temporaries[5].write_text("another program's temporary file\n")
    foreign.update({path.name: path for path in temporaries})
    for path in [*ours.values(), *foreign.values()]:
        if stat.S_ISREG(os.lstat(path).st_mode) or stat.S_ISDIR(os.lstat(path).st_mode):
            os.utime(path, (OLD, OLD))
    os.utime(ours["newest"], (OLD + 2000, OLD + 2000))
    os.utime(ours["older"], (OLD + 1000, OLD + 1000))
    return directory, ours, foreign


@pytest.mark.parametrize(
    ("options", "removed"),
    [
        (["--keep-newest", "1"], {"older", "body cut short", "header cut short", "earlier version"}),
        (["--keep-newest", "0"], {"newest", "older", "body cut short", "header cut short", "earlier version"}),
        (["--older-than", "30"], {"newest", "older", "body cut short", "header cut short", "earlier version"}),
        (["--damaged"], {"body cut short", "header cut short", "earlier version", "killed writer's temporary file"}),
        (["--older-than", "0", "--keep-newest", "0", "--damaged"],
         {"newest", "older", "body cut short", "header cut short", "earlier version",
          "killed writer's temporary file"}),
    ],
    ids=["keep-newest 1", "keep-newest 0", "older-than", "damaged", "all"],
)
def test_prune_removes_only_our_caches_and_leaves_every_other_entry_byte_for_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], removed: set[str]
) -> None:
    directory, ours, foreign = mixed_directory(tmp_path)
    before = {name: snapshot(path) for name, path in foreign.items()}
    outside = (tmp_path / "outside" / "target.cache").read_bytes()
    assert cache_tool(["prune", str(directory), *options]) == 0
    out = capsys.readouterr().out
    assert {name for name, path in ours.items() if not path.exists()} == removed, out
    assert {name: snapshot(path) for name, path in foreign.items()} == before, out  # not a byte changed
    assert (tmp_path / "outside" / "target.cache").read_bytes() == outside
    caches = removed - {"killed writer's temporary file"}
    assert f"{len(caches)} of {len(ours) - 1} caches removed" in out, out
    for name in ("notes.cache", "tokenizer_index.cache", "empty_dir.cache", "folder.cache", "tensors.cache",
                 "pipe.cache", "dangling.cache", "linked.cache", "unreadable.cache"):
        assert name not in foreign or f"not ours, left alone: {name} " in out, (name, out)


def test_list_says_which_entries_are_not_ours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, ours, foreign = mixed_directory(tmp_path)
    assert cache_tool(["list", str(directory)]) == 0
    lines = capsys.readouterr().out.splitlines()

    def line_of(name: str) -> str:
        (found,) = [line for line in lines if line.startswith(name + " ")]
        return found

    assert "reference reference-a" in line_of(ours["newest"].name)
    assert "DAMAGED" in line_of(ours["body cut short"].name)
    assert "unreadable: its header is cut short" in line_of(ours["header cut short"].name)
    assert "unreadable: it is a cache of an earlier version" in line_of(ours["earlier version"].name)
    for name, why in (("notes.cache", "it is not a reference-logprob cache"),
                      ("tokenizer_index.cache", "it is not a reference-logprob cache"),
                      ("tensors.cache", "it is not a reference-logprob cache"),
                      ("sized.cache", "it is not a reference-logprob cache"),
                      ("empty_dir.cache", "it is a directory"),
                      ("pipe.cache", "it is not a regular file"),
                      ("dangling.cache", "it is a broken symbolic link"),
                      ("linked.cache", "it is a symbolic link (to "),
                      ("unreadable.cache", "it cannot be read")):
        assert name not in foreign or f"not ours, left alone: {why}" in line_of(name), (name, lines)
    assert lines[-1] == "1 temporary file(s) of killed writers (0.0 MB): prune --damaged removes them", lines


def test_a_directory_of_other_files_only_holds_no_caches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.cache").write_text("someone's notes\n")
    (tmp_path / "empty_dir.cache").mkdir()
    assert cache_tool(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"no reference-logprob caches in {tmp_path}\n") and "not ours" in out, out
    lookup = find_cache(tmp_path / CACHE_FILE_NAME, key("reference-a"), LENGTHS)
    assert lookup.status == "missing", lookup.reason  # not "stale": nothing there is a cache


def test_a_run_finds_its_cache_through_a_link_that_prune_leaves(tmp_path: Path) -> None:
    """A link to a cache elsewhere is read (a run may use it), never removed: the writer makes no links."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = write(elsewhere, "reference-a", OLD)
    directory = tmp_path / "cache"
    directory.mkdir()
    (directory / "shared.cache").symlink_to(target)
    lookup = find_cache(directory / CACHE_FILE_NAME, key("reference-a"), LENGTHS)
    assert lookup.status == "hit" and lookup.path == str(directory / "shared.cache")
    (info,) = list_caches(directory)
    assert info.key == key("reference-a") and not info.ours
    assert cache_tool(["prune", str(directory), "--keep-newest", "0", "--older-than", "0", "--damaged"]) == 0
    assert (directory / "shared.cache").is_symlink() and target.exists()


def test_a_cache_replaced_after_it_was_listed_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that writes its cache anew while prune runs: the new file is not the one selected, and stays."""
    old, gone = write(tmp_path, "reference-a", OLD), write(tmp_path, "reference-b", OLD)
    select = cache_tool_module.select_for_pruning

    def selected_then_changed(*args: Any, **kwargs: Any) -> Any:
        chosen = select(*args, **kwargs)
        write(tmp_path, "reference-a", OLD)  # a writer's os.replace: another file under the same name
        os.remove(gone)  # and another removed by someone else meanwhile
        return chosen

    monkeypatch.setattr(cache_tool_module, "select_for_pruning", selected_then_changed)
    assert cache_tool(["prune", str(tmp_path), "--older-than", "30"]) == 1
    out = capsys.readouterr().out
    assert old.exists() and f"left {old.name}: it changed since it was listed" in out, out
    assert "0 of 2 caches removed" in out and f"{gone.name} was gone already" in out, out


def test_the_temporary_file_of_a_killed_writer_replaced_after_it_was_listed_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = write(tmp_path, "reference-a", OLD)
    temporary = tmp_path / f"{cache.name}.tmp.{HOST}.{dead_pid()}"
    temporary.write_bytes(cache.read_bytes()[:-3])
    select = cache_tool_module.select_for_pruning

    def selected_then_changed(*args: Any, **kwargs: Any) -> Any:
        chosen = select(*args, **kwargs)
        os.remove(temporary)
        temporary.write_text("another program's file, under that name since\n")
        return chosen

    monkeypatch.setattr(cache_tool_module, "select_for_pruning", selected_then_changed)
    assert cache_tool(["prune", str(tmp_path), "--damaged"]) == 1
    out = capsys.readouterr().out
    assert temporary.read_text() == "another program's file, under that name since\n", out
    assert f"left {temporary.name}: it changed since it was listed" in out, out


def test_a_directory_that_cannot_be_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(path: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cache_tool_module.os, "scandir", refused)
    for command in (["list", str(tmp_path)], ["prune", str(tmp_path), "--damaged"]):
        with pytest.raises(SystemExit) as exit_:
            cache_tool(command)
        (error,) = capsys.readouterr().err.splitlines()
        assert exit_.value.code == 2 and error == f"loops-callbacks cache: error: {tmp_path} cannot be read " \
                                                  "(Permission denied)", error
