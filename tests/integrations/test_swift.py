"""SwiftCapture's refusals and wiring without ms-swift; what it records is judged by ms-swift's own
trainer code in tests/reference/test_swift_reference.py (test_swift_capture_records_what_swift_trains_on)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpolens.integrations.swift import SwiftCapture


class _Hook:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


def _trainer(**over):
    t = SimpleNamespace(accelerator=SimpleNamespace(process_index=0, num_processes=1), args={},
                        model=SimpleNamespace(training=True), state=SimpleNamespace(global_step=0),
                        _postprocess_batch=lambda samples, batches: None,
                        _get_per_token_logps_and_entropies=lambda *a, **k: (torch.zeros(1, 2), None),
                        _compute_loss_and_metrics=None)

    def loss(model, inputs, grpo_batch):  # as ms-swift's: the forward inside, then the loss
        t._get_per_token_logps_and_entropies(model, inputs, grpo_batch)
        return torch.tensor(0.0), {}

    t._compute_loss_and_metrics = loss
    t.__dict__.update(over)
    return t


@pytest.mark.parametrize("flag", ["use_liger_loss", "enable_server_multi_turn", "use_gym_env"])
def test_refuses_a_trainer_whose_loss_it_cannot_see(flag):
    with pytest.raises(ValueError, match=f"trainer.{flag} is set"):
        SwiftCapture(None, _trainer(**{flag: True}), config={}, hook=_Hook())


def test_a_loss_call_from_no_recorded_round_is_refused():
    t = _trainer()
    SwiftCapture(None, t, config={}, hook=_Hook())
    gb = SimpleNamespace(completion_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="no recorded round"):
        t._compute_loss_and_metrics(t.model, {}, gb)


def test_evaluation_is_not_recorded_and_the_trainer_still_gets_its_results():
    hook = _Hook()
    t = _trainer(model=SimpleNamespace(training=False))
    SwiftCapture(None, t, config={}, hook=hook)
    assert t._postprocess_batch([], []) is None
    loss, metrics = t._compute_loss_and_metrics(t.model, {}, SimpleNamespace())
    assert float(loss) == 0.0 and metrics == {} and hook.calls == []
