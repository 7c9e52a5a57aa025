"""No behaviour change across restructuring (issue 40): the bundled model's greedy tokens, exit
depths and log-probabilities, and a seeded sampled request's tokens, equal those recorded at
commit 117ddce (before the configuration, PD and naming changes) in every KV layout,
scheduling mode and exit policy, and with speculation (`golden_outputs.py` records them).

Tokens, depths and top-k ids must be equal. Log-probabilities: within 1e-5, the fp32 rounding
of a log-softmax over the 4,096-token vocabulary if a change reorders a sum (about 1e-6
relative); a change of behaviour moves them by far more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_outputs import case_name, cases, record

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "golden_outputs.json").read_text())
LOGPROB_TOLERANCE = 1e-5


def test_the_fixture_covers_every_case():
    assert sorted(RECORDED) == sorted(case_name(options) for options in cases())


@pytest.mark.parametrize("options", cases(), ids=case_name)
def test_outputs_equal_the_recorded_ones(options):
    recorded = RECORDED[case_name(options)]
    outputs = record(options)
    assert len(outputs) == len(recorded)
    for now, then in zip(outputs, recorded, strict=True):
        assert now["token_ids"] == then["token_ids"]
        assert now["exit_depths"] == then["exit_depths"]
        assert (now["logprobs"] is None) == (then["logprobs"] is None)
        if then["logprobs"] is not None:
            assert now["logprobs"] == pytest.approx(then["logprobs"], abs=LOGPROB_TOLERANCE)
        if then["top_logprobs"] is not None:
            for a, b in zip(now["top_logprobs"], then["top_logprobs"], strict=True):
                assert [t for t, _ in a] == [t for t, _ in b]
                assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=LOGPROB_TOLERANCE)
