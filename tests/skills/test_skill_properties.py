"""Property: every codemod, fed generated variants of the recipes (statements dropped, duplicated
or swapped, names renamed, other skills applied first), either writes code that parses (and a
second application changes nothing) or refuses with a SkillError. Never another exception."""

from __future__ import annotations

import tempfile
from pathlib import Path

import libcst as cst
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skills import SkillError, apply_skill, list_skills
from tests.skills.skill_helpers import FIXTURES, TEMPLATE

SOURCES = {
    "template": (TEMPLATE / "recipe.py").read_text(),
    "nanogpt_style": (FIXTURES / "nanogpt_style.py").read_text(),
    "hf_trainer_style": (FIXTURES / "hf_trainer_style.py").read_text(),
}
SKILLS = [s.name for s in list_skills()]
OPERATIONS = ("drop", "duplicate", "swap", "rename", "apply")


class _Statements(cst.CSTTransformer):
    """Rewrites the body of the block that holds statement number ``target`` (in source order)."""

    def __init__(self, target: int, operation: str):
        self.target = target
        self.operation = operation
        self.seen = 0

    def _rewrite(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        start, self.seen = self.seen, self.seen + len(body)
        index = self.target - start
        if not 0 <= index < len(body):
            return body
        body = list(body)
        if self.operation == "drop":
            del body[index]
        elif self.operation == "duplicate":
            body.insert(index, body[index])
        elif self.operation == "swap" and index + 1 < len(body):
            body[index], body[index + 1] = body[index + 1], body[index]
        return body or [cst.SimpleStatementLine([cst.Pass()])]

    def leave_IndentedBlock(self, original_node, updated_node):
        return updated_node.with_changes(body=self._rewrite(list(updated_node.body)))

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self._rewrite(list(updated_node.body)))


class _Rename(cst.CSTTransformer):
    def __init__(self, old: str):
        self.old = old

    def leave_Name(self, original_node, updated_node):
        return updated_node.with_changes(value=f"renamed_{self.old}") if updated_node.value == self.old else updated_node


class _Names(cst.CSTVisitor):
    def __init__(self):
        self.names: list[str] = []

    def visit_Name(self, node: cst.Name) -> None:
        if node.value not in self.names:
            self.names.append(node.value)


def mutate(source: str, operation: str, number: int, workdir: Path) -> str:
    if operation == "apply":
        path = workdir / "mutating.py"
        path.write_text(source)
        try:
            apply_skill(SKILLS[number % len(SKILLS)], path)
        except SkillError:
            pass
        return path.read_text()
    module = cst.parse_module(source)
    if operation == "rename":
        finder = _Names()
        module.visit(finder)
        return module.visit(_Rename(finder.names[number % len(finder.names)])).code
    counter = _Statements(10**9, "none")
    module.visit(counter)
    return module.visit(_Statements(number % max(1, counter.seen), operation)).code


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(sorted(SOURCES)),
    mutations=st.lists(st.tuples(st.sampled_from(OPERATIONS), st.integers(0, 100_000)), max_size=4),
)
def test_every_codemod_writes_parsable_code_or_refuses_cleanly(base: str, mutations):
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        source = SOURCES[base]
        for operation, number in mutations:
            source = mutate(source, operation, number, workdir)
        for skill in SKILLS:
            path = workdir / "recipe_variant.py"
            path.write_text(source)
            try:
                result = apply_skill(skill, path)
            except SkillError:
                assert path.read_text() == source  # a refusal leaves the file as it was
                continue
            text = path.read_text()
            cst.parse_module(text)
            if result.changed:
                compile(text, "recipe_variant.py", "exec")
                again = apply_skill(skill, path)
                assert (again.changed, again.already_applied) == (False, True), (skill, again.message)
                assert path.read_text() == text
            else:
                assert result.already_applied and text == source
