"""Turn the per-rank JSONL logs under runs/ into a summary table and scaling figures."""
