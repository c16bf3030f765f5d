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
    assert json.loads(path.read_text())["schema_version"] == 1
    with pytest.raises(FileExistsError, match="overwrite=True"):
        s.save(path)
    s.save(path, overwrite=True)
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
    layers = sorted(diffusion_int8.processor.attention_modules(model))
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
