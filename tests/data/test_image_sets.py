"""Named image sets (gptpar.data.image_store, gptpar.data.image_sets) with no network: small real sets built here with
`datasets` and saved in the data folder's layout (DatasetDict.save_to_disk under images/<NAME>), as `gptpar data fetch`
leaves them; the download path itself runs from a local image folder, which load_dataset reads offline."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch
from PIL import Image

from gptpar import cli
from gptpar.config import DataConfig, load_config
from gptpar.data.image_sets import augmented, crop_box, load_named_images
from gptpar.data.image_store import download, saved_folder
from gptpar.errors import GptparError
from gptpar.hub import hub_reachable
from gptpar.launch.prepare import prepare_run

FINE, COARSE = ["apple", "bee", "cloud"], ["fruit", "animal"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as a compute node sees it, at once (no probe to wait for)
    for module in (datasets.config, huggingface_hub.constants):  # they read it when imported, before this test
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    hub_reachable.cache_clear()  # not an answer cached by an earlier test on a machine that reaches the hub
    yield
    hub_reachable.cache_clear()


def pixels(seed: int, size: int = 8, mode: str = "RGB") -> Image.Image:
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8), mode=mode)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def cifar_like(tmp_path: Path, test_images: list | None = None) -> DataConfig:
    """A three-image CIFAR-100 in the data folder: img, fine_label and coarse_label; train and test splits."""
    cfg = DataConfig(source="cifar100", dir=str(tmp_path / "data"))
    features = datasets.Features({"img": datasets.Image(), "fine_label": datasets.ClassLabel(names=FINE),
                                  "coarse_label": datasets.ClassLabel(names=COARSE)})
    test_images = test_images or [pixels(3)]
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"img": [pixels(0), pixels(1), pixels(2)], "fine_label": [2, 0, 1],
                                          "coarse_label": [1, 0, 1]}, features=features),
        test=datasets.Dataset.from_dict({"img": test_images, "fine_label": [1] * len(test_images),
                                         "coarse_label": [1] * len(test_images)}, features=features),
    ).save_to_disk(str(saved_folder(cfg)))
    return cfg


def expected(image: Image.Image, size: int) -> torch.Tensor:
    """ViT's processing by hand: a bilinear resize to size x size, then (x / 255 - 0.5) / 0.5, channels first."""
    resized = np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32)
    return torch.from_numpy((resized / 255 - 0.5) / 0.5).permute(2, 0, 1)


@pytest.mark.parametrize("size", [8, 5])
def test_items_are_vits_processed_pixels_and_the_fine_labels(tmp_path: Path, size: int) -> None:
    sets = load_named_images(cifar_like(tmp_path), size)
    assert sets.classes == tuple(FINE) and (len(sets.train), len(sets.val)) == (3, 1)
    for items, index, seed, label in ((sets.train, 0, 0, 2), (sets.train, 2, 2, 1), (sets.val, 0, 3, 1)):
        image, target = items[index]
        assert image.dtype == torch.float32 and image.shape == (3, size, size)
        # exact (measured 0.0 at both sizes): PIL resizes in integers, the rest is one rounding per element
        assert torch.equal(image, expected(pixels(seed), size))
        assert target.dtype == torch.int64 and target.shape == () and target.item() == label


def test_food101s_layout_its_validation_split_before_a_test_one_and_a_grey_photo_in_colour(tmp_path: Path) -> None:
    cfg = DataConfig(source="food101", dir=str(tmp_path / "data"))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["pho", "ramen"])})
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"image": [pixels(0)], "label": [1]}, features=features),
        validation=datasets.Dataset.from_dict({"image": [pixels(1, 12, "L"), {"bytes": b"junk", "path": None}],
                                               "label": [0, 1]}, features=features),
        test=datasets.Dataset.from_dict({"image": [pixels(2)], "label": [1]}, features=features),
    ).save_to_disk(str(saved_folder(cfg)))
    assert saved_folder(cfg) == tmp_path / "data" / "images" / "ethz--food101"
    sets = load_named_images(cfg, 6)
    image, label = sets.val[0]
    assert sets.classes == ("pho", "ramen") and label.item() == 0 and len(sets.val) == 2
    assert torch.equal(image, expected(pixels(1, 12, "L"), 6)) and torch.equal(image[0], image[2])
    with pytest.raises(GptparError, match=r"^data.source=food101: image 1 of the validation split is not a readable"):
        sets.val[1]


def test_the_download_path_saves_every_split_and_keeps_no_second_copy(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dataset (here of a local image folder, read offline) into the data folder; its arrow cache is not left
    in the user's Hugging Face cache nor in the data folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    for split, label, seed in (("train", "cat", 0), ("train", "dog", 1), ("test", "dog", 2)):
        (tmp_path / "pets" / split / label).mkdir(parents=True, exist_ok=True)
        pixels(seed).save(tmp_path / "pets" / split / label / f"{seed}.png")
    cfg = DataConfig(task="classify", source=f"hf:{tmp_path / 'pets'}", dir=str(tmp_path / "data"))
    download(cfg, saved_folder(cfg))
    assert sorted(p.name for p in (tmp_path / "data" / "images").iterdir()) == [saved_folder(cfg).name]
    assert not (tmp_path / "hf-cache").exists()
    sets = load_named_images(cfg, 8)
    assert sets.classes == ("cat", "dog")
    assert torch.equal(sets.val[0][0], expected(pixels(2), 8)) and sets.val[0][1].item() == 1


def test_a_download_that_cannot_be_made_or_saved_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    for split in ("train", "test"):
        for label in ("cat", "dog"):  # two classes: image folders of one have no label column
            (tmp_path / "pets" / split / label).mkdir(parents=True)
            pixels(0).save(tmp_path / "pets" / split / label / "0.png")
    cfg = DataConfig(task="classify", source=f"hf:{tmp_path / 'pets'}", dir=str(tmp_path / "data"))
    saved_folder(cfg).parent.mkdir(parents=True)
    saved_folder(cfg).write_text("a file where the set's folder goes")
    with pytest.raises(GptparError) as error:
        download(cfg, saved_folder(cfg))
    assert str(error.value) == f"cannot write {saved_folder(cfg)} (Not a directory)"
    assert [p.name for p in saved_folder(cfg).parent.iterdir()] == [saved_folder(cfg).name]  # no staging left
    cfg = DataConfig(task="classify", source="hf:nobody-gptpar/not-there", dir=str(tmp_path / "data"))
    with pytest.raises(GptparError) as error:
        download(cfg, saved_folder(cfg))  # offline: datasets' own refusal, in one line
    assert str(error.value).startswith("data.source=hf:nobody-gptpar/not-there: cannot load nobody-gptpar/not-there "
                                       "from the hub: ") and "\n" not in str(error.value)


def test_a_download_without_images_is_refused_before_anything_is_saved(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    (tmp_path / "table").mkdir()
    for split in ("train", "test"):
        (tmp_path / "table" / f"{split}.csv").write_text("caption,stars\na cat,5\n")
    cfg = DataConfig(task="classify", source=f"hf:{tmp_path / 'table'}", dir=str(tmp_path / "data"))
    with pytest.raises(GptparError) as error:
        download(cfg, saved_folder(cfg))
    assert str(error.value) == (f"data.source={cfg.source}: the dataset has no image column (an Image feature; img or "
                                "image first where there are several); its columns: caption (Value), stars (Value)")
    assert list((tmp_path / "data" / "images").iterdir()) == []


def test_a_set_missing_offline_is_one_line_naming_the_fetch_without_trying(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "data"
    for source, command in (("cifar100", "cifar100"), ("hf:someone/birds", "hf:someone/birds data.task=classify")):
        cfg = DataConfig(task="classify", source=source, dir=str(data))
        with pytest.raises(GptparError) as error:
            load_named_images(cfg, 8)
        assert str(error.value) == (f"data.source={source}: not in {saved_folder(cfg)} and the Hugging Face hub is "
                                    f"unreachable; run `gptpar data fetch {command}` where the hub is reachable (a "
                                    "login node), then again here")
    assert not (data / "images").exists()  # no lock taken, no download begun
    cfg = load_config(None, ["data.source=cifar100", f"data.dir={data}", f"log.runs_dir={tmp_path / 'runs'}"])
    with pytest.raises(GptparError, match=r"^data.source=cifar100: not in .* run `gptpar data fetch cifar100`"):
        prepare_run(cfg)  # the submit side, before any run folder
    assert not (tmp_path / "runs").exists()
    assert cli.main(["data", "fetch", "cifar100", f"data.dir={data}"]) == 2
    assert capsys.readouterr().err == ("gptpar: error: data.source=cifar100: the Hugging Face hub is unreachable from "
                                       "this machine (within data.hub_timeout_s=3 s); fetch where it is reachable\n")


def test_a_set_without_an_image_or_a_label_column_names_the_columns_it_has(tmp_path: Path) -> None:
    cfg = DataConfig(task="classify", source="hf:someone/odd", dir=str(tmp_path))
    for columns, features, message in (
        ({"text": ["a"], "label": [0]}, {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["x"])},
         "image column (an Image feature; img or image first where there are several); its columns: text "
         "(Value), label (ClassLabel)"),
        ({"img": [pixels(0)], "label": [0]}, {"img": datasets.Image(), "label": datasets.Value("int64")},
         "label column (a ClassLabel feature, whose names are the classes; fine_label or label first where there "
         "are several); its columns: img (Image), label (Value)"),
    ):
        split = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(saved_folder(cfg)))
        with pytest.raises(GptparError) as error:
            load_named_images(cfg, 8)
        assert str(error.value) == f"data.source=hf:someone/odd: the dataset has no {message}"


def test_a_set_without_a_matching_validation_split_or_not_saved_whole_is_one_line(tmp_path: Path) -> None:
    cfg = DataConfig(source="cifar100", dir=str(tmp_path))
    split = datasets.Dataset.from_dict({"img": [pixels(0)], "fine_label": [0]},
                                       features=datasets.Features({"img": datasets.Image(),
                                                                   "fine_label": datasets.ClassLabel(names=["a"])}))
    datasets.DatasetDict(train=split, extra=split).save_to_disk(str(saved_folder(cfg)))
    with pytest.raises(GptparError) as error:
        load_named_images(cfg, 8)
    assert str(error.value) == ("data.source=cifar100: the dataset needs a train split and a validation one "
                                "(validation, valid, val, test); it has train, extra")
    other = split.cast_column("fine_label", datasets.ClassLabel(names=["b"]))
    datasets.DatasetDict(train=split, test=other).save_to_disk(str(saved_folder(cfg)))
    with pytest.raises(GptparError) as error:
        load_named_images(cfg, 8)
    assert str(error.value) == ("data.source=cifar100: the test split's columns or classes differ from the train "
                                "split's (img, fine_label against img, fine_label)")
    split.save_to_disk(str(saved_folder(cfg)))  # one split, not a DatasetDict
    with pytest.raises(GptparError) as error:
        load_named_images(cfg, 8)
    assert str(error.value) == (f"data.source=cifar100: {saved_folder(cfg)} holds one split, not a train and a "
                                "validation split; delete it and run `gptpar data fetch cifar100`")


def test_an_unreadable_image_is_one_line_naming_its_split_and_index(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not an image")
    stored = [{"bytes": png(pixels(3)), "path": None}, {"bytes": b"junk", "path": None},
              {"bytes": png(pixels(4))[:134], "path": None}, {"bytes": None, "path": str(tmp_path / "notes.txt")},
              None]
    sets = load_named_images(cifar_like(tmp_path, stored), 8)
    assert torch.equal(sets.val[0][0], expected(pixels(3), 8))
    for index, why in ((1, "UnidentifiedImageError"), (2, "OSError"), (3, "UnidentifiedImageError"),
                       (4, "nothing stored")):
        with pytest.raises(GptparError) as error:
            sets.val[index]
        assert str(error.value) == (f"data.source=cifar100: image {index} of the test split is not a readable image "
                                    f"({why})")


def test_augmentation_is_off_by_default_and_never_touches_the_validation_split(tmp_path: Path) -> None:
    cfg = cifar_like(tmp_path)
    assert not cfg.augment
    sets = load_named_images(replace(cfg, augment=True), 8, seed=5)
    assert torch.equal(sets.val[0][0], expected(pixels(3), 8))
    assert not torch.equal(sets.train[0][0], expected(pixels(0), 8)) and sets.train[0][1].item() == 2


def test_an_augmented_item_depends_on_seed_epoch_and_index_only(tmp_path: Path) -> None:
    """Whichever rank reads an item and in whatever order, it is the same: dp ranks equal one process."""
    cfg = replace(cifar_like(tmp_path), augment=True)
    first = load_named_images(cfg, 8, seed=5).train
    forward = [first[i][0] for i in range(3)]
    again = load_named_images(cfg, 8, seed=5).train
    assert all(torch.equal(again[i][0], forward[i]) for i in (2, 0, 1))  # another order, another dataset
    other_seed = load_named_images(cfg, 8, seed=6).train
    again.set_epoch(1)
    for items in (other_seed, again):
        assert not any(torch.equal(items[i][0], forward[i]) for i in range(3))


def test_the_crop_is_torchvisions_random_resized_crop_and_half_the_images_flip() -> None:
    """2,000 boxes each of a square ViT image, a tall one and a wide one (where ten tries often miss and the
    centred crop is taken): inside the image, 8-100 % of its area and a width / height of 3/4 to 4/3 up to rounding
    sides to whole pixels, that ratio uniform in its log; a flip half the time."""
    rng = np.random.default_rng(0)
    for (width, height), rounding, largest in (((224, 224), 0.019, 1.0), ((30, 90), 0.08, 30 * 40 / (30 * 90)),
                                               ((90, 30), 0.08, 40 * 30 / (30 * 90))):
        # rounding: half a pixel of the shortest side a draw can have (55 px; 12.7 px in the others), twice
        boxes = np.array([crop_box(width, height, rng) for _ in range(2000)])
        w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
        area, ratio = w * h / (width * height), w / h  # measured: area 0.0800-0.987, ratio 0.747-1.335 (224 x 224)
        assert area.min() >= 0.08 * (1 - rounding) and area.max() <= largest
        assert ratio.min() >= 3 / 4 * (1 - rounding) and ratio.max() <= 4 / 3 * (1 + rounding)
        if width == height:  # log(ratio) uniform on +-log(4/3): sd 0.166, a mean of 2,000 within 4 standard errors
            assert abs(np.log(ratio).mean()) < 4 * 0.166 / 2000 ** 0.5  # measured 0.0006
    image = pixels(0, 16)
    flipped = [np.array_equal(np.asarray(augmented(image, np.random.default_rng([0, 0, i]))),
                              np.asarray(image.crop(crop_box(16, 16, np.random.default_rng([0, 0, i]))))[:, ::-1])
               for i in range(400)]
    assert 160 <= sum(flipped) <= 240  # binomial(400, 0.5): mean 200, sd 10; 4 sd each side


def test_a_run_on_a_named_set_reads_it_through_the_trainer_with_new_crops_each_epoch(tmp_path: Path,
                                                                                      offline: None) -> None:
    """The trainer's data for data.source=cifar100: the saved set's items (augmented from train.seed) and its classes
    as the model's outputs; each epoch's batches draw that epoch's crops (set_epoch), not epoch 0's again."""
    from rank_training import VIT_BASE, make_config, make_trainer

    from gptpar.parallel.process_group import RankInfo

    data = cifar_like(tmp_path)
    single = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                      launcher="single", backend="gloo", device=torch.device("cpu"))
    cfg = make_config(["data.source=cifar100", f"data.dir={data.dir}", "data.augment=true", "train.batch_size=1",
                       "train.seed=7"], tmp_path / "runs", "named", VIT_BASE)
    trainer = make_trainer(cfg, single)
    assert trainer.classes == tuple(FINE) and trainer.model_config.num_labels == len(FINE)
    expected_set = load_named_images(replace(data, augment=True), 32, seed=7).train
    expected_set.set_epoch(1)
    first = next(trainer.batches(1, 0))[0]
    assert trainer.train_set.epoch == 1
    order = [int(i) for i in first[1]]  # the epoch's first image, by its label (the labels are distinct)
    index = [2, 0, 1].index(order[0])
    assert torch.equal(first[0][0], expected_set[index][0])
