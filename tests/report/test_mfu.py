"""MFU and HFU: FLOPs per token against hand computations, the peak table, and impossible values flagged."""

from __future__ import annotations

from pathlib import Path

import pytest
from logsets import Rank, config

from analysis.mfu import FlopsShape, flops_per_token, hardware_flops_per_token, peak_flops, utilisation
from analysis.report import analyse_runs
from gptpar.adapters import lora_trainable
from gptpar.cli import main as gptpar_main
from gptpar.hardware import PEAK_FLOPS
from gptpar.presets import PRESETS

LATER = 2e9
GPT2 = FlopsShape(PRESETS["gpt2"], seq_len=1024, vocab_size=50257)
# By hand for gpt2 (124M) at T=1024: one block has 12·768² + 13·768 = 7,087,872 parameters;
# N = 12·7,087,872 + 2·768 = 85,056,000; 6N = 510,336,000; LM head 6·50257·768 = 231,584,256;
# attention 12·12·12·64·1024 = 113,246,208.
GPT2_FLOPS = 510_336_000 + 231_584_256 + 113_246_208
# A recomputed block's forward: 2·7,087,872 + 4·768·1024 = 17,321,472 FLOPs per token.
RECOMPUTE_FORWARD = 17_321_472


def test_gpt2_flops_per_token_is_the_hand_computation() -> None:
    assert flops_per_token(GPT2) == GPT2_FLOPS == 855_166_464
    assert hardware_flops_per_token(GPT2) == GPT2_FLOPS  # nothing recomputed
    every_block = FlopsShape(PRESETS["gpt2"], 1024, 50257, recomputed_blocks=12)
    assert flops_per_token(every_block) == GPT2_FLOPS  # model FLOPs do not count recomputation
    assert hardware_flops_per_token(every_block) == GPT2_FLOPS + 12 * RECOMPUTE_FORWARD


@pytest.mark.parametrize(("name", "precision", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12), ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H200", "tf32", 494.7e12), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA L40S", "bf16", 362.05e12), ("Tesla V100-SXM2-32GB", "fp16", 125e12),
    ("Tesla V100-PCIE-16GB", "fp32", 14e12), ("NVIDIA L40", "bf16", 181e12),
    ("Tesla V100-SXM2-32GB", "bf16", None), ("cpu", "fp32", None), ("Quantum X1", "fp32", None),
])
def test_peak_table_matches_the_device_and_precision(name: str, precision: str, peak: float | None) -> None:
    assert peak_flops(name, precision) == peak


def test_an_mfu_above_100_percent_cannot_be_reported_for_any_table_device() -> None:
    for fragment, peaks in PEAK_FLOPS:
        for precision, peak in peaks.items():
            tokens_per_s = 1.01 * peak / flops_per_token(GPT2)  # 101% of one device's peak
            u = utilisation(tokens_per_s, 1, fragment, precision, GPT2)
            assert u.mfu is None and u.note.startswith("flagged"), (fragment, precision)
            ok = utilisation(0.5 * peak / flops_per_token(GPT2), 1, fragment, precision, GPT2)
            assert ok.mfu == pytest.approx(0.5) and ok.hfu == pytest.approx(0.5)


def _gpu_run(runs: Path, name: str, tokens_per_s: float, **overrides) -> None:
    rank = Rank(runs / name, 0, config(**overrides), device="cuda:0", device_name="NVIDIA H100 80GB HBM3",
                vocab_size=50257, precision="bf16", stage_devices=["cuda:0"])
    rank.header()
    for step in range(1, 8):
        rank.step(step, 1, tokens_per_s=tokens_per_s)
    rank.final(step=7)


def test_report_gives_mfu_and_hfu_from_the_logged_precision_and_vocabulary(tmp_path: Path) -> None:
    gpt2 = {"model.preset": "gpt2", "data.seq_len": 1024}
    _gpu_run(tmp_path, "plain", 100_000, **gpt2)
    _gpu_run(tmp_path, "recompute", 100_000, **gpt2, **{"train.activation_checkpointing": "2"})
    _gpu_run(tmp_path, "impossible", 2e6, **gpt2)
    by = {m.run: m for m in analyse_runs(tmp_path, now=LATER)}
    assert by["plain"].mfu == pytest.approx(1e5 * GPT2_FLOPS / 989.4e12)
    assert by["plain"].hfu == by["plain"].mfu
    assert by["recompute"].mfu == by["plain"].mfu  # blocks 0, 2, ..., 10 recompute: 6 of 12
    assert by["recompute"].hfu == pytest.approx(1e5 * (GPT2_FLOPS + 6 * RECOMPUTE_FORWARD) / 989.4e12)
    assert by["impossible"].mfu is None and "flagged" in by["impossible"].mfu_note
    assert any("impossible" in w for w in by["impossible"].warnings)


def test_stages_sharing_one_gpu_count_it_once(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "shared", 0, config(pp_mode="model_parallel", devices="cuda:0,cuda:0"), device="cuda:0",
                device_name="NVIDIA H100 80GB HBM3", vocab_size=4096, stage_devices=["cuda:0", "cuda:0"])
    rank.header()
    for step in range(1, 8):
        rank.step(step, 1, tokens_per_s=1e6)
    rank.final(step=7)
    (m,) = analyse_runs(tmp_path, now=LATER)
    shape = FlopsShape(PRESETS["gpt2-tiny"], 128, 4096)
    assert m.mfu == pytest.approx(1e6 * flops_per_token(shape) / 66.9e12)


def test_a_cpu_has_no_peak_unless_the_user_gives_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rank = Rank(tmp_path / "cpu", 0, config(), vocab_size=4096, stage_devices=["cpu"])
    rank.header()
    for step in range(1, 8):
        rank.step(step, 1, tokens_per_s=1e4)
    rank.final(step=7)
    (m,) = analyse_runs(tmp_path, now=LATER)
    assert m.mfu is None and m.mfu_note == "n/a (unknown peak for cpu)"
    (m,) = analyse_runs(tmp_path, now=LATER, peak_flops=1e11)
    assert m.mfu == pytest.approx(1e4 * flops_per_token(FlopsShape(PRESETS["gpt2-tiny"], 128, 4096)) / 1e11)
    assert "user-given peak 0.1 TFLOP/s" in m.mfu_note
    with pytest.raises(SystemExit) as exit_:
        gptpar_main(["report", str(tmp_path), "--out", str(tmp_path / "fig"), "--peak-flops", "0"])
    assert exit_.value.code == 2
    assert "expected a positive finite number" in capsys.readouterr().err


def test_a_log_without_its_vocabulary_has_no_mfu(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "old", 0, config(), device="cuda:0", device_name="NVIDIA A100-SXM4-80GB")
    rank.header().step(1).final(step=1)
    (m,) = analyse_runs(tmp_path, now=LATER)
    assert m.mfu is None and "vocabulary" in m.mfu_note


def test_llama_family_flops_per_token_is_the_hand_computation() -> None:
    """Qwen2.5-0.5B at T=1024 (24 layers, d=896, 14 heads of 64, 2 KV heads, MLP 4864, q/k/v biases, RMSNorm): one
    block has q and o 2·896² = 1,605,632, k and v 2·896·128 = 229,376, q/k/v biases 896 + 2·128 = 1,152, the gated
    MLP 3·896·4864 = 13,074,432 and two norms 2·896: 14,912,384 parameters. N = 24·14,912,384 + 896 = 357,898,112;
    6N = 2,147,388,672; the head 6·151,936·896 = 816,807,936; attention 12·24·14·64·1024 = 264,241,152."""
    qwen = FlopsShape(PRESETS["qwen2.5-0.5b"], 1024, 151_936)
    assert PRESETS["qwen2.5-0.5b"].block_parameters() == 14_912_384
    assert flops_per_token(qwen) == 2_147_388_672 + 816_807_936 + 264_241_152
    # The same shape's parameter count is Qwen2.5-0.5B's published 494,032,768 (tied head).
    assert PRESETS["qwen2.5-0.5b"].parameters(151_936) == 494_032_768


# By hand for vit-tiny with 10 classes (32 px, patch 8): T = 16 patches + the class token = 17. One block: q, k, v, o
# with biases 4·(64² + 64) = 16,640, the MLP 2·64·256 + 256 + 64 = 33,088, two norms 2·128: 49,984 parameters;
# N = 2·49,984 + 128 = 100,096. Per image: 6·N·T = 10,209,792; attention 12·2·4·16·17² = 443,904; the patch
# projection 6·(3·8²·64 + 64)·16 = 1,185,792; the classifier, over the class token only, 6·(64 + 1)·10 = 3,900.
VIT_IMAGE_FLOPS = 10_209_792 + 443_904 + 1_185_792 + 3_900
# A recomputed block's forward per token: 2·49,984 + 4·64·17 = 104,320.
VIT_RECOMPUTE_FORWARD = 104_320


def test_vit_flops_per_token_are_an_images_over_its_positions() -> None:
    vit = FlopsShape(PRESETS["vit-tiny"], 17, 10)
    assert PRESETS["vit-tiny"].block_parameters() == 49_984
    assert flops_per_token(vit) == VIT_IMAGE_FLOPS / 17  # exact: the sum is an integer a float holds


def test_report_counts_a_vits_positions_not_data_seq_len(tmp_path: Path) -> None:
    """A classify run's tokens are its images' positions (17 for vit-tiny), whatever data.seq_len says (128); both
    blocks recompute under activation checkpointing."""
    vit = config(**{"model.preset": "vit-tiny", "data.task": "classify", "data.seq_len": 128,
                    "train.activation_checkpointing": "block"})
    rank = Rank(tmp_path / "vit", 0, vit, vocab_size=10, stage_devices=["cpu"])
    rank.header()
    for step in range(1, 8):
        rank.step(step, 1, tokens_per_s=1.7e4)
    rank.final(step=7)
    (m,) = analyse_runs(tmp_path, now=LATER, peak_flops=1e11)
    # measured: equal; rel 1e-12 allows another order of the float sums
    assert m.mfu == pytest.approx(1e3 * VIT_IMAGE_FLOPS / 1e11, rel=1e-12)  # 1,000 images/s
    assert m.hfu == pytest.approx((1e3 * VIT_IMAGE_FLOPS + 1.7e4 * 2 * VIT_RECOMPUTE_FORWARD) / 1e11, rel=1e-12)


# Under LoRA a frozen weight costs forward and input gradient, 4 FLOPs a use; the adapters all 6. gpt2's default
# targets, c_attn (768 -> 2304) and attn.c_proj (768 -> 768), at r=8: 8·(768 + 2304) + 8·(768 + 768) = 36,864 a
# block, A = 12·36,864 = 442,368. 4N = 340,224,000; 6A = 2,654,208; the frozen head 4·50257·768 = 154,389,504;
# attention as before 113,246,208. A recomputed block's forward adds its adapters': 2·36,864 = 73,728.
GPT2_LORA8_FLOPS = 340_224_000 + 2_654_208 + 154_389_504 + 113_246_208


def test_lora_counts_a_frozen_weight_four_times_and_an_adapter_six() -> None:
    lora = lora_trainable(PRESETS["gpt2"], 50257, 8, ["c_attn", "attn.c_proj"])
    assert lora.blocks == 442_368
    shape = FlopsShape(PRESETS["gpt2"], 1024, 50257, recomputed_blocks=12, lora=lora)
    assert flops_per_token(shape) == GPT2_LORA8_FLOPS == 610_513_920
    assert hardware_flops_per_token(shape) == GPT2_LORA8_FLOPS + 12 * (RECOMPUTE_FORWARD + 73_728)


def test_a_lora_vits_classifier_trains_whole_and_its_patch_projection_is_frozen() -> None:
    """vit-tiny, 10 classes, r=4 on q, k, v and o (64 -> 64): A = 2 blocks · 4 · 4·128 = 4,096. Per image 4·N·T =
    6,806,528, 6·A·T = 417,792, attention 443,904, the frozen projection 4·(3·8²·64 + 64)·16 = 790,528, the classifier
    still 6·(64 + 1)·10 = 3,900."""
    lora = lora_trainable(PRESETS["vit-tiny"], 10, 4, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert (lora.blocks, lora.head_whole) == (4_096, True)
    image = 6_806_528 + 417_792 + 443_904 + 790_528 + 3_900
    assert flops_per_token(FlopsShape(PRESETS["vit-tiny"], 17, 10, lora=lora)) == pytest.approx(image / 17, rel=1e-15)


def test_report_gives_a_lora_runs_mfu_by_what_trains(tmp_path: Path) -> None:
    """The logged train.lora_rank and targets give the count; targets gptpar.adapters cannot count give no MFU."""
    gpt2 = {"model.preset": "gpt2", "data.seq_len": 1024, "train.lora_rank": 8}
    _gpu_run(tmp_path, "lora", 100_000, **gpt2)
    _gpu_run(tmp_path, "uncounted", 100_000, **gpt2, **{"train.lora_targets": "ln_1"})
    by = {m.run: m for m in analyse_runs(tmp_path, now=LATER)}
    assert by["lora"].mfu == pytest.approx(1e5 * GPT2_LORA8_FLOPS / 989.4e12)
    assert by["uncounted"].mfu is None and "LoRA targets" in by["uncounted"].mfu_note
