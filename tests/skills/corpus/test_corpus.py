"""Every skill on ≥ 40 third-party training scripts from pinned releases on PyPI (fetched once per
machine into a cache by ``tests/skills/corpus/fetch.py``): it never crashes nor writes invalid code,
reaches the scripts it is held to, and every refusal says what it looked for and lists the
candidates it saw. ``python -m tests.skills.corpus.report`` prints the table per skill."""

from __future__ import annotations

import pytest

from tests.skills.corpus import harness, report
from tests.skills.corpus.fetch import CorpusUnavailable, fetch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus():
    try:
        scripts = fetch()
    except CorpusUnavailable as e:
        pytest.skip(f"the corpus is not cached and cannot be downloaded: {e}")
    return scripts, harness.run(scripts)


def _plain(outcomes):
    return [o for o in outcomes if not o.target]


def test_the_corpus_is_forty_distinct_files_from_several_packages(corpus):
    scripts, _ = corpus
    assert len(scripts) >= 40
    members = [(s.package, f) for s in scripts for f in s.files]
    assert len(members) == len(set(members))
    assert len({s.package for s in scripts}) >= 10
    assert sum(s.explicit_loop for s in scripts) >= 25 and sum(s.trains_transformer for s in scripts) >= 25
    assert any(len(s.files) > 1 for s in scripts)  # a recipe whose model lives in another file


def test_no_skill_crashes_or_writes_invalid_code(corpus):
    scripts, outcomes = corpus
    assert len(_plain(outcomes)) == len(scripts) * len(harness.skill_names())
    bad = [f"{o.status}: {o.skill} on {o.script}: {o.message}" for o in outcomes
           if o.status in (harness.CRASH, harness.INVALID)]
    assert bad == []


def test_every_refusal_says_what_it_looked_for_and_lists_the_candidates(corpus):
    _, outcomes = corpus
    refused = [o for o in outcomes if o.status == harness.REFUSED]
    assert refused, "nothing refused: the check below would check nothing"
    bad = [f"{o.skill} on {o.script}: {harness.refusal_problem(o.message)}: {o.message}"
           for o in refused if harness.refusal_problem(o.message)]
    assert bad == []


def test_the_loop_skills_reach_four_in_five_scripts_they_are_held_to(corpus):
    scripts, outcomes = corpus
    outcomes = _plain(outcomes)
    rates = {skill: report.rate(skill, scripts, outcomes) for skill in report.LOOP_SKILLS + report.TRANSFORMER_SKILLS}
    short = {skill: f"{ok}/{n}" for skill, (ok, n) in rates.items() if ok < report.BAR * n}
    assert short == {}, "\n" + report.table(scripts, outcomes)


def test_naming_one_of_the_candidates_as_target_settles_the_choice(corpus):
    _, outcomes = corpus
    retries = [o for o in outcomes if o.target]
    if not retries:
        pytest.skip("no refusal listed several candidates for a skill that takes target")
    plain = {(o.skill, o.script): o for o in outcomes if not o.target}
    bad = [f"{o.skill} on {o.script} target={o.target!r}: {problem}" for o in retries
           if (problem := harness.pointing_problem(o, harness.candidates(plain[(o.skill, o.script)].message)))]
    assert bad == []
