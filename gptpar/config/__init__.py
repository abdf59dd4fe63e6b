"""One typed config tree, loaded from YAML and `section.key=value` overrides, validated once.

schema.py declares every key with its help text and constraints; text.py reads and writes configs (YAML,
overrides, layers with their origins); checks.py holds the cross-key checks and calls each parallelism's own
(parallel_checks.py, which reads the tables of gptpar/strategies); reference.py generates docs/config_reference.md.
The package imports nothing of gptpar above it: errors, paths, presets and the torch-free strategy tables only.
"""

from gptpar.config.checks import (
    IMAGE_SOURCES,
    PRETRAINED_ON_META,
    SFT_SAMPLE,
    TRANSLATION_SOURCES,
    check_context,
    check_expert_grid,
    checkpoint_interval,
    checkpointed_indices,
    data_config,
    example_width,
    fixed_width,
    profiled_steps,
    validate,
    whole_compile_obstacle,
)
from gptpar.config.reference import reference_markdown, with_reference
from gptpar.config.schema import (
    PAIR_TASKS,
    PRECISIONS,
    SECTIONS,
    TASKS,
    Config,
    DataConfig,
    LaunchConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    ReportConfig,
    TrainConfig,
)
from gptpar.config.text import (
    Layer,
    apply_dict,
    config_digest,
    config_from_dict,
    config_layers,
    load_config,
    nested,
    overrides_tree,
    parse_override,
    read_yaml,
    resolve_layers,
    shape_values,
    split_config_args,
    to_yaml,
    to_yaml_with_origins,
    updated,
)
from gptpar.errors import ConfigError

__all__ = [
    "IMAGE_SOURCES", "PAIR_TASKS", "PRECISIONS", "PRETRAINED_ON_META", "SFT_SAMPLE", "SECTIONS", "TASKS",
    "TRANSLATION_SOURCES",
    "Config", "ConfigError",
    "DataConfig", "LaunchConfig", "Layer", "LogConfig", "ModelConfig", "ParallelConfig", "ReportConfig", "TrainConfig",
    "apply_dict", "check_context", "check_expert_grid", "checkpoint_interval", "checkpointed_indices", "config_digest",
    "config_from_dict", "config_layers", "data_config", "example_width", "fixed_width", "load_config", "nested",
    "overrides_tree", "parse_override", "profiled_steps", "read_yaml", "reference_markdown",
    "resolve_layers", "shape_values", "split_config_args", "to_yaml", "to_yaml_with_origins", "updated", "validate",
    "whole_compile_obstacle", "with_reference",
]
