"""The command line's user errors and outputs: one line on stderr and status 2 (a traceback with --debug),
checks before any work, and output sets that are written whole or not at all."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from diffusion_int8 import pipelines
from diffusion_int8.__main__ import main
from diffusion_int8.calibration import Calibration
from diffusion_int8.cli import outputs
from diffusion_int8.cli.common import read_items
from diffusion_int8.cli.usage import UsageError
from processes import cli_env

CALIBRATE = ["calibrate", "--class-labels", "red circle", "--steps", "1", "--batch-size", "1"]
EVAL = ["eval", "--class-labels", "red circle", "--steps", "1", "--modes", "int8"]


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    monkeypatch.delenv("DIFFUSION_INT8_DEBUG", raising=False)


def cli(argv, capsys) -> tuple[int, str]:
    """Run ``diffusion-int8 argv`` in this process: (exit status, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's errors
        code = e.code
    return code, capsys.readouterr().err


def assert_usage_error(code, err, command, *fragments, alone=True):
    """Status 2 and one line ``diffusion-int8 <command>: error: ...`` holding ``fragments``, no traceback;
    ``alone``: nothing else on stderr (else the line is the last, after the model loading's progress bar)."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err and (len(lines) == 1 if alone else lines), err
    assert lines[-1].startswith(f"diffusion-int8 {command}: error: "), err
    assert sum(": error: " in ln for ln in lines) == 1, err
    for f in fragments:
        assert str(f) in lines[-1], (f, err)


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the pipeline loads: the checks must come before any work."""

    def load(*_, **__):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(pipelines, "load", load)


@pytest.fixture
def no_images(monkeypatch):
    """Fail the test if an image is generated."""

    def generate(*_, **__):
        raise AssertionError("an image was generated before the inputs were checked")

    monkeypatch.setattr(pipelines, "generate", generate)


# ------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("argv, fragment", [
    (["calibrate", "--steps", "0", "--out", "x"], "argument --steps: must be an integer >= 1, got 0"),
    (["eval", "--batch-size", "-2", "--out", "x"], "argument --batch-size: must be an integer >= 1, got -2"),
    (["eval", "--seed", "-1", "--out", "x"], "argument --seed: must be an integer >= 0, got -1"),
    (["calibrate", "--steps", "many", "--out", "x"], "argument --steps: must be an integer >= 1, got 'many'"),
    (["calibrate", "--percentile", "0", "--out", "x"], "argument --percentile: must be a percentile in (0, 100], got '0'"),
    (["calibrate", "--percentile", "100.5", "--out", "x"], "must be a percentile in (0, 100]"),
    (["calibrate", "--budget", "nan", "--out", "x"], "argument --budget: must be a finite number, got 'nan'"),
    (["calibrate", "--budget", "inf", "--out", "x"], "must be a finite number, got 'inf'"),
    (["calibrate", "--budget", "0", "--out", "x"], "argument --budget: must be a relative L1 error in (0, 1], got '0'"),
    (["calibrate", "--budget", "2", "--out", "x"], "must be a relative L1 error in (0, 1], got '2' (1 is an error as"),
    (["calibrate", "--carry-budget", "1.5", "--out", "x"], "argument --carry-budget: must be a relative L1 error in"),
    (["eval", "--guidance-scale", "-1", "--out", "x"], "argument --guidance-scale: must be a finite number >= 0"),
    (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["demo", "--budget", "-0.1"], "argument --budget: must be a relative L1 error in (0, 1]"),
    (["check", "--shape", "1", "0", "256", "64"], "argument --shape: must be an integer >= 1, got 0"),
    (["eval", "--modes", "int4", "--out", "x"], "argument --modes: invalid choice: 'int4'"),
    (["eval", "--modes", "int8", "int8", "--out", "x"], "modes lists a mode twice: ['int8', 'int8']"),
    (["eval", "--modes", "--out", "x"], "nothing to compare with fp16: give --modes (int8, int8_fp16v), --schedule"),
    (["calibrate"], "the following arguments are required: --out"),
    # an unset shell variable: not the current directory, nor no file
    (["calibrate", "--out", ""], "argument --out: is empty (an unset shell variable?); give a path"),
    (["demo", "--out", " "], "argument --out: is empty"),
    (["eval", "--calibration", "", "--out", "x"], "argument --calibration: is empty"),
    (["eval", "--schedule", "", "--out", "x"], "argument --schedule: is empty"),
    (["eval", "--prompts", "", "--out", "x"], "argument --prompts: is empty"),
    (["eval", "--model", "", "--out", "x"], "argument --model: is empty"),
    (["eval", "--score", "", "b", "--out", "x"], "argument --score: is empty"),
    (["check", "--json", ""], "argument --json: is empty"),
    (["tune", "--out", ""], "argument --out: is empty"),
])
def test_arguments_are_range_checked_in_one_line(argv, fragment, capsys, no_model):
    code, err = cli(argv, capsys)
    assert_usage_error(code, err, argv[0], fragment)


def test_score_refuses_folders_of_other_image_sizes_in_one_line(tmp_path, capsys):
    import torch

    from diffusion_int8.eval.score import save_images

    save_images(torch.rand(2, 3, 32, 32), tmp_path / "ref", [0, 1])
    save_images(torch.rand(2, 3, 16, 16), tmp_path / "cand", [0, 1])
    code, err = cli(["eval", "--score", tmp_path / "ref", tmp_path / "cand", "--out", tmp_path / "out"], capsys)
    assert_usage_error(code, err, "eval", f"{tmp_path / 'cand'} holds 16×16 images and {tmp_path / 'ref'} 32×32",
                       alone=False)
    assert not (tmp_path / "out").exists()
    save_images(torch.rand(1, 3, 32, 32), tmp_path / "few", [0])
    code, err = cli(["eval", "--score", tmp_path / "ref", tmp_path / "few", "--out", tmp_path / "out"], capsys)
    assert_usage_error(code, err, "eval", f"{tmp_path / 'few'} (1 image) and {tmp_path / 'ref'} (2) hold different "
                       f"file names (only in {tmp_path / 'ref'}: 00001.png)", alone=False)
    # a folder of other pictures, of mixed sizes (a calibration's plots): told by its names, not by their sizes
    from PIL import Image

    (tmp_path / "plots").mkdir()
    Image.new("RGB", (70, 38)).save(tmp_path / "plots" / "errors.png")
    Image.new("RGB", (174, 40)).save(tmp_path / "plots" / "ranges.png")
    code, err = cli(["eval", "--score", tmp_path / "ref", tmp_path / "plots", "--out", tmp_path / "out"], capsys)
    assert_usage_error(code, err, "eval", f"{tmp_path / 'plots'} (2 images) and {tmp_path / 'ref'} (2) hold different "
                       f"file names (only in {tmp_path / 'plots'}: errors.png, ranges.png; only in", alone=False)


# ------------------------------------------------------------------------------------ --out
def test_out_is_checked_before_any_work(tmp_path, capsys, no_model, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for argv in (CALIBRATE, EVAL, ["demo"]):
        code, err = cli(argv + ["--out", a_file], capsys)
        assert_usage_error(code, err, argv[0], f"--out {a_file} is a file")
        code, err = cli(argv + ["--out", a_file / "sub" / "out"], capsys)
        assert_usage_error(code, err, argv[0], f"{a_file} is a file, not a directory")
    previous = tmp_path / "previous"
    (previous / "images").mkdir(parents=True)
    (previous / "schedule.json").write_text("{}")
    for argv, name in ((CALIBRATE, "schedule.json"), (EVAL, "images"), (["demo"], "images")):
        code, err = cli(argv + ["--out", previous], capsys)
        assert_usage_error(code, err, argv[0], f"{previous} already holds {name}", "pass --overwrite")
    # the parent must be writable: the outputs are written beside --out, then renamed into it
    monkeypatch.setattr(outputs.os, "access", lambda *_: False)
    code, err = cli(CALIBRATE + ["--out", tmp_path / "new" / "cal"], capsys)
    assert_usage_error(code, err, "calibrate", f"cannot write in {tmp_path} (permission denied)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "previous"]  # nothing made


# ---------------------------------------------------------------------------------- input files
def test_prompt_files_missing_empty_or_not_text(tmp_path, capsys, no_model):
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"PK\x03\x04\x00\x00")
    cases = [(tmp_path / "missing.txt", "does not exist"), (tmp_path, "is a directory"),
             ("/dev/zero", "is neither a file nor a pipe"),  # a device would be read without end
             (empty, "holds no prompts"), (latin1, "is not UTF-8 text (byte 3: invalid continuation byte)"),
             (binary, "holds NUL bytes")]
    for path, fragment in cases:
        for command in ("calibrate", "eval"):
            code, err = cli([command, "--prompts", path, "--out", tmp_path / "out"], capsys)
            assert_usage_error(code, err, command, f"prompt file {path}", fragment)
    long = tmp_path / "long.txt"  # a line naming no class is shown cut, not echoed whole
    long.write_text("a" * 1_000_000 + "\n")
    code, err = cli(["eval", "--prompts", long, "--out", tmp_path / "out"], capsys)
    assert_usage_error(code, err, "eval", "... (1,000,000 characters) names no class")
    assert len(err) < 1000


def test_prompts_from_a_pipe_are_read(tmp_path):
    """``--prompts /dev/stdin`` or ``<(...)``: a pipe is not a regular file, but it holds prompts all the same."""
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)

    def write():  # opening blocks until the reader opens its end
        with open(fifo, "w") as f:
            f.write("# a comment\na red circle\n\na blue square\n")

    writer = threading.Thread(target=write)
    writer.start()
    items = read_items(fifo, None, pipelines.EMBEDDED)  # the CLI's reading, its permission check included
    writer.join()
    assert (items.kind, items.values) == ("prompt", ["a red circle", "a blue square"])


def test_schedule_and_calibration_load_before_the_model(tmp_path, capsys, no_model):
    bad_schedule = tmp_path / "schedule.json"
    bad_schedule.write_text(json.dumps({"schema_version": 1, "kind": "rules", "default": "int8", "rules": [{"min_noise": 0.5}]}))
    code, err = cli(EVAL + ["--schedule", bad_schedule, "--out", tmp_path / "r"], capsys)
    assert_usage_error(code, err, "eval", f"{bad_schedule}: rules[0].mode: missing")
    code, err = cli(EVAL + ["--schedule", "balance", "--out", tmp_path / "r"], capsys)
    assert_usage_error(code, err, "eval", "balance is neither a schedule file nor a preset (int8, int8_fp16v, fp16, balanced)")
    not_calibration = tmp_path / "calibration.safetensors"
    not_calibration.write_bytes(b"not safetensors")
    code, err = cli(EVAL + ["--calibration", tmp_path, "--out", tmp_path / "r"], capsys)
    assert_usage_error(code, err, "eval", f"{not_calibration} is not a calibration")
    code, err = cli(EVAL + ["--calibration", tmp_path / "nowhere", "--out", tmp_path / "r"], capsys)
    assert_usage_error(code, err, "eval", "no calibration file at", "make one with `diffusion-int8 calibrate`")
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A ``calibrate`` output set of the shipped model (one label, one step)."""
    out = tmp_path_factory.mktemp("calibrated") / "cal"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFUSION_INT8_BACKEND", "emulation")
        assert main([*CALIBRATE, "--out", str(out)]) == 0
    return out


def test_calibration_is_validated_against_the_model_before_any_image(calibrated, tmp_path, capsys, no_images):
    cal = Calibration.load(calibrated)
    first = next(iter(cal.layers))
    cal.layers["elsewhere.attn1"] = cal.layers.pop(first)
    cal.meta["layers"]["elsewhere.attn1"] = cal.meta["layers"].pop(first)
    path = cal.save(tmp_path / "renamed.safetensors")
    capsys.readouterr()
    code, err = cli(EVAL + ["--calibration", path, "--out", tmp_path / "r"], capsys)
    assert_usage_error(code, err, "eval", "does not match this model", "layers not in the model: elsewhere.attn1",
                       alone=False)
    code, err = cli(["eval", "--class-labels", "red circle", "purple blob", "--out", tmp_path / "r"], capsys)
    assert_usage_error(code, err, "eval", "'purple blob' names no class", alone=False)
    assert not (tmp_path / "r").exists()


def test_debug_shows_the_traceback(tmp_path, capsys, no_model, monkeypatch):
    argv = EVAL + ["--schedule", tmp_path / "missing.json", "--out", tmp_path / "r"]
    with pytest.raises(UsageError, match="no schedule file at .*missing.json") as err:
        main(["--debug", *map(str, argv)])
    assert isinstance(err.value.__cause__, FileNotFoundError)  # the original error, chained
    with pytest.raises(UsageError, match="no schedule file at"):  # after the command too
        main([*map(str, argv), "--debug"])
    monkeypatch.setenv("DIFFUSION_INT8_DEBUG", "1")
    with pytest.raises(UsageError):
        main([str(a) for a in argv])


def test_entry_point_prints_one_line_and_exits_2(tmp_path):
    argv = [sys.executable, "-m", "diffusion_int8", "eval", "--schedule", "missing.json", "--out", "r"]
    res = subprocess.run(argv, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "diffusion-int8 eval: error: no schedule file at missing.json (nor is it a preset: "
        "int8, int8_fp16v, fp16, balanced)"], res.stderr
    res = subprocess.run(argv, cwd=tmp_path, env={**cli_env(), "DIFFUSION_INT8_DEBUG": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1 and "Traceback" in res.stderr and "FileNotFoundError" in res.stderr, res.stderr


# ---------------------------------------------------------------------------------- output sets
def snapshot(root) -> dict:
    """Every file under ``root`` (relative path -> bytes) and the names beside it."""
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return {"files": files, "beside": sorted(p.name for p in root.parent.iterdir())}


def fill(folder, names, text):
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        if n == "images":
            (folder / n / "a").mkdir(parents=True)
            (folder / n / "a" / "00000.png").write_text(text)
        else:
            (folder / n).write_text(text)


NAMES = ("report.json", "report.md", "images")


def test_a_killed_runs_temporary_directory_goes_at_the_next_run(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # a process that has ended, as one killed outright
    killed, live, replaced, recent = (tmp_path / f".out.{k}-{p}" for k, p in (
        ("tmp", dead), ("tmp", os.getppid()), ("old", dead), ("tmp", dead + 1_000_000)))  # no such pid here
    for folder in (killed, live, replaced, recent):
        fill(folder, NAMES[:1], "a run's")
    for folder in (killed, live, replaced):  # an hour untouched; recent: maybe a run in another container
        os.utime(folder, (time.time() - 2 * outputs.KILLED_AFTER_S,) * 2)
    with pytest.warns(RuntimeWarning, match=r"\.out\.old-\d+ holds outputs a killed run was replacing"):
        with outputs.output_set(tmp_path / "out", NAMES, overwrite=False) as tmp:
            fill(tmp, NAMES, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, replaced.name, recent.name])


def test_output_set_failing_writer_leaves_nothing_or_the_previous_set(tmp_path):
    fresh = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        with outputs.output_set(fresh, NAMES, overwrite=False) as tmp:
            fill(tmp, NAMES[:2], "new")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # neither the set, its temporary directory, nor the parents made for it
    out = tmp_path / "out"
    fill(out, NAMES, "old")
    (out / "notes.txt").write_text("the user's")
    before = snapshot(out)
    with pytest.raises(KeyboardInterrupt):
        with outputs.output_set(out, NAMES, overwrite=True) as tmp:
            fill(tmp, NAMES, "new")
            raise KeyboardInterrupt
    assert snapshot(out) == before


@pytest.mark.parametrize("fail_at", range(1, 7))
def test_output_set_failing_move_puts_the_previous_set_back(tmp_path, monkeypatch, fail_at):
    out = tmp_path / "out"
    fill(out, NAMES, "old")
    (out / "notes.txt").write_text("the user's")
    before = snapshot(out)
    moves, real = [], outputs._move

    def move(src, dst):
        moves.append((src, dst))
        if len(moves) == fail_at:
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(outputs, "_move", move)
    with pytest.raises(OSError, match="disk full"):
        with outputs.output_set(out, NAMES, overwrite=True) as tmp:
            fill(tmp, NAMES, "new")
    assert len(moves) >= fail_at and snapshot(out) == before


def test_overwrite_refuses_to_delete_files_of_the_users_in_an_output_folder(tmp_path):
    out = tmp_path / "out"
    fill(out, NAMES, "old")
    (out / "images" / "keep.png").write_text("the user's")
    (out / "images" / "a" / "notes.txt").write_text("the user's")
    before = snapshot(out)
    with pytest.raises(UsageError, match=r"--overwrite replaces images in .* whole, and it holds files no "
                                         r"diffusion-int8 command writes there: images/a/notes.txt, images/keep.png; "
                                         r"move them out"):
        with outputs.output_set(out, NAMES, overwrite=True) as tmp:
            fill(tmp, NAMES, "new")
    assert snapshot(out) == before
    (out / "images" / "keep.png").unlink()
    (out / "images" / "a" / "notes.txt").unlink()
    (out / "images" / "a" / "100000.png").write_text("old")  # the commands' numbering past 99999
    with outputs.output_set(out, NAMES, overwrite=True) as tmp:  # the commands' own files alone: replaced
        fill(tmp, NAMES, "new")
    assert snapshot(out)["files"]["images/a/00000.png"] == b"new"
    # a report of eval --score names the folders it was given, wherever they are: then any numbered image counts
    (out / "report.json").write_text(json.dumps({"image_dirs": {"fp16": str(out / "images" / "a")}}))
    with outputs.output_set(out, NAMES, overwrite=True) as tmp:
        fill(tmp, NAMES, "new")
    # a folder of numbered images the report beside it does not list is the user's
    (out / "report.json").write_text(json.dumps({"image_dirs": {"fp16": "images/a"}}))
    (out / "images" / "mine").mkdir()
    (out / "images" / "mine" / "00000.png").write_text("the user's")
    with pytest.raises(UsageError, match=r"holds files no diffusion-int8 command writes there: images/mine/00000.png"):
        with outputs.output_set(out, NAMES, overwrite=True) as tmp:
            fill(tmp, NAMES, "new")
    assert (out / "images" / "mine" / "00000.png").read_text() == "the user's"


def test_output_set_replaces_the_whole_set_and_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    fill(out, NAMES, "old")
    (out / "notes.txt").write_text("the user's")
    with outputs.output_set(out, NAMES, overwrite=True) as tmp:
        fill(tmp, ("report.json",), "new")
    got = snapshot(out)
    assert got["files"] == {"notes.txt": b"the user's", "report.json": b"new"}  # no old report.md or images left
    assert got["beside"] == ["out"]
    with pytest.raises(UsageError, match="pass --overwrite"):
        with outputs.output_set(out, NAMES, overwrite=False):
            pass
    with pytest.raises(RuntimeError, match="not among the declared"):
        with outputs.output_set(out, NAMES, overwrite=True) as tmp:
            fill(tmp, ("report.html",), "new")
    assert snapshot(out) == got


def _raise(*_, **__):
    raise RuntimeError("interrupted")


def test_interrupted_calibrate_keeps_the_previous_outputs(calibrated, tmp_path, monkeypatch):
    out = tmp_path / "cal"
    shutil.copytree(calibrated, out)
    before = snapshot(out)
    from diffusion_int8.calibration import summary
    from diffusion_int8.schedule import PrecisionSchedule

    # before the first file, after the first, after all but the plots
    for owner, name in ((Calibration, "save"), (PrecisionSchedule, "save"), (summary, "plot")):
        with monkeypatch.context() as mp:
            mp.setattr(owner, name, _raise)
            with pytest.raises(RuntimeError, match="interrupted"):  # a failure, not a user error: its traceback
                main([*CALIBRATE, "--seed", "1", "--out", str(out), "--overwrite"])
        assert snapshot(out) == before, name
    with monkeypatch.context() as mp:
        mp.setattr(Calibration, "save", _raise)
        with pytest.raises(RuntimeError, match="interrupted"):
            main([*CALIBRATE, "--out", str(tmp_path / "new")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal"]


def test_interrupted_eval_keeps_the_previous_outputs(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    assert main([*EVAL, "--class-labels", "red circle", "blue ring", "--out", str(out)]) == 0
    before = snapshot(out)
    from diffusion_int8.eval import report
    from diffusion_int8.eval import run as eval_run

    calls = []

    def second_image_set_fails(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real_save(*a, **kw)

    real_save = eval_run.save_images
    for owner, name, fn in ((eval_run, "save_images", second_image_set_fails), (report, "write_html", _raise)):
        with monkeypatch.context() as mp:
            mp.setattr(owner, name, fn)
            with pytest.raises(RuntimeError, match="interrupted"):
                main([*EVAL, "--seed", "3", "--out", str(out), "--overwrite"])
        assert snapshot(out) == before, name
    # a whole new set replaces the old one, stale files included: --generate-only writes no report.md
    assert main([*EVAL, "--generate-only", "--out", str(out), "--overwrite"]) == 0
    got = snapshot(out)
    assert sorted(got["files"]) == ["images/fp16/00000.png", "images/int8/00000.png", "report.json"]
    assert got["beside"] == ["rep"]


# ------------------------------------------------------------------------------------------ help
@pytest.mark.parametrize("command", [None, "demo", "calibrate", "eval", "check", "tune"])
def test_help_is_plain_text_with_a_description_and_defaults(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one help line per option, for the checks below
    with pytest.raises(SystemExit) as done:
        main([command, "--help"] if command else ["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out, out  # the docstrings' reST literals are shown as plain text
    description = out.split("\n\n")[1]
    assert len(description) > 60 and not description.lstrip().startswith(("-h", "options")), out
    # each option's text: its line and the indented lines under it, whitespace collapsed
    lines = {m.group(1): " ".join(m.group(0).split())
             for m in re.finditer(r"^  (--[\w-]+)[^\n]*(?:\n {6,}\S[^\n]*)*", out, re.M)}
    if command in ("demo", "calibrate", "eval"):
        for option, default in (("--steps", "20" if command != "demo" else "20; on a CPU, 10"), ("--seed", 0),
                                ("--batch-size", 16 if command == "demo" else 8)):
            assert f"(default: {default})" in lines[option], lines[option]
    if command == "check":
        assert "(default: 1 4 1024 64)" in lines["--shape"]
    if command == "demo":
        assert "(default: 0.015)" in lines["--budget"] and "calibrate's default 0.02" in lines["--budget"]
    if command == "calibrate":
        assert "(default: 0.02)" in lines["--budget"]


def test_check_prints_the_shape_in_the_order_shape_takes(capsys):
    assert main(["check", "--shape", "1", "2", "48", "16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("attention (B=1, H=2, S=48, D=16) fp16 on cpu"), out


# ------------------------------------------------------------------------------- probe: bad input
@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without a CUDA GPU, whatever this one has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("command", [CALIBRATE, EVAL, ["demo"], ["check"], ["eval", "--score", "a", "b"]],
                         ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("device, fragment", [
    ("foo", "must be cpu, cuda or cuda:N, got 'foo'"),
    ("cuda", "'cuda' is not available: this machine has no CUDA GPU; use cpu"),
    ("cuda:7", "'cuda:7' is not available: this machine has no CUDA GPU; use cpu"),
])
def test_device_is_checked_up_front(command, device, fragment, tmp_path, capsys, no_model, no_cuda):
    code, err = cli(command + ["--device", device] + (["--out", tmp_path / "o"] if command[0] != "check" else []),
                    capsys)
    assert_usage_error(code, err, command[0], "argument --device: ", fragment)


def test_device_index_beyond_the_gpus(tmp_path, capsys, no_model, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, err = cli(CALIBRATE + ["--device", "cuda:7", "--out", tmp_path / "o"], capsys)
    assert_usage_error(code, err, "calibrate", "'cuda:7' is not available: this machine has 2 CUDA GPUs (cuda:0 to cuda:1)")


def test_model_directory_that_is_not_a_pipeline(tmp_path, capsys):
    shipped = pipelines.VARIANTS["base"].path
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "model_index.json").write_text('{"_class_name": ')
    a_list = tmp_path / "a_list"
    a_list.mkdir()
    (a_list / "model_index.json").write_text("[1, 2]")
    no_component = tmp_path / "no_component"
    shutil.copytree(shipped, no_component)
    shutil.rmtree(no_component / "transformer")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(shipped, no_weights)
    (no_weights / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    unknown = tmp_path / "unknown"  # a pipeline class of a newer diffusers, or a typo
    shutil.copytree(shipped, unknown)
    index = unknown / "model_index.json"
    index.write_text(index.read_text().replace("ShapesPipeline", "FluxKontextProPipeline"))
    cases = [(unknown, "names the pipeline class 'FluxKontextProPipeline', which diffusers"),
             (malformed, "model_index.json: not valid JSON: Expecting value at line 1"),
             (a_list, "model_index.json is not a diffusers model index (a JSON object with _class_name)"),
             (no_component, "has no transformer/ (model_index.json lists it)"),
             (no_weights, "cannot be loaded: Error no file named diffusion_pytorch_model")]
    for model, fragment in cases:
        for argv in (CALIBRATE, EVAL):
            code, err = cli(argv + ["--model", model, "--out", tmp_path / "o"], capsys)
            assert_usage_error(code, err, argv[0], model, fragment, alone=False)
    assert not (tmp_path / "o").exists()


@pytest.fixture
def no_check_work(monkeypatch):
    """Fail the test if ``check`` makes its attention inputs."""
    from diffusion_int8.cli import check

    def realistic_qkv(*_, **__):
        raise AssertionError("check made its inputs before the arguments were checked")

    monkeypatch.setattr(check, "realistic_qkv", realistic_qkv)


def test_check_refuses_shapes_it_cannot_run_before_any_work(tmp_path, capsys, no_check_work):
    code, err = cli(["check", "--shape", "1", "1", "64", "300", "--device", "cpu"], capsys)
    assert_usage_error(code, err, "check", "--shape: head dim 300 is not supported; accepted: 1 to 256")
    code, err = cli(["check", "--shape", "1", "1", "2000000", "64", "--device", "cpu"], capsys)
    assert_usage_error(code, err, "check", "--shape 1 1 2000000 64 (float64 reference attention) needs about 64 TB",
                       "available on cpu",
                       "choose a smaller B, H or S")


def test_check_says_which_kernel_ran_and_replaces_its_json_only_when_asked(tmp_path, capsys, monkeypatch):
    from diffusion_int8.cli import check

    asked = []
    real = check.kernel_info
    monkeypatch.setattr(check, "kernel_info", lambda *a, **kw: asked.append(kw.get("head_dim")) or real(*a, **kw))
    assert main(["check", "--shape", "1", "2", "48", "40", "--device", "cpu", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert asked == [40, 40, 40]  # the head dim of --shape, not a default
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and "cos=" in ln}
    assert "kernel=emulation" in lines["int8"] and "kernel=sdpa" in lines["fp16"], out
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["mode"]: r["kernel"] for r in rows} == {"int8": "emulation", "int8_fp16v": "emulation", "fp16": "sdpa"}
    # the file is there now: replaced only when asked
    argv = ["check", "--shape", "1", "2", "48", "40", "--device", "cpu", "--json", tmp_path / "r.json"]
    (tmp_path / "r.json").write_text("mine")
    code, err = cli(argv, capsys)
    assert_usage_error(code, err, "check", f"--json {tmp_path / 'r.json'} exists; pass --overwrite to replace it")
    assert (tmp_path / "r.json").read_text() == "mine"
    assert main([str(a) for a in argv] + ["--overwrite"]) == 0
    assert len(json.loads((tmp_path / "r.json").read_text())) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left beside it


def test_json_outputs_keep_permissions_follow_links_and_refuse_devices(tmp_path, capsys, no_check_work):
    import stat

    from diffusion_int8 import jsonfile

    old = os.umask(0o022)
    try:
        jsonfile.write(tmp_path / "new.json", [1])
        assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644  # a new file's, not mkstemp's 0600
        (tmp_path / "kept.json").write_text("{}")
        (tmp_path / "kept.json").chmod(0o640)
        jsonfile.write(tmp_path / "kept.json", [2])
        assert stat.S_IMODE((tmp_path / "kept.json").stat().st_mode) == 0o640
    finally:
        os.umask(old)
    (tmp_path / "link.json").symlink_to(tmp_path / "kept.json")
    jsonfile.write(tmp_path / "link.json", [3])
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "kept.json").read_text()) == [3]
    code, err = cli(["check", "--device", "cpu", "--json", "/dev/null", "--overwrite"], capsys)
    assert_usage_error(code, err, "check", "--json /dev/null is not a regular file; give a file name")


def test_check_json_destination_is_checked_before_any_work(tmp_path, capsys, no_check_work, monkeypatch):
    missing = tmp_path / "missing" / "r.json"
    code, err = cli(["check", "--device", "cpu", "--json", missing], capsys)
    assert_usage_error(code, err, "check", f"--json {missing}: the directory {missing.parent} does not exist")
    code, err = cli(["check", "--device", "cpu", "--json", tmp_path], capsys)
    assert_usage_error(code, err, "check", f"--json {tmp_path} is a directory")
    monkeypatch.setattr(outputs.os, "access", lambda *_: False)
    code, err = cli(["check", "--device", "cpu", "--json", tmp_path / "r.json"], capsys)
    assert_usage_error(code, err, "check", f"--json {tmp_path / 'r.json'}: cannot write in {tmp_path} (permission denied)")


@pytest.fixture
def fake_gpu(monkeypatch):
    """``tune`` on a pretend GPU whose measurement fails the test unless replaced."""
    import torch
    from diffusion_int8.cli import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def measure(*_, **__):
        raise AssertionError("tune measured before --out was checked")

    monkeypatch.setattr(tune, "measure", measure)
    return tune


def test_tune_out_is_checked_before_measuring(tmp_path, capsys, fake_gpu, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, fragment in ((tmp_path, f"--out {tmp_path} is a directory"),
                          (a_file / "t.json", f"{a_file} is a file, not a directory"),
                          (a_file, f"--out {a_file} exists; pass --overwrite")):
        code, err = cli(["tune", "--out", out], capsys)
        assert_usage_error(code, err, "tune", fragment)
    # no --out: the cached table, named as such
    monkeypatch.setattr(fake_gpu, "cache_path", lambda device: a_file)
    code, err = cli(["tune"], capsys)
    assert_usage_error(code, err, "tune", f"the cached table (no --out given) {a_file} exists; pass --overwrite")
    monkeypatch.setattr(outputs.os, "access", lambda *_: False)
    code, err = cli(["tune", "--out", tmp_path / "new" / "t.json"], capsys)
    assert_usage_error(code, err, "tune", f"cannot write in {tmp_path} (permission denied)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_tune_names_what_it_does_not_accept_before_measuring(tmp_path, capsys, fake_gpu):
    for flag, value in (("--kinds", "plain,causal"), ("--dtypes", "float32"), ("--head-dims", "0")):
        code, err = cli(["tune", "--out", tmp_path / "t.json", flag, value], capsys)
        assert_usage_error(code, err, "tune", "not accepted: [")
        assert "kinds ['plain', 'tail', 'key']" in err
    code, err = cli(["tune", "--out", tmp_path / "t.json", "--kinds", "key,tail"], capsys)
    assert_usage_error(code, err, "tune", "--kinds must include plain")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("failure, status", [(OSError("No space left on device"), 2), (KeyboardInterrupt(), 130)])
def test_tune_leaves_no_temporary_file(failure, status, tmp_path, capsys, fake_gpu, monkeypatch):
    from diffusion_int8.plugin import speed_gate

    monkeypatch.setattr(fake_gpu, "measure", lambda *_, **__: speed_gate.CrossoverTable("test", "sm_90", ()))
    real_replace = speed_gate.os.replace

    def replace(src, dst):
        if str(dst).endswith("t.json"):
            raise failure
        real_replace(src, dst)

    monkeypatch.setattr(speed_gate.os, "replace", replace)
    code, err = cli(["tune", "--out", tmp_path / "t.json"], capsys)
    assert code == status and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def unprivileged() -> list[str]:
    """A command prefix under which a mode-000 file cannot be read: none for a user, for root one without the
    capabilities that read any file."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root reads any file, and setpriv is missing to drop that capability")
    drop = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("root reads any file, and this container does not let setpriv drop that capability")
    return prefix


def test_unreadable_input_files_say_permission_denied(calibrated, tmp_path):
    prefix = unprivileged()
    cal = tmp_path / "cal.safetensors"
    shutil.copy(calibrated / "calibration.safetensors", cal)
    schedule = tmp_path / "schedule.json"
    shutil.copy(calibrated / "schedule.json", schedule)
    cal_dir = tmp_path / "cal_dir"
    cal_dir.mkdir()
    shutil.copy(calibrated / "calibration.safetensors", cal_dir)
    for p in (cal, schedule, cal_dir / "calibration.safetensors"):
        p.chmod(0)
    for option, path, named in (("--calibration", cal, cal), ("--schedule", schedule, schedule),
                                ("--calibration", cal_dir, cal_dir / "calibration.safetensors")):
        argv = [*prefix, sys.executable, "-m", "diffusion_int8", *EVAL, option, str(path), "--out", "r"]
        res = subprocess.run(argv, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [
            f"diffusion-int8 eval: error: cannot read {named} (permission denied)"], res.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["calibrate", "--steps", "1000000000", "--out", "x"], "argument --steps: must be an integer from 1 to 10000"),
    (["eval", "--steps", "10001", "--out", "x"], "argument --steps: must be an integer from 1 to 10000"),
    (["demo", "--steps", "99999"], "argument --steps: must be an integer from 1 to 10000"),
    (["calibrate", "--batch-size", "1000000000", "--out", "x"], "argument --batch-size: must be an integer from 1 to 4096"),
    (["demo", "--batch-size", "5000"], "argument --batch-size: must be an integer from 1 to 4096"),
    (["eval", "--seed", str(2**64), "--out", "x"], f"argument --seed: must be an integer from 0 to {2**63 - 1}"),
])
def test_absurd_counts_are_refused_with_the_accepted_range(argv, fragment, capsys, no_model):
    code, err = cli(argv, capsys)
    assert_usage_error(code, err, argv[0], fragment)


def test_ctrl_c_before_the_command_starts_is_one_line_and_130(capsys, monkeypatch):
    import diffusion_int8.__main__ as entry

    def interrupted_import(argv=None):  # Ctrl-C while torch and diffusers are imported
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "main", interrupted_import)
    monkeypatch.setattr(entry.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as status:
        entry.run()
    assert status.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "diffusion-int8: interrupted before the command started; nothing was written"]


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_end_a_run_in_one_line_and_leave_no_temporary_outputs(sig, status, tmp_path):
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "diffusion_int8", "demo", "--class-labels", "red circle", "--batch-size", "1",
            "--out", str(out)]
    # SIGINT as a terminal delivers it: a test run started in the background of a non-interactive shell ignores
    # SIGINT, its children inherit that, and Python then leaves it ignored (the demo ran on to status 0)
    proc = subprocess.Popen(argv, cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not list(tmp_path.glob(".demo.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".demo.tmp-*")), "the demo's temporary output set never appeared"
    time.sleep(2.0)  # into the calibration's torch ops (where a Ctrl-C once ended the process in its shutdown, -2)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    assert proc.returncode == status, err
    assert "Traceback" not in err and lines[-1] == f"diffusion-int8 demo: interrupted; nothing was written to {out}", err
    assert sum("interrupted" in ln for ln in lines) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [EVAL, ["demo"], ["eval", "--score", "a", "b"]], ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("option", ["--lpips-weights", "--fid-weights"])
def test_weights_the_user_names_must_exist(command, option, tmp_path, capsys, no_model):
    missing = tmp_path / "nonexistent.pth"
    code, err = cli(command + [option, missing, "--out", tmp_path / "o"], capsys)
    assert_usage_error(code, err, command[0], f"{option} {missing} does not exist")
    code, err = cli(command + [option, tmp_path, "--out", tmp_path / "o"], capsys)
    assert_usage_error(code, err, command[0], f"{option} {tmp_path} is a directory")


def test_scorer_refuses_missing_weights_it_was_given(tmp_path):
    from diffusion_int8.eval.score import Scorer

    with pytest.raises(FileNotFoundError, match="nonexistent.pth"):
        Scorer(lpips_weights=tmp_path / "nonexistent.pth")
    with pytest.raises(FileNotFoundError, match="nonexistent.pth"):
        Scorer(fid_weights=tmp_path / "nonexistent.pth")


MATHTEXT = r"$\foo$ and $x^$"  # matplotlib parses text between pairs of $ as mathtext: both fail


def test_plots_show_user_strings_literally(calibrated, tmp_path):
    pytest.importorskip("matplotlib")
    from diffusion_int8.calibration import summary
    from diffusion_int8.eval import report

    uri = report.schedule_plot({"schedule": {"name": MATHTEXT, "per_step": ["int8", "fp16"],
                                             "errors": {MATHTEXT: [0.01, 0.02]}}})
    assert uri and uri.startswith("data:image/png;base64,")
    cal = Calibration.load(calibrated)
    cal.layers[MATHTEXT] = cal.layers.pop(next(iter(cal.layers)))
    assert [p.name for p in summary.plot(cal, tmp_path, budget=0.02)] == ["ranges.png", "errors.png"]
    assert (tmp_path / "ranges.png").stat().st_size > 0


def test_eval_report_plots_a_schedule_named_in_mathtext(calibrated, tmp_path):
    pytest.importorskip("matplotlib")
    schedule = json.loads((calibrated / "schedule.json").read_text())
    schedule["name"] = MATHTEXT
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(schedule))
    assert main([*EVAL, "--schedule", str(path), "--out", str(tmp_path / "r")]) == 0
    html = (tmp_path / "r" / "report.html").read_text()
    assert "data:image/png;base64," in html and "schedule:" in html


def test_cli_warnings_are_one_line_without_source(capsys, monkeypatch):
    """A warning raised during a command (here the emulation fallback's) prints as one line, above any progress
    bar, without the Python source line the default format adds."""
    import warnings as w

    from diffusion_int8.__main__ import _one_line

    monkeypatch.setattr(w, "showwarning", _one_line)
    w.warn("diffusion_int8: no GPU; using the PyTorch emulation of the INT8 kernel", RuntimeWarning)
    err = capsys.readouterr().err
    assert err == "diffusion-int8: warning: no GPU; using the PyTorch emulation of the INT8 kernel\n"


def test_a_label_the_shipped_model_does_not_know_is_refused_before_it_loads(monkeypatch, capsys):
    from diffusion_int8 import pipelines
    from diffusion_int8.__main__ import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipelines, "load", no_loading)
    for command in ("calibrate", "eval"):
        assert main([command, "--class-labels", "purple hexagon", "--out", "never"]) == 2
        err = capsys.readouterr().err
        assert "'purple hexagon' names no class; the classes are: red circle" in err and err.count("\n") == 1
