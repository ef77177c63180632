"""Typed exceptions: every bad input names the problem and the fix.

All errors derive from :class:`InterpNormError`, so ``except InterpNormError`` catches
anything this package raises on purpose; each also derives from the built-in type a Python
user would expect (``ValueError``, ``FileNotFoundError`` ...), so generic handlers keep working.
The CLI turns any of them into a one-line message and exit code 2.
"""

from __future__ import annotations

import numbers


class InterpNormError(Exception):
    """Base class for every error raised on purpose by interp_norm."""


class ProblemStringError(InterpNormError, ValueError):
    """A problem string such as ``"[12+N3="`` is not a valid addition problem."""


class ConfigError(InterpNormError, ValueError):
    """A model, task or training configuration is inconsistent or out of range."""


class CheckpointError(InterpNormError, ValueError):
    """A checkpoint folder is missing, truncated, corrupted, or of an unknown format."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists at the given path or under the given pretrained name."""


class NoiseSpecError(InterpNormError, ValueError):
    """A norm-noise specification (level, target, layers, heads, distribution) is invalid."""


class PatchingError(InterpNormError, ValueError):
    """Activation/attribution patching inputs are inconsistent (shapes, hook names, cells)."""


class HookNameError(PatchingError, KeyError):
    """A hook name does not exist on the model."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class PatternNotEditable(PatchingError):
    """Writing into this model's ``hook_pattern`` changes nothing: the hook fires after attention ran
    (Gemma 4 under TransformerLens 4), so attention patterns can be neither patched nor frozen."""


class EngineRefusal(PatchingError):
    """A fast patching engine cannot run this model or hook exactly (a block wired otherwise, an
    attention that ignores the key/value cache, ...). ``activation_patch(method="auto")`` falls back
    to full forward passes with hooks on this error only; any other exception from an engine is a bug
    and propagates."""


class TrainingDivergedError(InterpNormError, RuntimeError):
    """The training loss became NaN or infinite; the last good checkpoint is kept."""


class OutputDirError(InterpNormError, OSError):
    """An output folder cannot be created or written to."""


class GeometryError(InterpNormError, ValueError):
    """A geometry analysis got degenerate input (zero norm gains, empty subspaces, no tokens left)."""


class ArchitectureError(ConfigError):
    """A model's attention cannot be described: a norm, hook or scale is missing or ambiguous
    (raised by :mod:`interp_norm.anatomy` for Hugging Face models it cannot read safely)."""


class TaskMismatchWarning(UserWarning):
    """An analysis was given a task other than the one the model was trained on: it still runs,
    but its numbers describe problems the model never learnt (e.g. the paper's task on a model
    trained on the cpu preset)."""


class OutOfDistributionWarning(UserWarning):
    """A problem given to a model lies outside the problems it was trained on (term lengths or
    number of terms): the answer is extrapolation, not what the model learnt."""


class NoTokenizerWarning(UserWarning):
    """A Hugging Face model was loaded without a tokenizer (none saved beside the weights): it runs on
    token ids, but ``to_tokens`` cannot work and text analyses fall back to random token ids."""


class ConvertedInMemoryWarning(UserWarning):
    """Large tensors converted to another dtype at load are held in memory, not mapped from a temporary
    file (too little free disk, or a temporary folder kept in RAM): the process holds all of each, where a
    folder stored in that dtype would bring only the rows an analysis reads."""


class StatisticsError(InterpNormError, ValueError):
    """A statistic over seeds got unusable input (NaN values, an empty arm, a level outside (0, 1))."""


def check_positive_int(value: object, name: str, error: type[InterpNormError] = ConfigError, hint: str = "") -> int:
    """``value`` if it is an integer >= 1 (a Python or NumPy integer, not a bool); else ``error`` naming
    ``name`` (``hint``, e.g. ``"1 = EAP"``, goes in parentheses after it). The package's one
    positive-integer check: sizes, counts, batch sizes and worker numbers all go through it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        more = f" ({hint})" if hint else ""
        raise error(f"{name} must be a positive integer{more}, got {value!r}")
    return value  # type: ignore[return-value]


__all__ = [
    "PatternNotEditable",
    "check_positive_int",
    "InterpNormError",
    "ProblemStringError",
    "ConfigError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "NoiseSpecError",
    "PatchingError",
    "HookNameError",
    "EngineRefusal",
    "TrainingDivergedError",
    "OutputDirError",
    "GeometryError",
    "ArchitectureError",
    "TaskMismatchWarning",
    "OutOfDistributionWarning",
    "ConvertedInMemoryWarning",
    "StatisticsError",
]
