"""Scoring one checkpoint: MBPP+ solved, held-out NLL, retained KL, and GSM8K answers at a run's end.

What a checkpoint is scored on is built once per cache layer and reused by every checkpoint of every
run: the held-out set (tokenised like the training data) with its prefix cache, and the KL contexts
with their prefix cache and the base model's reference distributions (computed with the adapter off).
Each phase is timed (`Clock`), wall and CPU, into the unit's record.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import asdict

from atlas_core.residual import attach
from atlas_core.train import PrefixCache, ResidualAdapter, WeightLoRA, prepare_data
from atlas_core.train.config import TrainConfig
from atlas_core.train.objectives import mean_loss
from evaluation.kl import RetainedKL

from .workload import Workload


class Scorer:
    def __init__(self, workload: Workload, heldout_config: TrainConfig, batch_size: int):
        """`heldout_config`: the training config the held-out set is tokenised with (the reference
        method's); `batch_size`: contexts per KL / NLL batch."""
        self.w, self.heldout_config, self.batch_size = workload, heldout_config, batch_size
        self._caches = Memo()  # "heldout" and (kind, layer) -> data, prefix caches, KL references

    def _heldout(self, layer: int | None):
        """The held-out set and its prefix cache at `layer` (None: no cache)."""
        data = self._caches.of(
            "heldout", lambda: prepare_data(self.w.tokenizer, self.w.heldout_pairs, self.heldout_config)
        )
        if layer is None:
            return data, None
        build = lambda: PrefixCache.build(self.w.model, data.train, layer, data.pad_id, self.batch_size)
        return data, self._caches.of(("heldout", layer), build)

    def _kl(self, adapter) -> tuple[RetainedKL, list]:
        """The KL contexts with their prefix cache at the adapter's cache layer, and the base model's reference."""
        layer = adapter.cache_layer

        def build():
            w = self.w
            kl = RetainedKL(
                w.model,
                w.tokenizer,
                w.kl_contexts,
                layer,
                batch_size=self.batch_size,
                progress=False,
                prompts=w.kl_prompts,
            )
            with frozen(adapter):
                return kl, kl.reference()

        return self._caches.of(("kl", layer), build)

    def heldout_nll(self, adapter) -> float:
        """Mean token NLL of the held-out reference solutions under the adapted model."""
        data, cache = self._heldout(adapter.cache_layer)
        return mean_loss(self.w.model, adapter, data.train, cache, data.pad_id, self.batch_size)

    def retained_kl(self, adapter):
        """KL(base || adapted) on the retained contexts (evaluation.kl's result: mean, positions, per context)."""
        kl, reference = self._kl(adapter)
        gate = getattr(adapter, "update_gate", None)
        residual = adapter.residual if isinstance(adapter, ResidualAdapter) else None
        return kl.kl(reference, residual, on_batch=None if gate is None else gate.set)

    def score(self, adapter, final: bool) -> dict:
        """One checkpoint's record; `final`: a run's last checkpoint, which also answers GSM8K."""
        w, clock = self.w, Clock()
        with adapted(w.model, adapter):
            target = w.score_target(w.model, w.tokenizer)
        clock.lap("mbpp_plus")
        nll = self.heldout_nll(adapter)
        clock.lap("heldout_nll")
        moved = self.retained_kl(adapter)
        clock.lap("kl")
        record = {"mbpp_plus": asdict(target), "heldout_nll": nll, "kl": moved.to_record()}
        if final:
            with adapted(w.model, adapter):
                answers = w.answer_retained(w.model, w.tokenizer)
            record["gsm8k_answers"] = [{"id": a.id, "answer": a.answer, "correct": bool(a.correct)} for a in answers]
            clock.lap("gsm8k")
        record["seconds"], record["cpu_seconds"] = clock.wall, clock.cpu
        return record


class Memo(dict):
    """Values built on first use and kept: what every checkpoint of every run reuses."""

    def of(self, key, build):
        if key not in self:
            self[key] = build()
        return self[key]


class Clock:
    """Wall and CPU seconds per phase. CPU time (this process and the EvalPlus children it
    waited for) is what a phase costs when the shared machine is busy with other jobs."""

    def __init__(self):
        self.wall, self.cpu = {}, {}
        self._mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float]:
        t = os.times()
        return time.perf_counter(), t.user + t.system + t.children_user + t.children_system

    def lap(self, name: str) -> None:
        now = self._now()
        self.wall[name], self.cpu[name] = round(now[0] - self._mark[0], 2), round(now[1] - self._mark[1], 2)
        self._mark = now


def adapted(model, adapter):
    """The model as the adapter changes it: a residual is hooked in; LoRA already is."""
    return attach(model, adapter.residual) if isinstance(adapter, ResidualAdapter) else nullcontext()


def frozen(adapter):
    """The base model: LoRA switched off (a residual is never active outside `adapted`)."""
    return adapter.disabled() if isinstance(adapter, WeightLoRA) else nullcontext()
