"""Named GPT-2 shapes, importable without torch (the analysis computes FLOPs from them)."""

# (n_layer, n_embd, n_head, n_positions). The small ones exist so CPUs can train and test.
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "gpt2-tiny": (4, 128, 4, 256),
    "gpt2-mini": (6, 256, 8, 512),
    "gpt2-wide": (4, 768, 12, 1024),  # GPT-2 width, few layers: compute-bound pipeline benchmarks
    "gpt2": (12, 768, 12, 1024),
    "gpt2-medium": (24, 1024, 16, 1024),
    "gpt2-large": (36, 1280, 20, 1024),
    "gpt2-xl": (48, 1600, 25, 1024),
}
