"""Whether one attention module's INT8 calls balance Q·Kᵀ (outlier channels), and why."""

from __future__ import annotations

import torch

from ..kernels import StaticRanges
from ..kernels.layout import BALANCE_MIN_QUERIES
from ..kernels.reference import needs_balance
from ..schedule import PrecisionSchedule


class BalanceChoice:
    """The Q·Kᵀ balance of one module (``name``) under a config's ``qk_balance``, ``calibration`` and ``schedule``.

    With a calibration that recorded per-channel maxima, its static ranges carry the balance where asked for, or
    by default where it saw outlier channels (``range_balance`` is the policy ``Calibration.ranges_at`` takes).
    Calls that measure their ranges measure the balance too where ``qk_balance`` says so, else where the
    schedule's calibration listed the module, else where the module's first call of enough queries has a channel
    that would move (``needs_balance``: one read from the GPU, once).
    """

    def __init__(self, qk_balance: bool | None, calibration, schedule, name: str | None):
        self.asked = qk_balance
        self.calibrated = calibration is not None
        self.channel_ranges = self.calibrated and calibration.has_channel_ranges()
        self.range_balance = qk_balance if self.channel_ranges else False
        self.static = bool(self.calibrated and (
            self.range_balance or (self.range_balance is None and calibration.layer_balanced(name))))
        self.measured, self.source = qk_balance, "asked"  # None: decided by the first call that can
        if qk_balance is None and isinstance(schedule, PrecisionSchedule) and schedule.balance_layers is not None:
            self.measured, self.source = name in schedule.balance_layers, "schedule"

    def for_call(self, query: torch.Tensor, key: torch.Tensor, ranges: StaticRanges | None) -> bool:
        """Whether this INT8 call (BHSD) measures the balance: never with static ``ranges`` (their balance, if any,
        comes with them; a static K mean alone keeps the kernel from measuring one)."""
        if ranges is not None and any(t is not None for t in (ranges.q_amax, ranges.k_amax, ranges.k_mean,
                                                               ranges.qk_balance)):
            return False
        if self.measured is not None:
            return self.measured
        if query.shape[2] * (query.shape[1] // key.shape[1]) < BALANCE_MIN_QUERIES:
            return False  # the kernel would not balance this call: decided by a later one
        if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            return True  # no read from the GPU here: measured, it moves only the channels that need it
        self.measured, self.source = needs_balance(query, key), "first call"
        return self.measured

    def status(self) -> str:
        """What the module does about the balance, in words (``Int8Handle.summary`` groups modules by it)."""
        if self.static:
            return "on (calibration)"
        if self.calibrated:  # its static ranges (K's mean at least) leave no measured balance
            if self.asked is False:
                return "off (asked)"
            if self.channel_ranges:
                return "off (calibration: no outlier channels)"
            return "off (calibration without per-channel maxima)"
        if self.measured is None:  # compiled or graph-captured calls before an eager one measure it in each call
            return "undecided (no INT8 call of 1,024+ queries per head so far; shorter calls are not balanced)"
        if self.source == "first call":
            return "on (outlier channels at the first call)" if self.measured else "off (no outlier channels at the first call)"
        return f"{'on' if self.measured else 'off'} ({self.source})"
