"""The reference-logprob cache is never silently wrong, never destroyed by another run, never a signal death.

- a cache file copied over or truncated under a running job changes nothing in it (subprocesses, both
  started at once: a memory map of a truncated file kills a process with SIGBUS);
- runs that share a directory keep their own caches, and each can resume from its own;
- a resume that finds no cache of its own names the caches present and why none matches;
- the writer's temporary file is created exclusively: a planted link is never written through;
- a cache is a standard safetensors file; one of an earlier version is named as such and scored again;
- a header that lies, or a whole file whose contents do not fit the data, is a damaged file, not a crash;
- ``cache_tool`` lists and prunes the caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from loops_callbacks.reference.across_ranks import ReferenceCacheError, ReferenceCacheWarning, score_across_ranks
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.cache import CACHE_FILE_NAME, CACHE_TOOL, CacheKey, cache_file, data_fingerprint
from loops_callbacks.reference.cache import list_caches, read_cache, write_cache
from loops_callbacks.reference.cache_tool import main as cache_tool
from loops_callbacks.types import Datum, ModelInput
from tests.helpers import run_python, start_python

TOKENS = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
OTHER_TOKENS = [[1, 2, 3, 4], [5, 6, 7], [8, 7]]


class Constant:
    """A reference whose every logprob is ``value`` (and that counts what it scores)."""

    def __init__(self, value: float) -> None:
        self.value, self.scored = value, 0

    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        self.scored += 1
        return [None] + [self.value] * (prompt.length - 1)


def datums(tokens: list[list[int]]) -> list[Datum]:
    return [Datum(ModelInput.from_ints(ids)) for ids in tokens]


def config(base: Path, fingerprint: str | None) -> ReferenceConfig:
    """A cache in ``base``'s directory, the reference named ``fingerprint``."""
    return ReferenceConfig(cache_dir=str(base.parent), reference_fingerprint=fingerprint, progress=False)


def score(base: Path, value: float, fingerprint: str, tokens: list[list[int]] = TOKENS, **kwargs: Any) -> Any:
    """Score (or load) ``tokens`` under the reference ``fingerprint``, cached beside ``base``."""
    client = Constant(value)
    values, report = score_across_ranks(tokens, client, config(base, fingerprint), datums=datums(tokens), **kwargs)
    return values, report, client


def resume(base: Path, fingerprint: str | None, tokens: list[list[int]] = TOKENS) -> tuple[np.ndarray, Any]:
    return score_across_ranks(tokens, None, config(base, fingerprint), cache_only_reason="(the fix)")


# ----------------------------------------------------------------------------- a file changed under a running job

CHANGED_UNDER_A_JOB = """
    import shutil, sys
    from pathlib import Path
    import numpy as np
    from loops_callbacks.reference.across_ranks import score_across_ranks
    from loops_callbacks.reference.config import ReferenceConfig

    base, how = Path(sys.argv[1]), sys.argv[2]
    tokens = [[1, 2, 3, 4], [5, 6, 7], [8, 9]] * 500      # 18 KB of values: a memory map would fault past 64 bytes

    class Constant:
        def __init__(self, value):
            self.value = value
        def compute_logprobs(self, prompt):
            return [None] + [self.value] * (prompt.length - 1)

    def run(value, fingerprint, directory):
        config = ReferenceConfig(cache_dir=str(directory), reference_fingerprint=fingerprint, progress=False)
        return score_across_ranks(tokens, Constant(value), config)

    run(-0.5, "ref-a", base)                                   # the first run writes its cache
    values, report = run(-0.5, "ref-a", base)                  # this job loads it...
    assert report.source == "cache", report
    run(-0.25, "ref-b", base / "other")                        # (a file of the same size, other values)
    (other,) = (base / "other").iterdir()
    before = float(values.sum(dtype=np.float64))
    if how == "overwrite":
        shutil.copyfile(other, report.cache_path)              # ...and the file is copied over, in place
    else:
        with open(report.cache_path, "r+b") as file:          # ...or truncated
            file.truncate(64)
    after = float(values.sum(dtype=np.float64))                # the job reads its values again
    print(f"before {before} after {after}", flush=True)
    sys.exit(0 if after == before else 3)
"""


CHANGES = ("overwrite", "truncate")


@pytest.fixture(scope="module")
def jobs_whose_cache_changed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each change's job (``CHANGED_UNDER_A_JOB``), both started at once: what each ended with."""
    folder = tmp_path_factory.mktemp("changed_under_a_job")
    jobs = {how: start_python("-c", textwrap.dedent(CHANGED_UNDER_A_JOB), str(folder / how), how,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for how in CHANGES}
    try:
        return {how: job.wait(timeout=300) for how, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()


@pytest.mark.parametrize("how", CHANGES)
def test_a_cache_file_changed_under_a_running_job_changes_nothing_in_it(
    jobs_whose_cache_changed: dict[str, subprocess.CompletedProcess[str]], how: str
) -> None:
    run = jobs_whose_cache_changed[how]
    assert run.returncode >= 0, f"killed by signal {-run.returncode} (SIGBUS: a memory map of a truncated file)"
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    before, after = run.stdout.split()[1::2]
    assert before == after


def test_a_rank_that_reads_other_bytes_than_rank_0_checked_gets_no_values(tmp_path: Path) -> None:
    path = tmp_path / "c.cache"
    key = CacheKey("r", data_fingerprint(TOKENS), "float32")
    write_cache(path, key, [np.zeros(len(ids)) for ids in TOKENS])
    checked = read_cache(path, key, [4, 3, 2])
    assert checked.status == "hit" and checked.digest is not None
    write_cache(path, key, [np.full(len(ids), -1.0) for ids in TOKENS])  # replaced between the two reads
    later = read_cache(path, key, [4, 3, 2], digest=checked.digest)
    assert later.status == "corrupt" and "another checksum" in later.reason and later.flat is None
    assert checked.flat.tolist() == [0.0] * 9  # what was read stays what was read


READ_A_FIFO = """
    import os, sys
    from loops_callbacks.reference.cache import CacheKey, read_cache
    os.mkfifo(sys.argv[1])
    print(read_cache(sys.argv[1], CacheKey("r", "d", "float32"), [1]).reason, flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_or_a_directory_at_the_cache_path_is_reported_not_waited_on(tmp_path: Path) -> None:
    key = CacheKey("r", data_fingerprint(TOKENS), "float32")
    (tmp_path / "dir.cache").mkdir()
    assert read_cache(tmp_path / "dir.cache", key, [4, 3, 2]).status == "corrupt"
    run = run_python("-c", textwrap.dedent(READ_A_FIFO), str(tmp_path / "fifo.cache"),
                     timeout=120)  # (opening a FIFO to read waits for a writer)
    assert run.returncode == 0 and "not a regular file" in run.stdout, run.stderr[-2000:]


TRUNCATED_WHILE_READ = """
    import os, sys
    import numpy as np
    import safetensors
    from loops_callbacks.reference.cache import CacheKey, read_cache, write_cache

    path, key = sys.argv[1], CacheKey("r", "d", "float32")
    write_cache(path, key, [np.full(1 << 20, -0.5)])  # 4 MB of values
    opened = safetensors.safe_open

    class TruncatedOnceOpened:  # another process truncates the file between its header and its values
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)
        def __enter__(self):
            reader = self.file.__enter__()
            os.truncate(path, 4096)
            return reader
        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

    safetensors.safe_open = TruncatedOnceOpened
    lookup = read_cache(path, key, [1 << 20])
    print(lookup.status, lookup.reason, flush=True)
"""


def test_a_cache_file_truncated_while_it_is_read_is_a_damaged_file_not_a_signal_death(tmp_path: Path) -> None:
    run = run_python("-c", textwrap.dedent(TRUNCATED_WHILE_READ), str(tmp_path / "c.cache"), timeout=120)
    assert run.returncode == 0, f"exit {run.returncode} (-7: SIGBUS, a memory map of the truncated file) {run.stderr}"
    assert run.stdout.startswith("corrupt "), run.stdout


# ----------------------------------------------------------------------------- runs sharing a directory


def test_runs_sharing_a_directory_keep_their_caches_and_each_resumes_from_its_own(tmp_path: Path) -> None:
    base = tmp_path / "reference_logprobs" / CACHE_FILE_NAME
    first, first_report, _ = score(base, -0.5, "reference-a")
    with pytest.warns(ReferenceCacheWarning, match="the reference weights changed.*the other caches are kept"):
        second, _, _ = score(base, -0.25, "reference-b")  # another experiment, same directory
    with pytest.warns(ReferenceCacheWarning, match="the data changed"):
        third, _, _ = score(base, -0.125, "reference-b", OTHER_TOKENS)  # and one on other data
    assert len(list_caches(base.parent)) == 3
    for expected, fingerprint, tokens in ((first, "reference-a", TOKENS), (second, "reference-b", TOKENS),
                                          (third, "reference-b", OTHER_TOKENS)):
        values, report = resume(base, fingerprint, tokens)
        assert report.source == "cache" and values.tolist() == expected.tolist()
    # a checkpoint that does not name its reference cannot tell reference-a's cache from reference-b's
    with pytest.raises(ReferenceCacheError, match="made by 2 references .* which one is meant is not known"):
        resume(base, None)
    values, _ = resume(base, None, OTHER_TOKENS)  # (only one cache of these data)
    assert values.tolist() == third.tolist()
    # and a rerun of the first experiment loads its own file, scoring nothing, with no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceCacheWarning)
        again, report, client = score(base, -0.5, "reference-a")
    assert report.source == "cache" and client.scored == 0 and report.cache_path == first_report.cache_path


def test_another_runs_cache_copied_over_this_runs_file_is_not_used(tmp_path: Path) -> None:
    base = tmp_path / CACHE_FILE_NAME
    expected, mine, _ = score(base, -0.5, "reference-a")
    with pytest.warns(ReferenceCacheWarning):
        _, theirs, _ = score(base, -0.25, "reference-b")
    Path(mine.cache_path).write_bytes(Path(theirs.cache_path).read_bytes())  # cp theirs mine
    with pytest.raises(ReferenceCacheError, match="named for this key but was made for another .the reference weights"):
        resume(base, "reference-a")
    with pytest.warns(ReferenceCacheWarning, match="is not used and will be replaced"):
        values, report, client = score(base, -0.5, "reference-a")
    assert client.scored == 3 and values.tolist() == expected.tolist() and report.cache_path == mine.cache_path


def test_a_resume_without_its_cache_names_the_caches_present_and_why_none_matches(tmp_path: Path) -> None:
    base = tmp_path / "reference_logprobs" / CACHE_FILE_NAME
    _, mine, _ = score(base, -0.5, "reference-a")
    with pytest.warns(ReferenceCacheWarning, match="no reference-logprob cache matches this run"):
        score(base, -0.25, "reference-b")
        score(base, -0.25, "reference-a", OTHER_TOKENS)
        score(base, -0.25, "reference-a", cache_tag="bfloat16")
    os.remove(mine.cache_path)
    with pytest.raises(ReferenceCacheError) as error:
        resume(base, "reference-a")
    message = str(error.value)
    assert "none of the 3 cache(s)" in message and message.endswith("(the fix)")
    for why in ("the reference weights changed", "the data changed", "the scoring dtype changed"):
        assert message.count(why) == 1, message
    assert f"{CACHE_TOOL} list {base.parent}" in message
    assert all(os.path.basename(info.path) in message for info in list_caches(base.parent))
    assert f"{mine.cache_path} does not exist" in message  # the file to restore, by name


def test_an_empty_directory_says_the_cache_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ReferenceCacheError, match="does not exist .nor any other cache"):
        resume(tmp_path / CACHE_FILE_NAME, "reference-a")


def test_a_cache_is_a_safetensors_file_with_its_key_and_checksum_in_its_metadata(tmp_path: Path) -> None:
    values, report, _ = score(tmp_path / CACHE_FILE_NAME, -0.5, "reference-a")
    tensors = safetensors.numpy.load_file(report.cache_path)  # a standard reader opens it
    with safetensors.safe_open(report.cache_path, "np") as file:
        metadata = file.metadata()
    assert tensors["values"].tolist() == values.tolist() and tensors["lengths"].tolist() == [4, 3, 2]
    key = CacheKey("reference-a", data_fingerprint(TOKENS), "model")
    assert {name: metadata[name] for name in ("reference", "data", "dtype")} == dataclasses.asdict(key)
    assert len(metadata["sha256"]) == 64


def test_a_cache_of_an_earlier_version_is_named_and_scored_again(tmp_path: Path) -> None:
    base = tmp_path / CACHE_FILE_NAME
    key = CacheKey("reference-a", data_fingerprint(TOKENS), "model")
    earlier = b"LOOPSREF" + bytes(200)  # what earlier versions wrote, under the same name
    Path(cache_file(base, key)).write_bytes(earlier)
    with pytest.raises(ReferenceCacheError, match="cannot be used .it is a cache of an earlier version of "
                                                  "loops-callbacks .the LOOPSREF format."):
        resume(base, "reference-a")
    with pytest.warns(ReferenceCacheWarning, match="is not used and will be replaced: it is a cache of an earlier "
                                                   "version"):
        values, report, client = score(base, -0.5, "reference-a")
    assert client.scored == 3 and report.cache_written and resume(base, "reference-a")[0].tolist() == values.tolist()
    base.write_bytes(earlier)  # the single file of still earlier versions: named when nothing else matches
    with pytest.raises(ReferenceCacheError, match=f"{CACHE_FILE_NAME} .*unreadable: it is a cache of an earlier"):
        resume(base, "reference-b")
    assert [info.problem.startswith("it is a cache of an earlier version") for info in list_caches(tmp_path)] == [
        True, False]


# ----------------------------------------------------------------------------- the writer's temporary file


@pytest.mark.skipif(not hasattr(os, "symlink") or not hasattr(os, "O_NOFOLLOW"), reason="POSIX links")
def test_a_link_planted_at_the_temporary_file_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "c.cache"
    planted = Path(f"{path}.tmp.{socket.gethostname().replace(os.sep, '_')}.{os.getpid()}")
    planted.symlink_to(victim)
    key = CacheKey("r", data_fingerprint(TOKENS), "float32")
    with pytest.raises(FileExistsError, match="temporary file already exists"):
        write_cache(path, key, [np.zeros(len(ids)) for ids in TOKENS])
    assert victim.read_text() == "precious" and not path.exists()
    assert planted.is_symlink()  # not ours: left as it was


@pytest.mark.skipif(not hasattr(os, "symlink") or not hasattr(os, "O_NOFOLLOW"), reason="POSIX links")
def test_the_report_says_whether_the_values_were_cached(tmp_path: Path) -> None:
    base = tmp_path / CACHE_FILE_NAME
    _, report, _ = score(base, -0.5, "reference-a")
    assert report.cache_written and Path(report.cache_path).is_file()
    os.remove(report.cache_path)
    planted = Path(f"{report.cache_path}.tmp.{socket.gethostname().replace(os.sep, '_')}.{os.getpid()}")
    planted.symlink_to(tmp_path / "victim.txt")
    with pytest.warns(ReferenceCacheWarning, match="could not write"):
        _, report, _ = score(base, -0.5, "reference-a")
    assert not report.cache_written and not Path(report.cache_path).exists()


# ----------------------------------------------------------------------------- a header that lies


def _write_by_hand(path: Path, lengths: list[int], values: list[float], **metadata: Any) -> None:
    """A safetensors file with the cache's metadata and a right checksum, made without ``write_cache``'s checks."""
    key = {"reference": "reference-a", "data": data_fingerprint(TOKENS), "dtype": "model", **metadata}
    sizes, flat = np.array(lengths, dtype="<i8"), np.array(values, dtype="<f4")
    digest = hashlib.sha256(sizes.tobytes())
    digest.update(flat.tobytes())
    fields = {"format": "loops-callbacks reference logprobs 3", **key, "sha256": digest.hexdigest()}
    path.write_bytes(safetensors.numpy.save({"values": flat, "lengths": sizes}, metadata=fields))


@pytest.mark.parametrize(
    ("lengths", "values", "metadata", "reason"),
    [
        ([4, 3, 2], [0.0] * 12, {}, "its lengths do not add up to its number of values"),
        ([4, 3, 2], [0.0] * 9, {"dtype": ""}, "the scoring dtype changed"),
        ([5, 2, 2], [0.0] * 9, {}, "its datum lengths do not match the data"),
    ],
)
def test_a_whole_file_whose_contents_do_not_fit_is_not_used(
    tmp_path: Path, lengths: list[int], values: list[float], metadata: dict[str, str], reason: str
) -> None:
    base = tmp_path / CACHE_FILE_NAME
    key = CacheKey("reference-a", data_fingerprint(TOKENS), "model")
    _write_by_hand(Path(cache_file(base, key)), lengths, values, **metadata)
    assert read_cache(cache_file(base, key), key, [4, 3, 2]).reason == reason
    with pytest.raises(ReferenceCacheError, match="cannot be used"):
        resume(base, "reference-a")
    with pytest.warns(ReferenceCacheWarning, match=f"{cache_file(base, key)}.* is not used and will be replaced"):
        values_, again, client = score(base, -0.5, "reference-a")
    assert again.cache_status == "corrupt" and client.scored == 3
    assert resume(base, "reference-a")[1].source == "cache"  # rewritten whole


def test_a_header_that_lies_is_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "c.cache"
    key = CacheKey("r", data_fingerprint(TOKENS), "float32")
    write_cache(path, key, [np.zeros(len(ids)) for ids in TOKENS])
    blob = bytearray(path.read_bytes())
    path.write_bytes(struct.pack("<Q", 1 << 30) + blob[8:])  # a header size beyond the file
    lookup = read_cache(path, key, [4, 3, 2])
    assert lookup.status == "corrupt" and "does not fit" in lookup.reason
    size = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + size])
    header["values"]["shape"] = [10]  # more values than its bytes hold
    text = json.dumps(header).encode().ljust(size)
    path.write_bytes(blob[:8] + text + blob[8 + size :])
    lookup = read_cache(path, key, [4, 3, 2])
    assert lookup.status == "corrupt" and "its header is damaged" in lookup.reason


# ----------------------------------------------------------------------------- cache_tool


def test_cache_tool_lists_and_prunes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / CACHE_FILE_NAME
    _, old, _ = score(base, -0.5, "reference-a")
    os.utime(old.cache_path, (1.0e9, 1.0e9))  # 2001
    with pytest.warns(ReferenceCacheWarning, match="2001-09-09.*the reference weights changed"):
        score(base, -0.25, "reference-b")
    (tmp_path / "notes.txt").write_text("not a cache")
    assert cache_tool(["list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and all("datums" in line and "dtype model" in line for line in listed)
    assert listed[1].startswith(os.path.basename(old.cache_path)) and "2001-09-09" in listed[1]
    assert cache_tool(["prune", str(tmp_path), "--older-than", "30", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and os.path.exists(old.cache_path)
    assert cache_tool(["prune", str(tmp_path), "--older-than", "30"]) == 0
    assert "1 of 2 caches removed" in capsys.readouterr().out
    assert not os.path.exists(old.cache_path) and len(list_caches(tmp_path)) == 1
    assert (tmp_path / "notes.txt").exists()
    with pytest.raises(SystemExit):
        cache_tool(["prune", str(tmp_path)])  # nothing is removed without a selection
    assert "needs --older-than" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_tool(["list", str(tmp_path / "no-such-dir")])  # a mistyped directory is not "no caches"
    assert "does not exist" in capsys.readouterr().err


def test_cache_tool_runs_as_a_module_and_says_nothing_else(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "loops_callbacks", "cache", "list", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, f"no reference-logprob caches in {tmp_path}\n", "")


def test_cache_tool_is_a_subcommand_of_the_console_script(tmp_path: Path) -> None:
    """``loops-callbacks cache ...``: the command the messages and ``--help`` name."""
    script = shutil.which("loops-callbacks", path=os.path.dirname(sys.executable)) or shutil.which("loops-callbacks")
    assert script is not None, "the loops-callbacks console script is not installed"
    run, bad = (subprocess.Popen([script, "cache", command, str(tmp_path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for command in ("list", "prune"))  # at once
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0 and "no reference-logprob caches" in out, err
    _, err = bad.communicate(timeout=120)
    assert bad.returncode == 2 and "nothing is removed by default" in err
    assert CACHE_TOOL == "loops-callbacks cache"


@pytest.mark.skipif(os.name != "posix", reason="the liveness check is POSIX")
def test_cache_tool_lists_and_prunes_the_temporary_files_of_killed_writers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname().replace(os.sep, "_")
    orphan = tmp_path / f"ref_logprobs.0123456789abcdef.cache.tmp.{host}.{dead.pid}"
    kept = [tmp_path / f"ref_logprobs.0123456789abcdef.cache.tmp.{host}.{os.getppid()}",  # a live writer's
            tmp_path / f"notes.txt.tmp.{host}.{dead.pid}"]  # not a cache's
    written = tmp_path / "whole.cache"
    write_cache(written, CacheKey("r", data_fingerprint(TOKENS), "float32"), [np.zeros(1 << 17, np.float32)] * 2)
    for path in (orphan, *kept):  # what a writer killed before its os.replace leaves: a header of ours, then part
        path.write_bytes(written.read_bytes()[: 1 << 20])
    written.unlink()
    assert cache_tool(["list", str(tmp_path)]) == 0
    assert "1 temporary file(s) of killed writers (1.0 MB)" in capsys.readouterr().out
    assert cache_tool(["prune", str(tmp_path), "--older-than", "1"]) == 0  # only --damaged removes them
    assert orphan.exists()
    assert cache_tool(["prune", str(tmp_path), "--damaged"]) == 0
    assert "removed 1 temporary file(s) of killed writers (1.0 MB)" in capsys.readouterr().out  # what was freed
    assert not orphan.exists() and all(path.exists() for path in kept)


def test_cache_tool_refuses_bad_arguments_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refusals = {
        ("prune", str(tmp_path), "--older-than", "abc"): ["argument --older-than: must be", "'abc'"],
        ("prune", str(tmp_path), "--keep-newest", "two"): ["argument --keep-newest: must be", "'two'"],
        ("prune", str(tmp_path)): ["prune needs --older-than DAYS"],
        ("list", str(tmp_path / "absent")): [f"{tmp_path / 'absent'} does not exist"],
        ("lsit", str(tmp_path)): ["invalid choice: 'lsit'"],
        ("prune", str(tmp_path), "--keep", "1"): ["unrecognized arguments: --keep 1"],  # no abbreviation of an option
    }
    for argv, said in refusals.items():
        with pytest.raises(SystemExit) as exit_status:
            cache_tool(list(argv))
        error = capsys.readouterr().err
        assert exit_status.value.code == 2 and error.count("\n") == 1 and error.startswith("loops-callbacks cache"), (
            argv, error)
        assert all(part in error for part in said) and "_days" not in error, (argv, error)


@pytest.mark.skipif(os.name != "posix", reason="symlinks, FIFOs and the liveness check are POSIX")
def test_cache_tool_lists_entries_that_are_not_regular_files_as_not_ours_and_never_removes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Broken links, directories and FIFOs where caches or writers' temporary files are: named, never a crash, never
    removed (the writer makes none of them; test_reference_cache_prune.py has every kind of other program's file)."""
    cache_dir, outside = tmp_path / "cache", tmp_path / "outside"
    cache_dir.mkdir()
    outside.mkdir()
    _, report, _ = score(cache_dir / CACHE_FILE_NAME, -0.5, "reference-a")  # one real cache, kept
    dead = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for process in dead:
        process.wait()
    host = socket.gethostname().replace(os.sep, "_")
    link, directory = (cache_dir / f"ref_logprobs.0123456789abcdef.cache.tmp.{host}.{p.pid}" for p in dead)
    link.symlink_to(tmp_path / "gone")  # where temporary files of killed writers would be: a broken link,
    directory.mkdir()  # and an empty directory
    (cache_dir / "linked.cache").symlink_to(outside / "target.cache")  # caches that cannot be used
    (outside / "target.cache").write_bytes(b"LOOPSREF" + b"\0" * 100)  # (the link's target is left alone)
    os.mkfifo(cache_dir / "pipe.cache")
    (cache_dir / "dangling.cache").symlink_to(tmp_path / "gone")
    (cache_dir / "folder.cache").mkdir()
    (cache_dir / "folder.cache" / "notes.txt").write_text("someone's")
    before = sorted(os.listdir(cache_dir))

    assert cache_tool(["list", str(cache_dir)]) == 0
    listed = capsys.readouterr().out.splitlines()
    for name, problem in (("dangling.cache", "not ours, left alone: it is a broken symbolic link"),
                          ("folder.cache", "not ours, left alone: it is a directory"),
                          ("pipe.cache", "not ours, left alone: it is not a regular file"),
                          ("linked.cache", "not ours, left alone: it is a symbolic link (to ")):
        assert any(line.startswith(name) and problem in line for line in listed), (name, listed)
    assert not any("temporary file" in line for line in listed), listed  # neither is a file of ours
    assert cache_tool(["prune", str(cache_dir), "--damaged", "--keep-newest", "0"]) == 0
    pruned = capsys.readouterr().out
    assert "1 of 1 caches removed" in pruned and "removed 0 temporary file(s)" not in pruned, pruned
    assert sorted(os.listdir(cache_dir)) == sorted(set(before) - {os.path.basename(report.cache_path)})
    assert (outside / "target.cache").read_bytes().startswith(b"LOOPSREF")  # a link's target is left alone
    assert (cache_dir / "folder.cache" / "notes.txt").read_text() == "someone's"
