"""The corpus harness's judgements on refusal texts and target retries, on hand-written cases
(no network, no skill run)."""

from tests.skills.corpus import harness
from tests.skills.corpus.harness import Outcome


def test_a_refusal_must_say_what_it_looked_for_or_where_it_looked():
    assert harness.refusal_problem("lora: looked for the optimizer in recipe.py; found none") == ""
    assert harness.refusal_problem("gc: Projection (simclr_module.py:126) has no repeated blocks") == ""
    assert harness.refusal_problem("gc: cannot apply here") == (
        "says neither what it looked for nor where (file:line) it saw something")


def test_a_refusal_that_saw_several_candidates_lists_each_with_its_place():
    listed = "gc: found several model constructions (`gen` at gan.py:10, `disc` at gan.py:12) and cannot tell"
    assert harness.refusal_problem(listed) == ""
    assert harness.candidates(listed) == ["gen", "disc"]
    bare = "muon: found several AdamW/Adam optimizers (ppo.py:310, ppo.py:311) and cannot tell which one trains"
    assert harness.refusal_problem(bare) == "mentions candidates without listing them as file:line + expression"
    many = "x: found several model constructions (" + ", ".join(f"`m{i}` at a.py:{i}" for i in range(6)) + ")"
    assert harness.refusal_problem(many) == "lists 6 candidates (at most 5)"


def test_a_name_listed_at_two_places_is_pointed_at_by_its_line():
    message = "found several model constructions (`gen` at lm.py:340, `disc` at lm.py:341, `gen` at lm.py:445)"
    assert harness.pointers(message) == ["lm.py:340", "disc", "lm.py:445"]


def _retry(status, message="", diff="", target="gen"):
    return Outcome("gradient-checkpointing", "gan", status, message, 0.0, diff, target=target)


def test_a_target_retry_settles_on_the_named_model_only():
    others = ["gen", "disc"]
    helper = "+def checkpoint_blocks(\n+    model: torch.nn.Module,\n+) -> int:\n+    return apply(model)\n"
    assert harness.pointing_problem(_retry("applied", diff=helper + "+checkpoint_blocks(gen)\n"), others) == ""
    assert harness.pointing_problem(_retry("applied", diff="+checkpoint_blocks(gen)\n+checkpoint_blocks(disc)\n"), others) == (
        "the change also acts on ['disc']")
    assert harness.pointing_problem(_retry("applied", diff="+opt = AdamW([p for p in disc.parameters()])\n+x(gen)\n"), others) == ""
    assert harness.pointing_problem(_retry("applied", diff="+checkpoint_blocks(model)\n"), others) == (
        "the change does not name `gen`")
    assert harness.pointing_problem(_retry("refused", "found several model constructions again"), others).startswith(
        "still asks which one")
    assert harness.pointing_problem(_retry("refused", "target 'gen' is not a model expression"), others).startswith(
        "does not take the target")
    assert harness.pointing_problem(_retry("refused", "looked for a tp mesh in gan.py; found none"), others) == ""
