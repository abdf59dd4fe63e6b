"""The planner on an image classifier (ViT): its parameters are the model's own count with the data's classes (not a
token table and an untied LM head), its head runs on one row per image, and its patch projection is priced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planfix import FREE, calibration, network

from gptpar.config import ModelConfig
from gptpar.errors import GptparError
from gptpar.models.build import empty_model, model_config
from gptpar.plan.layout import head_flops, layout_of
from gptpar.plan.predict import predict
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.user_defaults import resolve_config

VIT = ("data.task=classify", "train.precision=fp32", "train.batch_size=8")


def vit_layout(*words: str):
    return layout_of(resolve_config(None, [*VIT, *words], user=False)[0])


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("preset", "classes"), [("vit-tiny", 10), ("vit-tiny", 37), ("vit-base", 10)])
def test_a_vits_parameters_are_the_built_models_with_the_datas_classes(preset: str, classes: int) -> None:
    """vit-tiny with 10 classes: 114,250 (the planner's count was 625,472: a token table and an untied head of
    data.vocab_size's 4,096 rows); vit-base 85,806,346 (was 91,498,752)."""
    lay = vit_layout(f"model.preset={preset}", "data.source=synthetic", f"data.synthetic_classes={classes}",
                     "parallel.dp=2", "parallel.dp_sync=zero2")
    built = count_params(empty_model(model_config(ModelConfig(preset=preset), classes)))  # on the meta device
    assert lay.vocab == classes
    assert lay.rank_parameters(0) == built
    assert (preset, classes) != ("vit-tiny", 10) or built == 114_250
    pred = predict(lay, calibration(lay), network(), "test cpu")
    assert pred.memory["state"] == int(DP_STRATEGIES["zero2"].state_bytes(built, 2))


def _saved_set(folder: Path, label_names: dict[str, int]) -> None:
    """The train split's info as datasets' save_to_disk writes it (an Image column and ClassLabel columns)."""
    (folder / "train").mkdir(parents=True)
    features = {"img": {"_type": "Image"}} | {
        name: {"names": [f"c{i}" for i in range(n)], "_type": "ClassLabel"} for name, n in label_names.items()}
    (folder / "train" / "dataset_info.json").write_text(json.dumps({"features": features}))


def test_a_saved_sets_classes_are_its_label_columns_and_a_named_set_has_its_own(tmp_path: Path) -> None:
    """CIFAR-100's fine labels (100), not its 20 coarse ones; food101 unsaved is its well-known 101; a hub set not
    yet saved is one line naming the fetch command."""
    words = ("model.preset=vit-tiny", f"data.dir={tmp_path}")
    _saved_set(tmp_path / "images" / "uoft-cs--cifar100", {"coarse_label": 20, "fine_label": 100})
    assert vit_layout(*words, "data.source=cifar100").vocab == 100
    _saved_set(tmp_path / "images" / "someone--pets", {"breed": 37})
    assert vit_layout(*words, "data.source=hf:someone/pets").vocab == 37
    assert vit_layout(*words, "data.source=food101").vocab == 101
    fetch = "run `gptpar data fetch hf:someone/birds data.task=classify`"
    with pytest.raises(GptparError, match=rf"^data.source=hf:someone/birds: its classes are read from the saved set, "
                                          rf"not in .* yet; {fetch}"):
        vit_layout(*words, "data.source=hf:someone/birds")


def test_a_vits_head_prices_one_row_per_image_and_its_patch_projection() -> None:
    """Blocks free, the head at 1 s per GFLOP: forward the classifier on 8 class tokens plus the patch projection
    (8 images x 16 patches x 3·8·8 -> 64), backward twice the classifier and the projection's weight gradient once.
    The logits held are 8 rows of 10 classes."""
    lay = vit_layout("model.preset=vit-tiny", "data.source=synthetic")
    calib = calibration(lay, activation=0.0)
    calib.compute.update({"block_f": FREE, "block_b": FREE, "block_w": FREE,
                          "head_f": [[1e9, 1.0]], "head_bw": [[1e9, 1.0]]})  # 1 GFLOP/s, flat
    pred = predict(lay, calib, network(), "test cpu")
    classifier, patches = 2.0 * 8 * 64 * 10, 2.0 * 8 * 16 * 3 * 8 * 8 * 64
    assert (lay.head_rows, lay.patch_flops) == (8, patches)
    assert head_flops(64, lay.vocab, lay.head_rows) == classifier
    assert pred.compute_s == pytest.approx((classifier + patches + 2 * classifier + patches) / 1e9)
    assert pred.memory["activations"] == 8 * 10 * 4
