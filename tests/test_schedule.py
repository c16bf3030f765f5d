"""Rule-based precision schedules: decisions, serialization, and use through enable()."""

from __future__ import annotations

import json

import pytest
import torch

import diffusion_int8
from diffusion_int8 import PRESETS, Mode, PrecisionSchedule, Rule
from diffusion_int8.schedule import noise_level
from tiny_models import build


def test_noise_level_normalizes_both_timestep_conventions():
    assert noise_level(999) == pytest.approx(0.999)
    assert noise_level(0.25) == 0.25  # flow-matching sigma
    assert noise_level(500, num_train_timesteps=2000) == 0.25


def test_first_matching_rule_wins_with_layer_patterns():
    s = PrecisionSchedule(
        rules=(Rule("fp16", min_noise=0.9), Rule("int8_fp16v", layers="*attn2*"), Rule("int8", min_noise=0.2)),
        default="fp16",
    )
    assert s.mode_for(950) is Mode.FP16
    assert s.mode_for(500, "down.0.attn2") is Mode.INT8_FP16V
    assert s.mode_for(500, "down.0.attn1") is Mode.INT8
    assert s.mode_for(100, "down.0.attn1") is Mode.FP16
    assert s(500) is Mode.INT8  # no layer: layer-specific rules do not match


def test_json_round_trip_and_no_silent_overwrite(tmp_path):
    s = PRESETS["balanced"]
    path = s.save(tmp_path / "s.json")
    assert PrecisionSchedule.load(path) == s
    assert json.loads(path.read_text())["schema_version"] == 5
    with pytest.raises(FileExistsError, match="overwrite=True"):
        s.save(path)
    s.save(path, overwrite=True)
    with pytest.raises(IsADirectoryError, match=r"is a directory; give the schedule's file name, e.g. .*schedule.json"):
        s.save(tmp_path, overwrite=True)
    path.write_text(json.dumps({"schema_version": 99, "kind": "rules"}))
    with pytest.raises(ValueError, match="schema"):
        PrecisionSchedule.load(path)
    with pytest.raises(FileNotFoundError, match="preset"):
        PrecisionSchedule.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="min_noise"):
        Rule("int8", min_noise=0.8, max_noise=0.2)


def test_enable_with_a_schedule_switches_per_step_and_layer(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")
    model, x = build("dit")
    layers = sorted(diffusion_int8.plugin.models.attention_modules(model))
    schedule = PrecisionSchedule(rules=(Rule("int8", min_noise=0.5, layers=layers[0]),), default="int8_fp16v")
    handle = diffusion_int8.enable(model, schedule=schedule, record=True)
    with torch.no_grad():
        for t in (900, 100):
            model(**{**x, "timestep": torch.tensor([t, t])})
    handle.disable()
    got = {(t, layer): mode for _, t, layer, mode in handle.state.trace}
    assert got[(900.0, layers[0])] == "int8" and got[(900.0, layers[1])] == "int8_fp16v"
    assert got[(100.0, layers[0])] == "int8_fp16v"
    handle = diffusion_int8.enable(model, schedule="balanced")  # preset by name
    handle.disable()


VALID = PRESETS["balanced"].to_dict()


def _with(**changes) -> str:
    return json.dumps({**VALID, **changes})


@pytest.mark.parametrize("content, where", [
    ("{not json", "not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2"),
    ("[1, 2]", "a schedule is a JSON object"),
    (_with(schema_version=6), "schema_version: 6 is not a diffusion-int8 schedule schema"),
    (_with(schema_version=True), "schema_version: True is not a diffusion-int8 schedule schema"),
    (_with(kind="table"), "kind: 'table'"),
    (json.dumps({k: v for k, v in VALID.items() if k != "default"}), "default: missing; give the mode"),
    (_with(default="int4"), "default: mode must be one of"),
    (_with(extra=1), "extra: unknown field"),
    (_with(rules={"mode": "int8"}), "rules: must be a list of rules"),
    (_with(rules=[{"min_noise": 0.5}]), "rules[0].mode: missing; give one of int8, int8_fp16v, fp16"),
    (_with(rules=[{"mode": "int8"}, {"mode": "int8", "max_nosie": 0.5}]), "rules[1].max_nosie: unknown field"),
    (_with(rules=["int8"]), "rules[0]: a rule is an object"),
    (_with(rules=[{"mode": "int4"}]), "rules[0]: mode must be one of"),
    (_with(rules=[{"mode": "int8", "min_noise": "0.5"}]), "rules[0]: min_noise must be a number in [0, 1], got '0.5'"),
    (_with(rules=[{"mode": "int8", "min_noise": 0.9, "max_noise": 0.1}]), "rules[0]: a rule needs 0 <= min_noise"),
    (_with(rules=[{"mode": "int8", "layers": 3}]), "rules[0]: layers must be a module-name pattern"),
    (_with(num_train_timesteps=0), "num_train_timesteps: num_train_timesteps must be null or a number > 0"),
    (_with(name=["x"]), "name: must be a string"),
    (_with(rules=[{"mode": "int8", "tau": 0}]), "rules[0]: tau must be a number in (0, 1]"),
    (_with(rules=[{"mode": "int8", "tau": "0.9"}]), "rules[0]: tau must be a number in (0, 1]"),
    (_with(default_tau=1.5), "default_tau: default_tau must be a number in (0, 1]"),
    (json.dumps({**{k: v for k, v in VALID.items() if k not in ("balance_layers", "calibrated_steps")},
                 "schema_version": 1}),
     "default_tau: unknown field in schema 1"),
    (_with(schema_version=2), "balance_layers: unknown field in schema 2"),
    (_with(balance_layers="attn1"), "balance_layers: must be a list of module names or null, got a string"),
    (_with(balance_layers=[1]), "balance_layers: must be a list of module names or null, got a list"),
    (json.dumps({**{k: v for k, v in VALID.items() if k != "calibrated_steps"}, "schema_version": 3}),
     "refresh_every: unknown field in schema 3"),
    (_with(refresh_every=1), "refresh_every: must be null or an integer >= 2, got 1"),
    (_with(refresh_every=True), "refresh_every: must be null or an integer >= 2, got True"),
    (_with(refresh_every=2), "refresh_every: refresh_every carries the blocks of one sparsity level"),
    (_with(schema_version=4), "calibrated_steps: unknown field in schema 4"),
    (_with(calibrated_steps=0), "calibrated_steps: must be null or an integer >= 1 (the calibration's step count), "
                                "got 0"),
    (_with(calibrated_steps=28.0), "calibrated_steps: must be null or an integer >= 1"),
    (json.dumps({**{k: v for k, v in VALID.items()
                    if k not in ("default_tau", "balance_layers", "refresh_every", "calibrated_steps")},
                 "schema_version": 1,
                 "rules": [{"mode": "int8", "tau": 0.9}]}), "rules[0].tau: unknown field; a rule's fields are mode, "
                                                          "min_noise, max_noise, layers"),
    (b"\xff\xfe{}", "not UTF-8 text"),
])
def test_invalid_schedule_files_fail_at_load_naming_file_and_field(tmp_path, content, where):
    path = tmp_path / "bad.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as err:
        PrecisionSchedule.load(path)
    assert str(err.value).startswith(f"{path}: ") and where in str(err.value), str(err.value)


def test_a_valid_file_with_every_field_loads(tmp_path):
    s = PrecisionSchedule(rules=(Rule("fp16", min_noise=0.9), Rule("int8", 0, 1, "*attn1*", tau=0.2)),
                          default="int8_fp16v", num_train_timesteps=1000, name="mine", balance_layers=("a.attn1",),
                          refresh_every=4, calibrated_steps=28)
    path = s.save(tmp_path / "s.json")
    assert set(s.to_dict()) == set(json.loads(path.read_text()))  # every field written
    back = PrecisionSchedule.load(path)
    assert back == s and (back.name, back.refresh_every, back.calibrated_steps) == ("mine", 4, 28)


def test_sparsity_levels_per_noise_interval_and_layer():
    s = PrecisionSchedule(rules=(Rule("fp16", min_noise=0.95), Rule("int8", min_noise=0.5, tau=0.9),
                                 Rule("int8", min_noise=0.2, layers="*attn1*", tau=0.95), Rule("int8_fp16v", 0.2, 1)),
                          default="int8_fp16v", default_tau=0.99)
    assert s.tau_for(990) is None and s.mode_for(990) is Mode.FP16
    assert s.tau_for(700, "blocks.0.attn1") == 0.9 and s.mode_for(700) is Mode.INT8
    assert s.tau_for(300, "blocks.0.attn1") == 0.95 and s.tau_for(300, "blocks.0.attn2") is None  # the rule's tau: dense
    assert s.tau_for(100) == 0.99 and s.mode_for(100) is Mode.INT8_FP16V  # no rule: the defaults
    assert s.sparse and not PRESETS["balanced"].sparse
    assert s._memo[(300, "blocks.0.attn1", None)] == (Mode.INT8, 0.95)  # looked up once per (timestep, layer)
    with pytest.raises(ValueError, match=r"tau must be a number in \(0, 1\]"):
        Rule("int8", tau=1.2)
    with pytest.raises(ValueError, match=r"default_tau must be a number in \(0, 1\]"):
        PrecisionSchedule(default_tau=0)


def test_sparse_schedule_round_trips_and_schema_1_files_still_load_dense(tmp_path):
    s = PrecisionSchedule(rules=(Rule("int8", min_noise=0.5, tau=0.9), Rule("fp16")), default="int8", default_tau=0.97,
                          name="sparse")
    path = s.save(tmp_path / "s.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == 5 and data["default_tau"] == 0.97 and data["rules"][0]["tau"] == 0.9
    assert PrecisionSchedule.load(path) == s and PrecisionSchedule.load(path).tau_for(700) == 0.9
    # a file written before sparsity levels existed: schema 1, rules without tau
    old = {"schema_version": 1, "kind": "rules", "name": "old", "default": "int8_fp16v", "num_train_timesteps": None,
           "rules": [{"mode": "int8", "min_noise": 0.5, "max_noise": 1.0, "layers": "*"}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = PrecisionSchedule.load(tmp_path / "old.json")
    assert loaded == PrecisionSchedule(rules=(Rule("int8", min_noise=0.5),), default="int8_fp16v")
    assert loaded.tau_for(700) is None and loaded.tau_for(100) is None and not loaded.sparse
