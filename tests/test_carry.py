"""Skipped blocks carried across denoising steps (``carry.BlockCarry``, ``enable(..., refresh_every=k)``): the
merge of two disjoint key sets is exact, a refresh step gives the dense result, the steps between forecast the
skipped blocks from the last two refreshes, the mask is predicted once per generation, and bad arguments are
refused before any work."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from diffusion_int8 import Int8DiffusionProcessor, PrecisionSchedule, Rule, enable
from diffusion_int8.plugin.carry import BlockCarry
from diffusion_int8.kernels import Mode
from diffusion_int8.kernels.config import SPARSE_BLOCK
from diffusion_int8.kernels.merge import merge_forecast, merge_reference
from diffusion_int8.plugin.models import attention_modules
from diffusion_int8.plugin.routing import int8_core
from diffusion_int8.eval.metrics import psnr
from diffusion_int8.inputs import local_qkv

BLK = SPARSE_BLOCK


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("DIFFUSION_INT8_BACKEND", "emulation")


def exact(q, k, v, keep=None):
    """float64 attention, and its log-sum-exp, over the keys of the blocks ``keep`` (B, H, nQB, nKB) marks."""
    s = q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    if keep is not None:
        tokens = keep.repeat_interleave(BLK, -2).repeat_interleave(BLK, -1)[..., :q.shape[2], :k.shape[2]]
        s = s.masked_fill(~tokens, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.nan_to_num(torch.softmax(s, -1)) @ v.double(), lse


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def test_merging_two_disjoint_key_sets_is_attention_over_both():
    q, k, v = local_qkv(1, 2, 300, 700, 64, dtype=torch.float32, seed=1)
    keep = torch.rand(1, 2, 3, 6, generator=torch.Generator().manual_seed(0)) < 0.5
    keep[..., 0, :] = True  # a row whose complement is empty
    o_a, l_a = exact(q, k, v, keep)
    o_b, l_b = exact(q, k, v, ~keep)
    o_b[..., :BLK, :] = float("nan")  # no keys there: whatever the kernel leaves must not leak
    full, _ = exact(q, k, v)
    merged = merge_reference(o_a.float(), l_a.float(), o_b.float(), l_b.float())
    assert merged.dtype == torch.float32 and torch.isfinite(merged).all()
    torch.testing.assert_close(merged.double(), full, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype, S", [(torch.float16, 77), (torch.bfloat16, 77), (torch.bfloat16, 9),
                                      (torch.float16, 64)])
def test_the_merge_kernel_matches_its_reference(kdev, monkeypatch, dtype, S):
    """The one-launch merge (Triton; the interpreter on CPU) against ``merge_reference``, with and without a
    forecast, on BHSD views of BSHD memory at an odd head dim and lengths with a partial last row tile, less than
    one tile and whole tiles, rows without keys in either set included."""
    monkeypatch.delenv("DIFFUSION_INT8_BACKEND")
    B, H, D = 2, 3, 40
    g = torch.Generator().manual_seed(0)

    def bhsd():  # a view of (B, S, H, D) memory, as the processor's calls give them
        return torch.randn(B, S, H, D, generator=g).to(dtype).to(kdev).transpose(1, 2)

    a, b, p = bhsd(), bhsd(), bhsd()
    la, lb, lp = (torch.randn(B, H, S, generator=g).to(kdev) * 3 for _ in range(3))
    lb[:, :, :5] = float("-inf")  # no keys in set b there
    b[:, :, :5] = float("nan")
    lp[:, :, 5:9] = float("-inf")
    la[:, :, 3:5] = float("-inf")  # and none in either set there
    a[:, :, 3:5] = float("nan")
    for before in (None, (p, lp)):
        args = (a, la, b, lb) + (before or (None, None)) + (0.7,)
        out = merge_forecast(*args)
        assert out.dtype == dtype and out.stride() == a.stride() and torch.isfinite(out).all()
        assert (out[:, :, 3:5] == 0).all()
        torch.testing.assert_close(out.float(), merge_reference(*args), atol=1e-2, rtol=1e-2)


def run_for(q, k, v):
    return lambda **kw: int8_core(Mode.INT8, q, k, v, None, None, None, **kw)


def test_refresh_steps_give_the_dense_result_and_the_steps_between_skip():
    q, k, v = local_qkv(1, 2, 1000, 1000, 64, seed=2)
    carry = BlockCarry(2)
    reference, _ = exact(q, k, v)
    dense_err = (int8_core(Mode.INT8, q, k, v, None, None, None).double() - reference).abs().max()
    total = 2 * 8 * 8
    for step, noise in enumerate((1.0, 0.9, 0.8, 0.7)):
        out, computed = carry(run_for(q, k, v), q, k, tau=0.5, scale=None, noise=noise)
        assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
        # a refresh is as close to exact attention as the dense INT8 call (the skipped blocks run first, so P
        # is rounded against another running max: not bit for bit); between refreshes the inputs are the same, so the forecast is what the refresh computed
        assert (out.double() - reference).abs().max() < 1.1 * dense_err
        if step % 2 == 0:
            assert computed == total
        else:
            assert 0 < int(computed) < total / 2
    # the mask was predicted once, at the first step
    assert len(carry._gen.sites) == 1


def test_the_forecast_follows_the_skipped_blocks_linearly_in_the_noise_level():
    q, k, v0 = local_qkv(1, 1, 512, 512, 64, seed=3)
    v1 = v0 + 0.5 * torch.randn_like(v0, dtype=torch.float32).half()
    carry = BlockCarry(2)
    vs = {1.0: v0, 0.8: (v0.float() + 0.5 * (v1.float() - v0.float())).half(), 0.6: v1}
    # V moves linearly in the noise level (refreshes at 1.0 and 0.6), so the skipped blocks' output does too
    carry(run_for(q, k, vs[1.0]), q, k, tau=0.3, scale=None, noise=1.0)
    carry(run_for(q, k, vs[0.8]), q, k, tau=0.3, scale=None, noise=0.8)
    carry(run_for(q, k, vs[0.6]), q, k, tau=0.3, scale=None, noise=0.6)
    v_next = (v1.float() + 0.5 * (v1.float() - v0.float())).half()  # noise 0.4, a step between refreshes
    forecast, computed = carry(run_for(q, k, v_next), q, k, tau=0.3, scale=None, noise=0.4)
    assert 0 < int(computed) < 16
    reference, _ = exact(q, k, v_next)
    site = carry._gen.sites[0]
    stale = merge_reference(*int8_core(Mode.INT8, q, k, v_next, None, None, None, block_mask=site.mask,
                                       return_lse=True), site.last[1], site.last[2])
    # the linear forecast lands on the new V's skipped output; the last refresh's alone does not (the whole
    # output's L2 error: 0.37-0.41 of the stale one over 12 draws of the new V; the largest single element's
    # ratio spread over 0.30-0.53, too wide to hold a bound)
    assert (forecast.double() - reference).norm() < 0.5 * (stale.double() - reference).norm()
    dense = int8_core(Mode.INT8, q, k, v_next, None, None, None)
    assert cos(forecast, reference) > cos(dense, reference) - 5e-4  # about as close as the dense INT8 call


def test_a_gain_of_zero_holds_the_last_refresh_and_one_half_steps_halfway(monkeypatch):
    q, k, v0 = local_qkv(1, 1, 512, 512, 64, seed=3)
    v1 = v0 + 0.5 * torch.randn_like(v0, dtype=torch.float32).half()

    def forecast_at(gain):
        monkeypatch.setattr(BlockCarry, "gain", gain)
        carry = BlockCarry(2)
        for noise, v in ((1.0, v0), (0.8, v0), (0.6, v1)):  # refreshes at 1.0 and 0.6
            carry(run_for(q, k, v), q, k, tau=0.3, scale=None, noise=noise)
        return carry(run_for(q, k, v1), q, k, tau=0.3, scale=None, noise=0.4)[0], carry._gen.sites[0]

    held, site = forecast_at(0.0)
    kept = int8_core(Mode.INT8, q, k, v1, None, None, None, block_mask=site.mask, return_lse=True)
    assert torch.equal(held, merge_forecast(*kept, site.last[1], site.last[2]))
    # noise 0.6 -> 0.4 after 1.0 -> 0.6: the full step is 0.5 of the refreshes' change, half a gain 0.25
    half, _ = forecast_at(0.5)
    assert torch.equal(half, merge_forecast(*kept, site.last[1], site.last[2], site.before[1], site.before[2], 0.25))
    assert not torch.equal(half, held)


def test_a_new_generation_predicts_its_mask_again_and_refreshes():
    q, k, v = local_qkv(1, 2, 600, 600, 64, seed=4)
    carry = BlockCarry(3)
    for noise in (1.0, 0.9, 0.8):
        carry(run_for(q, k, v), q, k, tau=0.5, scale=None, noise=noise)
    first_mask = carry._gen.sites[0].mask
    q2, k2, v2 = local_qkv(1, 2, 600, 600, 64, seed=5)
    _, computed = carry(run_for(q2, k2, v2), q2, k2, tau=0.5, scale=None, noise=1.0)  # noise rose: a new one
    assert computed == 2 * 5 * 5 and carry._gen.step == 0
    assert carry._gen.sites[0].mask is not first_mask and carry._gen.sites[0].before is None


@pytest.mark.parametrize("every, steps, want", [
    (7, 50, [0, 7, 14, 21, 28, 35, 42, 48]),  # the last step's refresh runs at the step before
    (3, 28, [0, 3, 6, 9, 12, 15, 18, 21, 24, 26]),
    (4, 25, [0, 4, 8, 12, 16, 20, 23]),
    (4, 50, list(range(0, 50, 4))),  # a refresh at the step before the last already: as it was
    (5, 50, list(range(0, 50, 5))),  # none on the last step: nothing moves
    (7, None, list(range(0, 50, 7))),  # the step count unknown: every 7th
    (2, 2, [0]),
])
def test_a_refresh_that_would_fall_on_the_last_step_runs_at_the_step_before(every, steps, want):
    carry = BlockCarry(every)
    assert [s for s in range(steps or 50) if carry.refreshes(s, steps)] == want


def test_past_the_step_count_it_was_told_the_carry_refreshes_every_kth_step_again():
    carry = BlockCarry(7)  # a loop longer than its scheduler said
    assert [s for s in range(45, 64) if carry.refreshes(s, 50)] == [48, 56, 63]


def test_the_step_count_is_read_from_the_scheduler():
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler, HeunDiscreteScheduler

    from diffusion_int8.plugin.install import StepCount

    flow = FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow.set_timesteps(28)
    pipe = SimpleNamespace(scheduler=flow)
    count = StepCount(pipe)
    levels = flow.timesteps / 1000
    assert count(float(levels[0])) == 28
    assert count(float(levels[10])) == 18  # an img2img run starting partway
    assert count(float(flow.timesteps[0].to(torch.bfloat16)) / 1000) == 28  # a bf16 timestep
    widest = int((levels[:-1] - levels[1:]).argmax())
    assert levels[widest] - levels[widest + 1] > 0.02
    assert count(float(levels[widest] + levels[widest + 1]) / 2) is None  # between two levels: not its loop
    flow.set_timesteps(50)  # the timesteps of the generation that starts, not of the last one
    assert count(1.0) == 50
    heun = HeunDiscreteScheduler()
    heun.set_timesteps(10)  # each level after the first twice: one carried step each
    pipe.scheduler = heun  # swapped after the count was made: the pipeline's scheduler now is read
    assert len(heun.timesteps) == 19 and count(float(heun.timesteps[0]) / 1000) == 10
    pipe.scheduler = None
    assert count(1.0) is None and StepCount(SimpleNamespace())(1.0) is None


def test_a_pipeline_tells_the_carry_its_step_count():
    """Five steps refreshed every 2: through the pipeline (its scheduler gives the count) the refresh of the last
    step runs at the fourth; through the model alone (no count) at steps 1, 3 and 5."""
    from test_embedded_long import tiny_long_pipeline

    pipe = tiny_long_pipeline()
    per_step = {}
    for name, target in (("pipeline", pipe), ("model", pipe.transformer)):
        handle = enable(target, "int8", sparsity=0.3, refresh_every=2, speed_gate=False, record=True)
        try:
            pipe(["red circle"], num_inference_steps=5, generator=torch.Generator().manual_seed(0), output_type="pt")
            per_step[name] = handle.state.skipped_blocks()["per_step"]
            steps = handle.state.steps
        finally:
            handle.disable()
        assert steps == (5 if name == "pipeline" else None)
    assert [p == 0 for p in per_step["pipeline"]] == [True, False, True, True, False], per_step
    assert [p == 0 for p in per_step["model"]] == [True, False, True, False, True], per_step
    # an observer (the calibration's collector, which carries as the processors do) is told the count too
    seen = []
    handle = enable(pipe, "fp16", observer=lambda call: seen.append((call.step, call.steps)))
    try:
        pipe(["red circle"], num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt")
    finally:
        handle.disable()
    assert {s for _, s in seen} == {3} and {step for step, _ in seen} == {0, 1, 2}


def test_each_denoising_model_counts_the_steps_of_its_own_scheduler():
    """Kandinsky's combined pipelines run their prior (``prior_prior``) on ``prior_scheduler`` and then the UNet on
    ``scheduler``, at other step counts: each model's generation is told its own."""
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler
    from tiny_models import build

    from diffusion_int8.plugin.models import scheduler_of

    unet, x = build("wan")
    prior, _ = build("wan")
    decoder_scheduler, prior_scheduler = FlowMatchEulerDiscreteScheduler(), FlowMatchEulerDiscreteScheduler()
    decoder_scheduler.set_timesteps(5)
    prior_scheduler.set_timesteps(3)
    pipe = SimpleNamespace(unet=unet, scheduler=decoder_scheduler, prior_prior=prior, prior_scheduler=prior_scheduler)
    assert (scheduler_of(pipe, unet), scheduler_of(pipe, prior)) == ("scheduler", "prior_scheduler")
    unclip = SimpleNamespace(decoder=unet, super_res_first=prior, decoder_scheduler=None, super_res_scheduler=None)
    assert (scheduler_of(unclip, unet), scheduler_of(unclip, prior)) == ("decoder_scheduler", "super_res_scheduler")
    handle = enable(pipe, "int8", sparsity=0.5, refresh_every=2, speed_gate=False)
    seen = []
    try:
        with torch.no_grad():
            for model, scheduler in ((prior, prior_scheduler), (unet, decoder_scheduler)):
                for t in scheduler.timesteps:
                    model(**dict(x, timestep=t.reshape(1)), return_dict=False)
                    seen.append(handle.state.steps)
    finally:
        handle.disable()
    assert seen == [3] * 3 + [5] * 5


def test_a_carried_schedule_warns_once_at_another_step_count_than_calibrated():
    from test_embedded_long import tiny_long_pipeline

    pipe = tiny_long_pipeline()
    schedule = PrecisionSchedule(default="int8", default_tau=0.3, refresh_every=2, calibrated_steps=5, name="cal")

    def run(steps):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pipe(["red circle"], num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt")
        return [(str(w.message), w.filename) for w in seen if "calibrated at" in str(w.message)]

    handle = enable(pipe, schedule=schedule, speed_gate=False)
    try:
        assert run(5) == []
        ((message, where),) = run(3)
        assert ("set to 3 steps" in message and "a refresh every 2 steps" in message and "calibrated at 5 steps" in
                message and "calibrate --steps 3, with the same --sparsity-levels and --refresh-every" in message), message
        assert where == __file__  # the user's call, not the hook's
        assert run(3) == [] and run(4) == []  # once
    finally:
        handle.disable()
    for options in (dict(schedule=dataclasses.replace(schedule, calibrated_steps=None)),  # not known
                    dict(schedule=schedule, refresh_every=3)):  # an interval of the user's, not the calibrated one
        handle = enable(pipe, speed_gate=False, **options)
        try:
            assert run(3) == []
        finally:
            handle.disable()


def test_the_calibrated_step_count_is_the_schedules_not_the_runs():
    """An img2img run starts partway into the steps the scheduler is set to: those are compared, not the run's."""
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusion_int8.plugin.install import StepCount
    from diffusion_int8.schedule import denoising_steps

    flow = FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow.set_timesteps(50)
    schedule = PrecisionSchedule(default="int8", default_tau=0.3, refresh_every=4, calibrated_steps=50)
    count = StepCount(SimpleNamespace(scheduler=flow), schedule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert count(float(flow.timesteps[20]) / 1000) == 30
    flow.set_timesteps(28)
    with pytest.warns(RuntimeWarning, match="set to 28 steps"):
        assert count(float(flow.timesteps[0]) / 1000) == 28
    # the calibration's timesteps hold one entry per denoiser call: CFG as two calls, a second-order scheduler's
    # repeated levels, count once
    assert denoising_steps(torch.tensor([999.0, 999.0, 500.0, 500.0, 1.0, 1.0])) == 3
    assert denoising_steps(torch.tensor([999.0, 700.0, 700.0, 300.0, 300.0])) == 3
    assert denoising_steps(torch.tensor([])) is None


@pytest.mark.parametrize("every", [1, 0, -2, 2.5, True, "2"])
def test_bad_refresh_intervals_are_refused_saying_what_is_accepted(every):
    with pytest.raises(ValueError, match="refresh_every must be an integer >= 2"):
        BlockCarry(every)


def test_refresh_every_needs_a_sparsity_level():
    from tiny_models import build

    model, _ = build("dit")
    before = {n: type(m.processor) for n, m in attention_modules(model).items()}
    with pytest.raises(ValueError, match="give sparsity=tau"):
        enable(model, "int8", refresh_every=2)
    with pytest.raises(ValueError, match="refresh_every must be an integer >= 2"):
        enable(model, "int8", sparsity=0.5, refresh_every=1)
    with pytest.raises(ValueError, match="give sparsity=tau"):
        Int8DiffusionProcessor("int8", sparsity=1.0, refresh_every=2)
    levels = PrecisionSchedule((Rule("int8", 0.0, 0.5, "*", 0.5), Rule("int8", tau=0.8)), name="levels")
    with pytest.raises(ValueError, match="schedule 'levels' sets several"):
        enable(model, schedule=levels, refresh_every=2)
    # refused before installing anything
    assert "_diffusion_int8_handle" not in model.__dict__
    assert {n: type(m.processor) for n, m in attention_modules(model).items()} == before


def test_a_pipeline_carries_its_skipped_blocks_and_counts_them():
    from test_embedded_long import tiny_long_pipeline

    pipe = tiny_long_pipeline()

    def generate():
        return pipe(["red circle"], num_inference_steps=4, generator=torch.Generator().manual_seed(0),
                    output_type="pt").images

    handle = enable(pipe, "int8", speed_gate=False)
    dense = generate()
    handle.disable()
    handle = enable(pipe, "int8", sparsity=0.3, speed_gate=False)
    dropped = generate()
    handle.disable()
    handle = enable(pipe, "int8", sparsity=0.3, refresh_every=2, speed_gate=False, record=True)
    try:
        carried = generate()
        skipped = handle.state.skipped_blocks()
        again = generate()  # a second generation starts its own refreshes and mask
    finally:
        handle.disable()
    assert torch.isfinite(carried).all() and torch.equal(carried, again)
    per_step = skipped["per_step"]
    assert per_step[0] == 0 and per_step[2] == 0  # refresh steps compute every block
    assert per_step[1] > 0.2 and per_step[3] > 0.2
    # closer to the dense images than dropping the same level's blocks, and not the dense images themselves
    assert not torch.equal(carried, dense)
    assert psnr(carried, dense).item() > psnr(dropped, dense).item()


def test_a_run_that_starts_where_the_last_one_stopped_is_a_new_generation():
    """After a one-step warm-up, or a run interrupted at its first step, the next run starts at the same timestep:
    its scheduler's timesteps set anew tell it apart, so it gives what a first run gives, with its own steps."""
    from test_embedded_long import tiny_long_pipeline

    pipe = tiny_long_pipeline()

    def generate(steps, stop=None):
        def interrupt(p, i, t, kw):
            p._interrupt = i == stop
            return kw
        return pipe(["red circle"], num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                    output_type="pt", callback_on_step_end=interrupt).images

    runs = {}
    for before in (None, 1, "interrupted"):
        handle = enable(pipe, "int8", sparsity=0.3, refresh_every=3, speed_gate=False, record=True)
        try:
            if before == 1:
                generate(1)
            elif before is not None:
                generate(5, stop=0)
            handle.state.trace.clear()
            runs[before] = generate(5)
            assert handle.state.steps == 5, before
            assert sorted({step for step, *_ in handle.state.trace}) == [0, 1, 2, 3, 4], before
        finally:
            handle.disable()
    assert torch.equal(runs[None], runs[1]) and torch.equal(runs[None], runs["interrupted"])


@torch._dynamo.config.patch(recompile_limit=64)
def test_a_compiled_carried_denoiser_does_not_recompile_as_the_timestep_moves(monkeypatch):
    # the carry reads the timestep (its noise level) outside the graph: traced, every step's timestep would be a
    # constant some frame is guarded on, and a generation at new timesteps would compile new frames (the limit is
    # raised so that they show as frames, not as a fallback to eager)
    import diffusers as d
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
                                    num_layers=2, sample_size=48, patch_size=2, num_embeds_ada_norm=10).eval()
    x = dict(hidden_states=torch.randn(2, 4, 48, 48, generator=torch.Generator().manual_seed(1)),
             class_labels=torch.tensor([1, 3]))  # 576 tokens: five key blocks
    calls = []
    carry = BlockCarry.__call__
    monkeypatch.setattr(BlockCarry, "__call__", lambda self, *a, **kw: calls.append(1) or carry(self, *a, **kw))
    handle = enable(model, "int8", sparsity=0.5, refresh_every=2, speed_gate=False)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    frames = []
    try:
        with torch.no_grad():
            for timesteps in (torch.linspace(999, 1, 6), torch.linspace(999, 1, 6), torch.linspace(990, 3, 8)):
                for t in timesteps:
                    compiled(**{**x, "timestep": t.expand(2)}, return_dict=False)
                frames.append(counter.frame_count)
    finally:
        handle.disable()
        torch._dynamo.reset()
    assert len(calls) == 2 * 20  # every call of both modules carried
    assert frames[0] == frames[1] == frames[2], frames


def test_without_the_timestep_the_blocks_are_dropped_with_one_warning():
    q, k, v = local_qkv(1, 2, 600, 600, 64, seed=6)
    proc = Int8DiffusionProcessor("int8", sparsity=0.5, refresh_every=2, speed_gate=False)
    with pytest.warns(RuntimeWarning, match="refresh_every needs the denoiser's timestep"):
        out = proc._attention(q, k, v)
    plain = int8_core(Mode.INT8, q, k, v, None, None, None, sparsity=0.5)
    torch.testing.assert_close(out, plain)


def test_eval_reports_a_carried_variant_with_its_refresh_steps(tmp_path):
    from diffusion_int8 import evaluate
    from diffusion_int8.embedded import load_pipeline

    pipe = load_pipeline(device="cpu")  # 256 tokens: two blocks of queries and of keys
    report = evaluate(pipe, class_labels=["red circle", "blue ring"], steps=4, modes=["int8"], sparsity=0.5,
                      refresh_every=2, progress=False, generate_only=True)
    carried = report["variants"]["int8+sparsity0.5+refresh2"]["sparsity"]
    assert carried["per_step"][0] == 0 and carried["per_step"][2] == 0
    assert carried["per_step"][1] > 0 and carried["per_step"][3] > 0
    assert report["variants"]["int8"]["sparsity"]["overall"] == 0


@pytest.mark.parametrize("argv, fragments", [
    (["--refresh-every", "2"], ["--refresh-every carries the blocks --sparsity skips", "--sparsity TAU"]),
    (["--sparsity", "1"], ["--sparsity", "must be a sparsity level in (0, 1)"]),
    (["--sparsity", "0.5", "--refresh-every", "1"], ["--refresh-every", "must be an integer >= 2"]),
])
def test_eval_refuses_bad_sparse_arguments_before_loading(tmp_path, capsys, argv, fragments):
    from test_cli_errors import assert_usage_error, cli

    code, err = cli(["eval", "--class-labels", "red circle", "--out", tmp_path / "r", *argv], capsys)
    assert_usage_error(code, err, "eval", *fragments)
    assert not (tmp_path / "r").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [Mode.INT8, Mode.INT8_FP16V])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_kernels_carry_as_the_emulation_does(monkeypatch, mode, D):
    """On the GPU's kernels: a refresh (one call over every block, the skipped ones first) and the steps between are as
    close to exact attention as the dense call, rows whose every block is kept (an empty complement) included, at an
    odd length."""
    monkeypatch.delenv("DIFFUSION_INT8_BACKEND")
    q, k, v = local_qkv(1, 4, 3001, 3001, D, device="cuda", seed=7)
    carry = BlockCarry(2)

    def run(**kw):
        return int8_core(mode, q, k, v, None, None, None, **kw)

    reference, _ = exact(q.cpu(), k.cpu(), v.cpu())
    dense_err = (run().double().cpu() - reference).abs().max()
    n = -(-3001 // BLK)
    keep = torch.zeros(1, 1, n, n, dtype=torch.bool, device="cuda")
    keep[..., 0, :] = True  # the first query block keeps every key block: nothing in its complement
    for noise in (1.0, 0.9, 0.8, 0.7):  # refreshes at the first and the third, forecasts of the same inputs between
        out, computed = carry(run, q, k, tau=0.3, scale=None, noise=noise, keep_kv_blocks=keep)
        assert torch.isfinite(out).all()
        assert (out.double().cpu() - reference).abs().max() < 1.1 * dense_err
    assert 0 < int(computed) < n * n * 4
    mask = carry._gen.sites[0].mask
    assert mask.all(-1).any() and (~mask).any()  # some rows keep every block, and blocks are skipped


def test_a_timestep_that_does_not_move_keeps_the_call_sites_bounded():
    from diffusion_int8.plugin.carry import MAX_CALLS_PER_STEP

    q, k, v = local_qkv(1, 1, 300, 300, 64, seed=8)
    carry = BlockCarry(2)
    for _ in range(3 * MAX_CALLS_PER_STEP):
        _, computed = carry(run_for(q, k, v), q, k, tau=0.5, scale=None, noise=0.5)
        assert computed == 3 * 3  # every call a refresh: the step never advances
    assert len(carry._gen.sites) <= MAX_CALLS_PER_STEP
