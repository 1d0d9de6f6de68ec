"""estimate_run on vlm_chat: a forward that reads its inputs' values (Qwen2-VL's image grid and 3-D
positions) is measured on the meta model beside the real batch, and counts what a real forward of
the same batch saves; the image tokens come from the family's processor (Qwen's grid grows with
the image: 1 token for 28 × 28 pixels, 4 for 56 × 56)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.estimate import measure_saved_bytes, on_meta_beside_real_inputs, weights_not_loaded
from tests.templates.test_vlm_chat import picture, vlm
from tests.vlm_families import each, tiny_vlm_folder

ROWS = 2


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return tiny_vlm_folder(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")


def batch_of(folder, side: int) -> dict[str, torch.Tensor]:
    processor = vlm.load_processor(str(folder))
    messages = [vlm.user_turn(["What colour is the shape?"], 1), vlm.assistant_turn("red")]
    pieces = [vlm.encode(processor, messages, [picture(size=(side, side))], 128, f"row {i}") for i in range(ROWS)]
    return vlm.collate(pieces, processor)


def saved(folder, batch, meta: bool) -> int:
    """What one training forward of ``batch`` saves for backward, every part trainable."""
    config = vlm.ModelConfig(pretrained_path=str(folder), train_vision_tower=True)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"), weights_not_loaded():
            model = vlm.load_model(config)
    else:
        model = vlm.load_model(config)
    model.train()
    engine = SimpleNamespace(model=model, compute_loss=lambda rows: model(**{k: v for k, v in rows.items()
                                                                              if k != "labels"}).logits.sum())
    if not meta:
        return measure_saved_bytes(engine, batch)[0].total
    with on_meta_beside_real_inputs(batch) as rows:
        return measure_saved_bytes(engine, rows)[0].total


def test_qwen2_vl_is_estimated_with_the_image_tokens_its_grid_gives_as_a_real_forward_saves(qwen2_vl):
    processor = vlm.load_processor(str(qwen2_vl))
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    small, large = batch_of(qwen2_vl, 28), batch_of(qwen2_vl, 56)
    assert [int((b["input_ids"] == image_token).sum()) for b in (small, large)] == [ROWS * 1, ROWS * 4]
    estimated = {side: saved(qwen2_vl, b, meta=True) for side, b in ((28, small), (56, large))}
    real = {side: saved(qwen2_vl, b, meta=False) for side, b in ((28, small), (56, large))}
    print(f"\nqwen2_vl saved bytes, estimated vs real: {estimated} vs {real}")
    assert estimated[56] > estimated[28]
    for side in (28, 56):
        assert estimated[side] == pytest.approx(real[side], rel=0.05), side
    assert estimated[56] - estimated[28] == pytest.approx(real[56] - real[28], rel=0.1)


@pytest.mark.parametrize("family", each(("llava", "qwen2_vl", "qwen3_vl")))
def test_estimate_run_measures_each_familys_forward_on_the_templates_own_batches(family, tmp_path, monkeypatch):
    """The launch check's estimate of the template as it is: its examples' 3-D positions computed
    before the model exists (the estimate builds the data first), the positions grown to
    data.seq_len with the rows, the head mapping only the learnt tokens; bigger images give Qwen
    more image tokens, so more activations, and the LoRA change is offered with its estimate."""
    from engine.config import build_config
    from engine.data_files import WORKSPACE_VARIABLE
    from engine.estimate import estimate, measure_shape
    from engine.launch import load_recipe_class
    from tests.templates.test_vlm_chat import TEMPLATE

    monkeypatch.setenv(WORKSPACE_VARIABLE, str(tmp_path))
    model = tiny_vlm_folder(tmp_path / "model", family)
    recipe = load_recipe_class(TEMPLATE)

    def config(side: int):
        return build_config(recipe.config_class, None, [
            f"model.pretrained_path={model}", "data.builtin_images=10", f"data.builtin_image_size={side}",
            "data.batch_size=2", "data.seq_len=128", "data.eval_fraction=0"])

    saved = {side: measure_shape(recipe, config(side), 1).saved_bytes for side in (28, 56)}
    print(f"\n{family} saved bytes by image side: {saved}")
    if family == "llava":  # CLIP's crop: 16 image tokens whatever the size
        assert saved[56] == saved[28]
    else:
        assert saved[56] > saved[28]
    result = estimate(recipe, config(56), 1, "cpu", 1e-6)
    assert result["fits"] is False and result["memory_gib"]["activations"] > 0
    assert any("apply_skill lora" in row["change"].split(" + ") for row in result["changes"]), result["changes"]
