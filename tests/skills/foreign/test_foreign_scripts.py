"""Five foreign training scripts run 2 steps on CPU before and after each skill that applies to
them: a nanoGPT-style script, an HF ``no_trainer`` loop, Lightning's own ``LightningTransformer``
(from the ``lightning`` wheel), an ``accelerate`` loop, and TRL's own ``trl/scripts/sft.py`` (from
the ``trl`` wheel). The skill's result is written to a temporary copy; all runs share one
subprocess (``tests.skills.foreign.runner``) so torch is imported once.

The offline shims are listed in ``matrix.py``; ``python -m tests.skills.foreign.matrix`` prints
the whole table.
"""

from __future__ import annotations

import pytest

from skills.registry import list_skill_cards
from tests.skills.corpus.fetch import CorpusUnavailable
from tests.skills.foreign import matrix
from tests.skills.foreign.matrix import SCRIPTS, ran

pytestmark = pytest.mark.slow

# What each skill must be seen doing at run time when it applied (besides running 2 steps).
EFFECT = {
    "gradient-checkpointing": lambda r: r["checkpointed"] > 0 or r["checkpoint_calls"] > 0,
    "torch-compile": lambda r: r["graphs"] > 0,
    "mixed-precision": lambda r: r["autocast_forwards"] > 0 or r["bfloat16_outputs"] > 0,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("foreign")
    try:
        outcomes, jobs = matrix.prepare(tmp)
    except CorpusUnavailable as e:
        pytest.skip(f"the Lightning and TRL scripts come from the corpus, not cached and not downloadable: {e}")
    return outcomes, matrix.run(tmp, jobs)


def test_each_script_trains_two_steps_as_it_is(runs):
    _, results = runs
    assert {name: ran(results[f"{name}/baseline"]) for name in SCRIPTS} == {name: "" for name in SCRIPTS}


SKILLS = tuple(card.name for card in list_skill_cards())
# Applied, but the result does not run: the skill must be fixed (then this mark goes).
BROKEN: dict[tuple[str, str], str] = {}


def test_every_skill_is_tried_on_every_script(runs):
    outcomes, _ = runs
    assert set(outcomes) == {f"{script}/{skill}" for script in SCRIPTS for skill in SKILLS}


@pytest.mark.parametrize("script, skill", [
    pytest.param(script, skill, marks=pytest.mark.xfail(strict=True, reason=BROKEN[(script, skill)]))
    if (script, skill) in BROKEN else (script, skill)
    for script in SCRIPTS for skill in SKILLS
])
def test_an_applied_skill_still_trains_two_steps_with_its_effect(runs, script, skill):
    outcomes, results = runs
    status = outcomes[f"{script}/{skill}"]
    if status != "applied":
        pytest.skip(f"{skill} on {script}: {status}")
    result = results[f"{script}/{skill}"]
    assert ran(result) == ""
    if skill in EFFECT:
        seen = {k: result[k] for k in ("checkpointed", "checkpoint_calls", "graphs", "autocast_forwards", "bfloat16_outputs")}
        assert EFFECT[skill](result), f"ran, but without the effect of {skill}: {seen}"
