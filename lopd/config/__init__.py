"""The run configuration: sections with their checks, presets, YAML files and overrides.

:class:`Config` (:mod:`lopd.config.config`) holds one of each section
(:mod:`lopd.config.sections`, :mod:`lopd.config.method_sections`); :func:`load_config`
(:mod:`lopd.config.loading`) builds one from a preset (:mod:`lopd.config.presets`), a YAML file
and ``section.field=value`` overrides.
"""

from lopd.config.checks import BankTooSmallError, ConfigError, MissingDependencyError
from lopd.config.config import Config, check_tasks_file
from lopd.config.loading import load_config
from lopd.config.method_sections import (
    GRPOConfig,
    LOPDConfig,
    LOPDPPOConfig,
    OPSDConfig,
    SDFTConfig,
    SDPOConfig,
    SkillSDConfig,
)
from lopd.config.presets import COMPARE_BUDGETS, PRESETS, preset_yaml
from lopd.config.sections import (
    ENGINES,
    BankConfig,
    ColdStartConfig,
    ComposerConfig,
    DataConfig,
    EvalConfig,
    GenConfig,
    ModelConfig,
    TrainConfig,
)

__all__ = [
    "COMPARE_BUDGETS",
    "ENGINES",
    "PRESETS",
    "BankConfig",
    "BankTooSmallError",
    "ColdStartConfig",
    "ComposerConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "GenConfig",
    "LOPDConfig",
    "LOPDPPOConfig",
    "MissingDependencyError",
    "ModelConfig",
    "OPSDConfig",
    "SDFTConfig",
    "SDPOConfig",
    "SkillSDConfig",
    "TrainConfig",
    "check_tasks_file",
    "load_config",
    "preset_yaml",
]
